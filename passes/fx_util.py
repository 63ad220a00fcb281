"""FX graph facts the passes share: which op is the attention, views and the storage behind
them, bytes and FLOPs of a node, random ops, adding a call with its fake value, graph order,
and where a node came from (its source line, and the ``nn_module_stack`` module paths Dynamo
records: one parser for all of them).
"""

from __future__ import annotations

import operator
import re
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from loong_compile._compat.aot import fake_mode_of, size_hint

aten = torch.ops.aten

# The attention ops: PyTorch's SDPA kernels (what a single process traces) and 2D-Attention's
# two forward ops, the ring (causal or full) and the masked one (padding, packed documents,
# windows): a layer is found by its attention op, so one missing here leaves its layers to no
# policy.  Looked up by name, so a missing op (loong_compile.ops not imported, a kernel absent
# from this build) is simply not in the set.
ATTENTION_OP_NAMES = (
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "loong.ring_attention_fwd",
    "loong.masked_attention_fwd",
)


def attention_ops() -> frozenset:
    """The OpOverloadPackets that count as "the attention op" (forward, returning out and lse)."""
    found = []
    for name in ATTENTION_OP_NAMES:
        namespace, op = name.split(".")
        try:
            found.append(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


def is_attention(node: torch.fx.Node, ops: frozenset | None = None) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (
        attention_ops() if ops is None else ops)


# Ops that communicate: running one again in the backward would replay the collective (and
# every rank would have to replay it alike).  By name, like the attention ops.
COLLECTIVE_NAMESPACES = ("_c10d_functional",)
COLLECTIVE_OP_NAMES = ("loong.ring_attention_fwd", "loong.ring_attention_bwd",
                       "loong.masked_attention_fwd", "loong.masked_attention_bwd")


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` communicates, or is a result (``getitem``) of an op that does."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return is_collective(node.args[0])
    name = getattr(node.target, "name", None)
    name = name() if callable(name) else ""
    qualified = name.split("::")[0] + "." + name.split("::")[-1].split(".")[0] if "::" in name else ""
    return qualified in COLLECTIVE_OP_NAMES or qualified.split(".")[0] in COLLECTIVE_NAMESPACES


def getitem_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The getitem nodes reading a multi-output op's results (the attention's out, lse, ...)."""
    return [u for u in node.users if u.target is operator.getitem]


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers (running it again gives other values)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def ancestors(roots: Iterable[Any], stop: Callable[[torch.fx.Node], bool] | None = None,
              inputs: Callable[[torch.fx.Node], Iterable[Any]] | None = None
              ) -> dict[torch.fx.Node, None]:
    """The nodes ``roots`` are computed from, the roots included, in the order first reached
    (an ordered set).  A node for which ``stop`` holds is neither included nor walked past;
    ``inputs`` gives a node's inputs (default: its ``all_input_nodes``; e.g. a body's
    placeholder -> the outer node it stands for).  Non-node roots and inputs are skipped."""
    found: dict[torch.fx.Node, None] = {}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if not isinstance(node, torch.fx.Node) or node in found or (stop and stop(node)):
            continue
        found[node] = None
        todo.extend(node.all_input_nodes if inputs is None else inputs(node))
    return found


def tangent_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes of a joint graph that depend on a tangent: the backward; all others are forward."""
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


# -- views, bytes, FLOPs, new calls ------------------------------------------------------------

def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value shares its input's storage (``_unsafe_view`` does too)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0])
    target = node.target
    return target is aten._unsafe_view.default or bool(getattr(target, "is_view", False))


_LAYOUT_COPIES = (aten.clone.default, aten.contiguous.default, aten.reshape.default)


def is_layout_op(node: torch.fx.Node) -> bool:
    """A view, or a copy that only changes the layout (the SeqAlltoAll's pack and unpack)."""
    return is_view(node) or (node.op == "call_function" and node.target in _LAYOUT_COPIES)


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node that owns ``node``'s storage (``node`` itself unless it is a view)."""
    while is_view(node):
        node = node.args[0].args[0] if node.target is operator.getitem else node.args[0]
    return node


def view_path(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The view nodes from ``base_of(node)`` (exclusive) to ``node`` (inclusive), in order."""
    path = []
    while is_view(node):
        path.append(node)
        if node.target is operator.getitem:
            path.append(node.args[0])
            node = node.args[0].args[0]
        else:
            node = node.args[0]
    return path[::-1]


def nbytes(node: torch.fx.Node) -> int:
    """Bytes of the storage behind ``node``'s value (for a symbolic size: at its example value,
    read without a guard, so a dimension marked dynamic stays dynamic)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return size_hint(val.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return size_hint(val.numel()) * val.element_size()


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one node from its fake values: matmuls via PyTorch's flop formulas, attention
    as 2·B·H·Sq·Sk·(D + D_v) (scores, then values; half of it when causal); everything else
    counts as 0."""
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
        return 0
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    if is_attention(node):
        q, k, v = vals[0], vals[1], vals[2]
        named = node.normalized_arguments(None, normalize_to_only_use_kwargs=True)
        named = named.kwargs if named is not None else {}
        b, h, sq, d = q.shape
        # the ring op sees one KV chunk at a time; its queries meet all cp chunks
        flops = 2 * b * h * sq * k.shape[-2] * (d + v.shape[-1]) * named.get("cp", 1)
        return flops // 2 if named.get("is_causal", False) else flops
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        return 0
    kwargs = {k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs.items()}
    try:
        return int(formula(*vals, out_val=node.meta.get("val"), **kwargs))
    except (TypeError, ValueError, AttributeError):
        return 0


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
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in anchor.meta:
            node.meta[key] = anchor.meta[key]

    def value(a: Any) -> Any:
        return a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a

    # the example values' own mode (not the tracing context's, which detect_fake_mode prefers)
    mode = next(v.fake_mode for v in map(value, (anchor, *node.all_input_nodes))
                if hasattr(v, "fake_mode"))
    with mode:
        node.meta["example_value"] = target(*torch.fx.node.map_aggregate(node.args, value),
                                            **torch.fx.node.map_aggregate(node.kwargs, value))
    return node


# -- graph order --------------------------------------------------------------------------

def first_in_order(nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    """The earliest of ``nodes`` (of one graph) in graph order: FX nodes compare by their place,
    so no walk over the graph (the passes call this per saved value: a walk made it quadratic)."""
    return min(nodes)


def last_in_order(nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    """The latest of ``nodes`` (of one graph) in graph order."""
    return max(nodes)


# -- autocast -----------------------------------------------------------------------------

def autocast_dtypes(graph: torch.fx.Graph, device_type: str) -> dict[torch.fx.Node, torch.dtype | None]:
    """The dtype autocast casts to on ``device_type`` at each node (None where it is off).

    Dynamo traces under the autocast state the compiled function was called in (and guards on
    it), so the graph starts in that state; its own ``with torch.autocast(...)`` blocks are
    ``_enter_autocast(device, dtype, enabled, cache)`` / ``_exit_autocast(ctx)`` calls.
    """
    default = torch.get_autocast_dtype(device_type)
    states = [default if torch.is_autocast_enabled(device_type) else None]
    entered: list[torch.fx.Node] = []
    out = {}
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name == "_enter_autocast":
            device, dtype, enabled = (list(node.args) + [None] * 3)[:3]
            if device != device_type:
                state = states[-1]
            else:
                state = None if enabled is False else (dtype or default)
            states.append(state)
            entered.append(node)
        elif name == "_exit_autocast" and entered and node.args and node.args[0] is entered[-1]:
            entered.pop()
            states.pop()
        out[node] = states[-1]
    return out


# -- module paths ---------------------------------------------------------------------------

# Dynamo writes a module path as ``L['self'].layers[3]._modules['mlp']`` (or ``.layers.3.mlp``);
# its root is where the compiled function found the module: a local or a global, indexed or
# not (``L['self']``, ``L['args'][0]`` when transformers wraps ``forward``, ``G['model']`` or
# ``L['model']`` for a step function that calls the model).  Paths are read from the root on,
# so a layer is ``model.layers.3`` however the model was reached.
_PATH_ROOT = re.compile(r"^[LG]\['[^']*'\](?:\[\d+\]|\['[^']*'\])*")
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']+)'\]")


def module_path(node: torch.fx.Node) -> str:
    """The innermost module path on ``node``'s ``nn_module_stack`` as Dynamo wrote it."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path, _ = list(stack.values())[-1]
    return str(path)


def source_line(node: torch.fx.Node) -> str:
    """The innermost frame of the node's stack trace outside torch itself, and its code."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [(lines[i], lines[i + 1] if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].startswith("File ")]
    outside = [f for f in frames if _TORCH_DIR not in f[0]] or frames
    return f"{outside[-1][0]}: {outside[-1][1]}".strip() if outside else "<unknown source>"


_TORCH_DIR = str(Path(torch.__file__).parent)


def module_path_parts(path: str) -> list[str]:
    """The attribute names from the root module to the module at ``path``
    (``L['self'].layers[3]._modules['mlp']`` -> ``['layers', '3', 'mlp']``)."""
    names = (attr or index or key for attr, index, key in _PATH_PART.findall(_PATH_ROOT.sub("", path)))
    return [name for name in names if name != "_modules"]


def normalize_module_path(path: str) -> str:
    """Dynamo's module path (``L['self'].layers[3]._modules['mlp']``) as ``layers.3.mlp``."""
    return ".".join(module_path_parts(path))


def layer_of_paths(paths: Iterable[str]) -> str | None:
    """The transformer layer on one module stack (outer to inner): the outermost element of a
    ModuleList or Sequential, e.g. ``layers.0`` or ``model.layers.3``; None outside every layer."""
    for path in paths:
        parts = module_path_parts(path)
        index = next((k for k, part in enumerate(parts) if k > 0 and part.isdigit()), None)
        if index is not None:
            return ".".join(parts[:index + 1])
    return None
