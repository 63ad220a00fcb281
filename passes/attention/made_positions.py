"""Positions the model makes itself: ``arange(T)`` that RoPE or a position embedding reads
becomes the layout's positions of the rank's tokens.

A transformers model called without ``position_ids`` numbers its tokens
``arange(seq_len)`` (``cache_position``) and rotates (RoPE) or looks up (a learned position
embedding) by that number.  On a rank holding ``T`` tokens of a longer sequence that is
``0..T-1``, and every rank but the first rotates its tokens by the wrong angle.  One process
numbers the same tokens by their place in the sequence, which is the layout's
(``parallel/tokens.py``): ``loong_compile.ops.layout_positions`` is that number, with no
communication.

What is proven before the rewrite, on the graph, never from a name:
* the ``arange`` counts the rank's tokens from 0: ``arange(T)`` (or ``arange(0, T)``, step 1,
  integer) where ``T`` is the local token count;
* it is read as positions: the values computed from it alone (and from the model's weights and
  constants: its *positions-only* values) include an angle (``cos``, ``sin``, ``polar``: RoPE),
  a lookup in a weight indexed by it (a learned position embedding, a cos/sin table), or a cast
  to a float (a number made from the position, as Llama 4's attention temperature on its NoPE
  layers: an index would stay an integer);
* those positions-only values hold one token axis at most: a value with two (a ``T x T``
  comparison, which is what a mask made of positions is) would pair a rank's tokens with its own
  only, so the ``arange`` is left as it is and ``token_locality`` refuses it by name.
Everything computed from the positions together with other token data is left to
``token_locality``, which proves it per token like any other value.

A rank's tokens then carry the layout's positions without the caller passing them; what the
layout cannot see is a batch that was not cut with ``shard_batch`` (every rank given the whole
sequence): the graph records its token inputs (``MADE_POSITIONS``) and ``checks/inputs.py``
refuses, before each call, the ranks of a sequence all holding the same tokens.

Contract
--------
stage:    dynamo, after ``attention_2d`` (masks it rewrote no longer read the ``arange``)
applies:  when ``hp * cp > 1``
emits:    ``layout_positions(T, hp, cp, hp_group, cp_group, device)`` for each proven ``arange``
provides: ``MADE_POSITIONS`` (``ctx.state``): the indices of the graph's token inputs when a
          rewrite was made (else empty)
reports:  each ``arange`` replaced (source, what read it as positions) and each left (why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.ops.sequence import layout_positions
from loong_compile.passes.base import PassContext, ShardedPass
from loong_compile.passes.fx.emit import insert_dynamo_call
from loong_compile.passes.fx.module_paths import source_line
from loong_compile.passes.fx.nodes import example_value, is_weight, node_arg, op_name
from loong_compile.passes.fx.op_sets import ANGLES, DTYPE_CASTS
from loong_compile.passes.fx.tokens import counts_tokens, local_token_count

# The fact: {"inputs": graph input indices of the token data} when positions were made.
MADE_POSITIONS = "made_positions"
LOOKUPS = {"embedding", "getitem", "index_select"}


class MadePositionsPass(ShardedPass):
    name = "made_positions"
    stage = "dynamo"
    provides = (MADE_POSITIONS,)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        graph = gm.graph
        tokens = local_token_count(gm)
        inputs = list(graph.find_nodes(op="placeholder"))
        data = _token_data(inputs)
        changed, left = [], []
        for node in [n for n in graph.nodes if op_name(n) == "arange"]:
            if tokens is None or not _counts_local_tokens(node, tokens):
                continue
            read_as, why_not = _read_as_positions(node, tokens, data)
            if read_as is None:
                left.append({"node": node.name, "source": source_line(node), "reason": why_not})
                continue
            mesh = ctx.mesh.document_kwargs()
            new = insert_dynamo_call(graph, node, layout_positions, (tokens,), {
                "hp": mesh["hp"], "cp": mesh["cp"], "hp_group": mesh["hp_group"],
                "cp_group": mesh["cp_group"], "device": example_value(node).device})
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            changed.append({"node": new.name, "replaced": node.name, "source": source_line(new),
                            "read_as": read_as})
        if changed:
            graph.lint()
            gm.recompile()
        token_inputs = [i for i, n in enumerate(inputs) if n in data and not is_weight(n)]
        ctx.state[MADE_POSITIONS] = {"inputs": token_inputs} if changed else {}
        return {"matched": len(changed) + len(left), "changed": changed, "left": left,
                "token_inputs": [inputs[i].name for i in token_inputs] if changed else []}


def _counts_local_tokens(node: torch.fx.Node, tokens: int) -> bool:
    """``arange(T)``, ``arange(0, T)`` or ``arange(0, T, 1)`` of integers, ``T`` static."""
    value = example_value(node)
    bounds = [0, *node.args] if len(node.args) == 1 else list(node.args)
    if node_arg(node, "step", 2, 1) != 1 or len(bounds) < 2:
        return False
    start, end = bounds[0], bounds[1]
    return (isinstance(value, torch.Tensor) and value.dtype == torch.int64
            and start == 0 and isinstance(end, int) and end == tokens)


def _token_data(inputs: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Every node computed from a graph input that is not a weight (the call's token data)."""
    found: set[torch.fx.Node] = set()
    todo = [n for n in inputs if not is_weight(n)]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        todo.extend(node.users)
    return found


def _read_as_positions(arange: torch.fx.Node, tokens: int,
                       data: set[torch.fx.Node]) -> tuple[str | None, str]:
    """(what reads the values as positions, "") when proven; (None, why not) otherwise."""
    region, todo, read_as, numbers = {arange}, [arange], set(), False
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in region or user.op == "output" or any(a in data for a in user.all_input_nodes):
                continue
            name = op_name(user)
            if name in ANGLES:
                read_as.add("RoPE's angle")
            elif name in LOOKUPS and _looks_up_weight(user, node):
                read_as.add(f"a lookup in a weight ({name})")
            elif _to_float(user):
                numbers = True
            if _token_axes(example_value(user), tokens) > 1:
                return None, (f"{user.name} ({name}) pairs the numbers with each other "
                              f"{tuple(example_value(user).shape)}: a mask of the local tokens")
            region.add(user)
            todo.append(user)
    if not read_as and numbers:
        read_as.add("a number made from it (a float cast: e.g. Llama 4's attention temperature)")
    if not read_as:
        return None, "nothing reads it as positions (no angle, no lookup by it, no float made of it)"
    return ", ".join(sorted(read_as)), ""


def _to_float(node: torch.fx.Node) -> bool:
    """A cast of the values to a floating dtype: a number computed from the position (an index
    stays an integer)."""
    value = example_value(node)
    return (op_name(node) in DTYPE_CASTS and isinstance(value, torch.Tensor) and value.is_floating_point())


def _looks_up_weight(node: torch.fx.Node, index: torch.fx.Node) -> bool:
    """Whether ``node`` looks up rows of a weight by ``index``."""
    table = node.args[1] if op_name(node) == "embedding" else node.args[0]
    if op_name(node) == "getitem":
        item = node.args[1]
        used = item is index or isinstance(item, tuple) and index in item
    else:
        used = index in node.args and node.args.index(index) != (1 if op_name(node) == "embedding"
                                                                else 0)
    return used and isinstance(table, torch.fx.Node) and is_weight(table)


def _token_axes(value: Any, tokens: int) -> int:
    """How many axes of ``value`` are token axes (a floating tensor's last axis is its features).
    Stricter than ``token_locality``'s rule, which also skips the last axis of any 3-D tensor:
    an integer or boolean ``(1, T, T)`` made of positions is the mask this check must see."""
    if not isinstance(value, torch.Tensor):
        return 0
    skip = value.dim() >= 2 and value.is_floating_point()
    return sum(1 for i, size in enumerate(value.shape)
               if counts_tokens(size, tokens) and not (skip and i == value.dim() - 1))
