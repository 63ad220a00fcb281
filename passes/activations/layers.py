"""Transformer layer discovery: which layer each forward node belongs to (from its
``nn_module_stack``), each layer's input (the residual stream entering it), its attention
ops, and the layer values read outside every layer.

A graph compiled from one block (``layer.compile()``, ``lc.hf.compile_blocks``, FSDP2's
per-block units) holds no ModuleList element: it is one layer whose input is a graph input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.aten_ops import attention_ops, is_attention
from loong_compile.passes.fx.module_paths import layer_of_paths


def layer_name(node: torch.fx.Node) -> str | None:
    """The transformer layer a forward node belongs to: the outermost ModuleList element on its
    ``nn_module_stack``, e.g. ``layers.0`` or ``model.layers.3``; None outside every layer."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return layer_of_paths(str(path) for path, _ in stack.values())


@dataclasses.dataclass
class Layers:
    """The transformer layers of a forward (or joint) graph, in forward order."""

    names: list[str]
    node_layer: dict[torch.fx.Node, int]          # forward compute nodes inside a layer
    inputs: dict[int, list[torch.fx.Node]]        # each layer's input(s): the residual stream in
    attention: dict[int, list[torch.fx.Node]]     # each layer's attention op nodes
    leaving: set[torch.fx.Node]                   # layer values read by forward code outside every layer
    # the graph is one block compiled on its own: every block runs it, so none stays resident
    one_block: bool = False

    def layer_of(self, node: torch.fx.Node) -> int | None:
        return self.node_layer.get(node)


def find_layers(graph: torch.fx.Graph, is_forward: Callable[[torch.fx.Node], bool] = lambda n: True,
                returned: Sequence[Any] | None = None) -> Layers:
    """Layers from ``nn_module_stack`` (elements of a ModuleList or Sequential that hold an
    attention op); a layer's input is the value from outside the layer
    that has the shape and dtype of a value the layer hands on (a block maps the residual
    stream to one of the same shape), preferring one no other layer reads (RoPE tables are
    read by every layer).  ``returned``: what the forward returns to its caller (default:
    every forward value the graph's output reads), for a graph that is one block."""
    ops = attention_ops()
    named = {n: layer_name(n) for n in graph.nodes if n.op == "call_function" and is_forward(n)}
    # A transformer layer is a ModuleList / Sequential element with an attention op in it.
    with_attention = {name for n, name in named.items() if name is not None and is_attention(n, ops)}
    names = list(dict.fromkeys(name for name in named.values() if name in with_attention))
    if not names:
        if returned is None:
            returned = [n for n in graph.output_node().all_input_nodes if is_forward(n)]
        return _one_block(graph, list(named), is_forward, ops, returned)
    index = {name: i for i, name in enumerate(names)}
    node_layer = {n: index[name] for n, name in named.items() if name in index}
    inputs: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    attention: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    leaving: set[torch.fx.Node] = set()
    external: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    handed_on: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    readers: dict[torch.fx.Node, set[int]] = {}
    for node, i in node_layer.items():
        if is_attention(node, ops):
            attention[i].append(node)
        for a in node.all_input_nodes:
            if node_layer.get(a) != i:
                readers.setdefault(a, set()).add(i)
                if a not in external[i]:
                    external[i].append(a)
        # Readers in other modules of the forward; the backward's nodes (and forward-only
        # helpers the partition may move there) carry no nn_module_stack.
        outside = [u for u in node.users if u.meta.get("nn_module_stack") and is_forward(u)
                   and node_layer.get(u) != i]
        if outside:
            handed_on[i].append(node)
        if any(node_layer.get(u) is None for u in outside):
            leaving.add(node)
    for i in range(len(names)):
        shapes = {_signature(n) for n in handed_on[i]} - {None}
        candidates = [a for a in external[i] if _is_float(a) and _signature(a) in shapes]
        computed = [a for a in candidates if a.op != "placeholder"]   # not parameters
        candidates = computed or candidates
        if len(candidates) > 1:
            own = [a for a in candidates if readers.get(a) == {i}]
            candidates = own or candidates
        inputs[i] = candidates
    return Layers(names, node_layer, inputs, attention, leaving)


def _one_block(graph: torch.fx.Graph, nodes: list[torch.fx.Node],
               is_forward: Callable[[torch.fx.Node], bool], ops, returned: Sequence[Any]) -> Layers:
    """A graph with attention and no ModuleList element, one of whose float inputs has the shape
    and dtype of a value the forward returns (a block maps the residual stream to one of the
    same shape): one layer, all its forward ``nodes`` in it, that input its input.  Else no
    layer."""
    attention = [n for n in nodes if is_attention(n, ops)]
    shapes = {_signature(n) for n in returned
              if isinstance(n, torch.fx.Node) and n.op != "placeholder"} - {None}
    inputs = [n for n in graph.find_nodes(op="placeholder")
              if is_forward(n) and _is_float(n) and _signature(n) in shapes]
    if not attention or not inputs:
        return Layers([], {}, {}, {}, set())
    return Layers(["block"], dict.fromkeys(nodes, 0), {0: inputs}, {0: attention}, set(), one_block=True)


def _signature(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")   # sizes as text: symbolic ones (s0) are not hashable
    return (tuple(str(s) for s in val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


