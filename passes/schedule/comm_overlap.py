"""Start each SeqAlltoAll as soon as its tensor exists, so Inductor overlaps it with compute.

AOTAutograd traces the three exchanges of q, k and v where the model calls attention, after
the last projection and RoPE: left there, every start is followed at once by its wait.
Inductor keeps a functional collective's start where the graph puts it (its own
``raise_comms`` would, but as a list scheduler it also delays host reloads next to their
waits), and ``sink_waits`` (``_compat.inductor.comm_overlap_patches``) keeps each wait at its first
use.  So this pass moves each start up, together with the layout ops that only feed it (the
pack: view, permute, copy), to just after the latest of their other inputs: q's exchange
then runs while k and v are projected, v's while RoPE runs.  Where several exchanges feed
one op (q, k, v into the ring), the one whose arrival runs an unpacking copy starts first,
each after only the work it needs (``exchange_order.py``: the copy then runs while the
others fly), and their waits (each with the layout ops that unpack it) are put in the order
the exchanges started.  Inductor keeps the collectives in this order; its fusion can still
move their compute, which ``exchange_order.order_schedule`` undoes on Inductor's nodes.

Stage ``post_grad`` (the graph Inductor lowers: forward, backward, inference), when
``hp > 1``.  Matches: every ``_c10d_functional.all_to_all_single``.  Changes: graph order
only, never a value.  Report: per graph, the starts, the nodes moved, the groups ordered
(``chains_ordered``: the starts in the order chosen), and the graph nodes
between each start and its wait before and after (the kernels Inductor then schedules
between them are in the ``overlap`` record).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.passes.schedule import exchange_order
from loong_compile.passes.base import Pass
from loong_compile.passes.fx.storage import is_layout_op

aten = torch.ops.aten
_START = torch.ops._c10d_functional.all_to_all_single.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
Order = dict[torch.fx.Node, int]


def feeding_chain(start: torch.fx.Node, order: Order) -> list[torch.fx.Node]:
    """``start`` and the layout ops used only on the way to it, in graph order (``order``:
    node positions; moving other chains does not change this chain's own order)."""
    chain = [start]
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for a in node.all_input_nodes:
            if a not in chain and is_layout_op(a) and all(u in chain for u in a.users):
                chain.append(a)
                frontier.append(a)
    return sorted(chain, key=order.__getitem__)


def _nodes_to_wait(start: torch.fx.Node) -> int | None:
    """Graph nodes strictly between ``start`` and the first of its waits."""
    waits = [u for u in start.users if u.op == "call_function"]
    if not waits:
        return None
    count, node = 0, start.next
    while node not in waits and node.op != "output":
        count += 1
        node = node.next
    return count


def _latest_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The last of ``node``'s inputs in graph order (walking back from it), or None."""
    inputs = set(node.all_input_nodes)
    if not inputs:
        return None
    before = node.prev
    while before not in inputs:
        before = before.prev
    return before


def raise_start(start: torch.fx.Node, order: Order, floor: torch.fx.Node | None = None) -> int:
    """Move ``start``'s chain up to just after its latest outside input, never above ``floor``
    (the last placeholder: Inductor lowers a graph's inputs before any of its compute, and
    reads a reshape of an input met before the other inputs as a donated buffer's); the
    nodes moved."""
    moved = 0
    for node in feeding_chain(start, order):
        latest = _latest_input(node)
        if latest is not None and floor is not None and order[latest] < order[floor]:
            latest = floor
        if latest is not None and latest.next is not node:
            latest.append(node)
            moved += 1
    return moved


def _arrival_chain(start: torch.fx.Node, order: Order) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """The start's wait and the layout ops that only unpack it (graph order), and the nodes
    that use them otherwise (the ring, an offload of the saved result; not the output)."""
    chain, frontier, consumers = [], [u for u in start.users if u.op == "call_function"], set()
    while frontier:
        node = frontier.pop()
        if node in chain:
            continue
        chain.append(node)
        for u in node.users:
            if is_layout_op(u) and len(u.all_input_nodes) == 1:
                frontier.append(u)
            elif u.op == "call_function":
                consumers.add(u)
    return sorted(chain, key=order.__getitem__), consumers


def _copies(node: torch.fx.Node) -> bool:
    """Whether a layout op runs a copy: a clone, or a reshape of a tensor it cannot view."""
    if node.target in (aten.clone.default, aten.contiguous.default):
        return True
    if node.target is aten.reshape.default:
        val, out = node.args[0].meta.get("val"), node.meta.get("val")
        if val is None or out is None:
            return True
        try:
            val.view(out.shape)
        except RuntimeError:
            return True
    return False


def order_chains(graph: torch.fx.Graph, starts: list[torch.fx.Node], order: Order) -> dict[str, Any]:
    """``exchange_order.order_exchanges`` on the graph: of the exchanges feeding one op, those
    whose unpacking copies start first, each right after the work that only it needs."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    copying = {s for s in starts if any(_copies(n) for n in _arrival_chain(s, order)[0])}
    kind = {_START: "start", _WAIT: "wait"}
    items = [exchange_order.ExchangeNode(
        n.name, kind.get(n.target, "kernel" if n.op == "call_function" else "other"),
        tuple(position[a] for a in n.all_input_nodes), n in copying) for n in nodes]
    new_order, _, report = exchange_order.order_exchanges(items)
    # the graph's inputs stay first (the order puts an input anywhere before its first use;
    # Inductor lowers them all before any compute)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    rest = [nodes[i] for i in new_order if nodes[i].op not in ("placeholder", "output")]
    at = placeholders[-1] if placeholders else (rest.pop(0) if rest else None)
    for node in rest:
        at.append(node)
        at = node
    return report


def wait_in_start_order(starts: list[torch.fx.Node], order: Order) -> int:
    """Where several exchanges feed one op (q, k, v into the ring), wait for them in the order
    they started: the first to start is waited first, so each wait has the others' unpacking
    before it.  A group moves only when every other use comes after all its chains and every
    start before them.  Returns
    the groups reordered.  ``order``: positions after the starts moved (reordering one group
    leaves every other node's relative order as it was)."""
    arrivals = [(start, *_arrival_chain(start, order)) for start in starts]
    groups: list[list] = []
    for arrival in arrivals:
        group = next((g for g in groups if any(arrival[2] & other[2] for other in g)), None)
        if group is None:
            groups.append([arrival])
        else:
            group.append(arrival)
    reordered = 0
    for group in groups:
        if len(group) < 2:
            continue
        chained = [n for _, chain, _ in group for n in chain]
        first, last = min(order[n] for n in chained), max(order[n] for n in chained)
        if any(order[u] < last for _, _, users in group for u in users):
            continue
        # the chains move to where the first of them is: every start must already be above it
        # (a recompute in the backward may start an exchange after another one's wait)
        if any(order[start] > first for start, _, _ in group):
            continue
        group.sort(key=lambda arrival: order[arrival[0]])
        at = min(chained, key=order.__getitem__).prev
        for _, chain, _ in group:
            for node in chain:
                at.append(node)
                at = node
        reordered += 1
    return reordered


class CommOverlapPass(Pass):
    """Raise every SeqAlltoAll start to where its tensor is ready (``hp > 1``)."""

    name, stage = "comm_overlap", "post_grad"

    def enabled(self, config: Any) -> bool:
        return config.hp > 1

    def run(self, graph: torch.fx.Graph, ctx: Any) -> dict[str, Any]:
        starts = list(graph.find_nodes(op="call_function", target=_START))
        before = [_nodes_to_wait(s) for s in starts]
        order = {n: i for i, n in enumerate(graph.nodes)}
        floor = max(graph.find_nodes(op="placeholder"), key=order.__getitem__, default=None)
        moved = sum(raise_start(s, order, floor) for s in starts)
        chains = order_chains(graph, starts, {n: i for i, n in enumerate(graph.nodes)})
        regrouped = wait_in_start_order(starts, {n: i for i, n in enumerate(graph.nodes)})
        graph.lint()
        after = [_nodes_to_wait(s) for s in starts]
        return {"matched": len(starts), "changed": sum(a != b for a, b in zip(after, before)),
                "nodes_moved": moved, "chains_ordered": chains, "waits_reordered_for": regrouped,
                "nodes_between_start_and_wait": {"before": before, "after": after}}
