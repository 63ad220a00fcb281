"""A region of a Dynamo graph as a graph module of its own, for a tile of any length.

``region_module(closure, axis, analysis)``: a ``GraphModule`` ``(entry, *others) -> (exits)``
with the region's nodes copied in order (its names generic, so that every layer's region is the
same code: one compile for all), and each size the graph wrote as a number of tokens made a
multiple of the entry's length along ``axis`` instead: Dynamo recorded ``view(24, 2, 32)`` and
``arange(48)`` for 24 tokens of 2 experts each; a tile of t tokens needs ``view(t, 2, 32)``
and ``arange(2 * t)``.  A size counts as tokens where it stands for a token axis of the value
made (by the token analysis's rule: a multiple of the tokens on the rank, not the trailing
feature axis of a float): in the shape of a ``view``, ``reshape``, ``expand``, ``new_*`` or a
factory (``zeros``, ``empty``, ``ones``, ``full``), the end of an ``arange``.  A multiple of the
tokens anywhere else refuses the region (``NotTiled``).

``layouts(module, closure, axis, tile)`` then runs the module on fake inputs at full length and
at one tile (the sizes right, or ``NotTiled``), and reads where a tile lands in each output
(``ops.tiling.region.Layout``).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from loong_compile.ops.tiling.region import Layout
from loong_compile.passes.fx.nodes import example_value, op_name
from loong_compile.passes.fx.token_analysis import TokenAnalysis
from loong_compile.passes.tiling.region_find import Closure

Node = torch.fx.Node

# calls whose arguments after the first are an output shape (one tuple, or one int per axis)
_SHAPED_METHODS = {"view", "reshape", "expand", "new_empty", "new_zeros", "new_ones", "new_full"}
# ... whose first arguments are
_SHAPED_FUNCTIONS = {"reshape": 1, "zeros": 0, "empty": 0, "ones": 0, "full": 0}


class NotTiled(Exception):
    """Why a qualifying region cannot be cut into tiles (reported; the graph keeps it)."""


def region_module(closure: Closure, axis: int, analysis: TokenAnalysis) -> torch.fx.GraphModule:
    """The region as a module of ``(entry, *others)`` for an entry of any length along ``axis``."""
    graph = torch.fx.Graph()
    env: dict[Node, Any] = {closure.entry: graph.placeholder("entry")}
    for i, other in enumerate(closure.others):
        env[other] = graph.placeholder(f"in{i}")
    length = graph.create_node("call_method", "size", (env[closure.entry], axis), name="tokens")
    full = example_value(closure.entry).shape[axis]
    names = iter(f"v{i}" for i in range(len(closure.constants) + len(closure.nodes)))
    for node in [*closure.constants, *closure.nodes]:
        args, kwargs = _scaled_sizes(node, full, length, graph, analysis, env)
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name=next(names))
    graph.output(tuple(env[n] for n in closure.exits))
    if not length.users:
        graph.erase_node(length)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _scaled_sizes(node: Node, full: int, length: Node, graph: torch.fx.Graph,
                  analysis: TokenAnalysis, env: dict) -> tuple[tuple, dict]:
    """``node``'s arguments in the new graph, each size of a token axis a multiple of
    ``length`` (the tile's tokens) instead of ``full`` (the graph's)."""
    args = torch.fx.node.map_arg(node.args, env.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
    name = op_name(node)
    start = None
    if node.op == "call_method" and name in _SHAPED_METHODS:
        start = 1
    elif node.op == "call_function" and name in _SHAPED_FUNCTIONS:
        start = _SHAPED_FUNCTIONS[name]
    value = example_value(node)
    if start is not None and isinstance(value, torch.Tensor):
        token_axes = set(analysis.axes_of(value))
        args = list(args)
        nested = len(args) > start and isinstance(args[start], (tuple, list))
        sizes = list(args[start] if nested else args[start:])
        sizes = [_tokens(size, full, length, graph, f"{name} size") if axis in token_axes
                 else size for axis, size in enumerate(sizes)]
        if nested:   # one shape; then new_full's and full's fill value
            args[start] = type(args[start])(sizes)
        else:
            args[start:] = sizes
        _refuse_token_sizes(name, (args[:start], args[start + 1:] if nested else ()), kwargs, full)
        return tuple(args), kwargs
    if name == "arange" and node.op == "call_function" and len(args) == 1 and not kwargs.keys() - {
            "dtype", "device", "layout", "pin_memory", "requires_grad"}:
        return (_tokens(args[0], full, length, graph, "arange end"),), kwargs
    _refuse_token_sizes(name, args, kwargs, full)
    return tuple(args), kwargs


def _tokens(size: Any, full: int, length: Node, graph: torch.fx.Graph, where: str) -> Any:
    """A size of ``full`` tokens times k as ``length`` times k (-1 and symbols stay)."""
    if not isinstance(size, int) or size == -1:
        return size
    if size % full:
        raise NotTiled(f"the {where} {size} is a token axis but no multiple of the "
                       f"{full} tokens the region is cut along")
    return length if size == full else graph.call_function(operator.mul, (length, size // full))


def _refuse_token_sizes(name: str, args: Any, kwargs: dict, full: int) -> None:
    """A number of tokens where the region cannot tell what it sizes."""
    flat: list[Any] = []
    torch.fx.node.map_aggregate((args, kwargs), flat.append)
    for item in flat:
        if isinstance(item, int) and not isinstance(item, bool) and item >= full \
                and item % full == 0:
            raise NotTiled(f"{name} takes {item}, a multiple of the {full} tokens the region is "
                           "cut along, where it is not a shape")


def layouts(module: torch.fx.GraphModule, closure: Closure, axis: int,
            tile: int) -> tuple[Layout, ...]:
    """Where a tile lands in each exit, checked by running ``module`` on fake inputs at full
    length (every exit as the graph had it) and at ``tile`` tokens (each exit cut along one
    axis, by as much)."""
    entry = example_value(closure.entry)
    others = [example_value(o) for o in closure.others]
    if not all(isinstance(o, torch.Tensor) for o in others):
        raise NotTiled("it reads a value from outside that is not a tensor")
    want = [example_value(e) for e in closure.exits]
    full_length = entry.shape[axis]
    with entry.fake_mode:
        try:
            at_full = module(torch.empty_like(entry), *others)
            shape = list(entry.shape)
            shape[axis] = tile
            at_tile = module(entry.new_empty(shape), *others)
        except Exception as error:  # noqa: BLE001 - any failure leaves the region whole
            raise NotTiled(f"it does not run on a tile of {tile} tokens: "
                           f"{type(error).__name__}: {str(error)[:200]}") from None
    groups_before = math.prod(entry.shape[:axis])
    result = []
    for exit_node, expected, whole, part in zip(closure.exits, want, at_full, at_tile):
        if tuple(whole.shape) != tuple(expected.shape) or whole.dtype != expected.dtype:
            raise NotTiled(f"{exit_node.name} comes out {tuple(whole.shape)} instead of "
                           f"{tuple(expected.shape)}")
        cut = [i for i, (a, b) in enumerate(zip(whole.shape, part.shape)) if a != b]
        if len(cut) != 1 or whole.shape[cut[0]] * tile != part.shape[cut[0]] * full_length:
            raise NotTiled(f"{exit_node.name} is not cut along one axis as its input is "
                           f"({tuple(whole.shape)} at full length, {tuple(part.shape)} a tile)")
        at = cut[0]
        groups, kept = divmod(groups_before, max(1, math.prod(whole.shape[:at])))
        if kept or whole.shape[at] % (max(1, groups) * full_length):
            raise NotTiled(f"{exit_node.name} holds its tokens in an order a tile cannot find")
        result.append(Layout(tuple(whole.shape), whole.dtype, at, max(1, groups)))
    return tuple(result)
