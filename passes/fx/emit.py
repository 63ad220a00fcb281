"""Adding a call to a graph: its fake value (``val`` in AOTAutograd's graphs, ``example_value``
in Dynamo's) and the source metadata of the node it stands for."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from loong_compile._compat.aot import fake_mode_of

# Where a node came from: a call written in its place carries them on, so the report's source
# lines, module paths and layers (``module_paths``) name the model's code, not the pass's.
SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def copy_source_meta(src: torch.fx.Node, dst: torch.fx.Node, also: tuple[str, ...] = ()) -> None:
    """Give ``dst`` the ``SOURCE_META`` of ``src``, and its ``also`` keys (e.g. the value of a
    node it replaces, when running the new op at compile time is not an option)."""
    for key in (*SOURCE_META, *also):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def set_meta(node: torch.fx.Node) -> None:
    """Compute ``node.meta["val"]`` from its inputs' fake values (for nodes a pass adds)."""
    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    if node.target is operator.getitem:
        node.meta["val"] = args[0][args[1]]
        return
    fake_mode = fake_mode_of([a.meta.get("val") for a in node.all_input_nodes])
    if fake_mode is None:
        raise RuntimeError(f"no fake values on the inputs of {node.format_node()}")
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def insert_call(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None,
                name: str | None = None) -> torch.fx.Node:
    """Add a call at the graph's current insertion point, with its fake value."""
    node = graph.call_function(target, args, kwargs or {}, name=name)
    set_meta(node)
    return node


def insert_dynamo_call(graph: torch.fx.Graph, anchor: torch.fx.Node, target: Any, args: tuple,
                       kwargs: dict | None = None) -> torch.fx.Node:
    """Add a call before ``anchor`` in a Dynamo graph, with the anchor's source metadata and its
    ``example_value`` from ``target``'s fake kernel (in the fake mode of the anchor's value,
    else of its inputs')."""
    with graph.inserting_before(anchor):
        node = graph.call_function(target, args, kwargs or {})
    copy_source_meta(anchor, node)

    def value(a: Any) -> Any:
        return a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a

    # the example values' own mode (not the tracing context's, which detect_fake_mode prefers)
    mode = next(v.fake_mode for v in map(value, (anchor, *node.all_input_nodes))
                if hasattr(v, "fake_mode"))
    with mode:
        node.meta["example_value"] = target(*torch.fx.node.map_aggregate(node.args, value),
                                            **torch.fx.node.map_aggregate(node.kwargs, value))
    return node
