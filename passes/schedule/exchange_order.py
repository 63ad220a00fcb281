"""Order the exchanges of one attention call and the work that feeds each, so each has compute to hide behind.

q, k and v are exchanged independently and the ring needs all three: whichever starts last
overlaps only with work still left after it starts.  At hp = 2 with fewer KV heads than query
heads, k's and v's arrival is a view and q's is an unpacking copy: if q starts last, nothing is
left between its start and its wait.  ``order_exchanges`` puts a group's exchanges in order
(those marked ``first``, whose arrival runs a copy, before the others) and each right after
the work that only it needs: ``[q chain, start q, k chain, start k, v chain, start v]``; then
``sink_waits`` defers every wait to its first use, so q's unpacking runs while k and v are
in flight.

Used twice.  ``comm_overlap`` (stage ``post_grad``) orders the post-grad FX graph (it marks
``first``); Inductor keeps the collectives in that order (it chains them so every rank issues
them alike) but its fusion moves compute (a RoPE kernel that also computes cos/sin jumps to
where cos/sin was; k's RoPE fuses into q's), so ``ExchangeOrderPass`` (stage ``schedule``,
``hp > 1``) orders Inductor's scheduler nodes again before fusion, keeping the collectives'
order, and adds holds that become ordering-only dependencies fusion respects.  Order only,
within each group's span; every dependency is checked and the input order kept if one would
break.  Report: per group, the starts in the order chosen and the nodes moved.

What a node feeds is a bitset over the graph's starts (one Python int per node): linear in
the graph, where ancestor sets of every node were quadratic in time and memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from loong_compile.passes.base import Pass, PassContext, ScheduleRequest


class ExchangeNode(NamedTuple):
    """One node in graph order: ``kind`` is "start" (a collective), "wait" (a collective's
    wait), "kernel" (compute) or "other" (host copies, allocations, placeholders); ``inputs``
    the positions of the nodes it depends on; ``first``: a start to put before its group's
    unmarked ones."""

    name: str
    kind: str
    inputs: tuple[int, ...]
    first: bool = False


def _starts_fed(nodes: list[ExchangeNode]) -> tuple[list[int], dict[int, int], list[int]]:
    """The starts; each start's bit; per node, the bitset of the starts it feeds (itself
    included if it is one).  One backward sweep: linear in the edges times a word per 64
    starts, where ancestor sets of every node were quadratic in the nodes."""
    starts = [i for i, n in enumerate(nodes) if n.kind == "start"]
    bit = {s: 1 << k for k, s in enumerate(starts)}
    users: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for a in node.inputs:
            users[a].append(i)
    fed = [0] * len(nodes)
    for i in reversed(range(len(nodes))):
        bits = bit.get(i, 0)
        for u in users[i]:
            bits |= fed[u]
        fed[i] = bits
    return starts, bit, fed


def _groups(starts: list[int], bit: dict[int, int], fed: list[int]) -> list[list[int]]:
    """Runs of starts, in list order, none depending on another (one attention call's q/k/v)."""
    groups: list[list[int]] = []
    for s in starts:
        if groups and not any(fed[g] & bit[s] for g in groups[-1]):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def order_exchanges(nodes: list[ExchangeNode]) -> tuple[list[int], list[tuple[int, int]], dict[str, Any]]:
    """A dependency-preserving order of ``nodes`` (positions); the holds ``(node, start)`` that
    keep it (each node of a chain runs after the start before it: without them Inductor fuses
    the RoPE of k with q's, and both start after one kernel); the report of what moved."""
    order = list(range(len(nodes)))
    holds: list[tuple[int, int]] = []
    report: dict[str, Any] = {"groups": []}
    if sum(n.kind == "start" for n in nodes) < 2:    # no group to order
        return order, holds, report
    starts, bit, fed = _starts_fed(nodes)
    position = list(range(len(nodes)))               # node -> its place in ``order``
    for group in _groups(starts, bit, fed):
        if len(group) < 2:
            continue
        first = sorted(group, key=lambda s: (not nodes[s].first, s))
        rank = {s: r for r, s in enumerate(first)}
        every = 0
        for s in group:
            every |= bit[s]
        # the span: after the latest node that feeds every start of the group (found scanning
        # back from the earliest start), up to the last start
        lo = min(position[s] for s in group)
        while lo > 0 and fed[order[lo - 1]] & every != every:
            lo -= 1
        hi = max(position[s] for s in group) + 1
        key: dict[int, int] = {}
        for node in order[lo:hi]:   # the chain of the first start it feeds; else after its inputs
            feeds = [rank[s] for s in group if fed[node] & bit[s]]
            # inputs inside the span carry their own ancestors' keys (the order is topological)
            key[node] = min(feeds) if feeds else max(
                (key[a] for a in nodes[node].inputs if a in key), default=-1)
        span = sorted(order[lo:hi], key=lambda node: (key[node], position[node]))
        holds += [(node, first[key[node] - 1]) for node in span
                  if 0 < key[node] < len(first) and nodes[node].kind != "start"]
        report["groups"].append({"starts": [nodes[s].name for s in group],
                                 "started_in_order": [nodes[s].name for s in first],
                                 "nodes_moved": sum(a != b for a, b in zip(span, order[lo:hi]))})
        order[lo:hi] = span
        for p in range(lo, hi):
            position[order[p]] = p
    if any(position[i] > position[node] for node in order for i in nodes[node].inputs):
        report["kept_input_order"] = "a reordered span broke a dependency"
        return list(range(len(nodes))), [], report
    report["holds"] = len(holds)
    return order, holds, report


HOST_OPS = ("loong.offload", "loong.reload", "loong.wait_tensor")   # copies, not compute


def order_schedule(items: list[tuple[str, str, str, tuple[int, ...]]]
                   ) -> tuple[list[int], list[tuple[int, int]], dict[str, Any]]:
    """``order_exchanges`` on Inductor's scheduler nodes (``ScheduleItem``s; a host copy or a
    nop is "other").  A start's dependency on an earlier start is Inductor's chaining of
    collectives, not data: it is dropped, and the order of starts is kept (none is marked
    ``first``)."""
    nodes = [ExchangeNode(name, "other" if kind == "nop" or op in HOST_OPS else kind,
                          tuple(i for i in inputs if not (kind == "start" and items[i][1] == "start")))
             for name, kind, op, inputs in items]
    return order_exchanges(nodes)


class ExchangeOrderPass(Pass):
    """One attention call's q/k/v exchanges, each after only the work it needs, on Inductor's
    scheduler nodes before fusion (``hp > 1``: only then are there exchanges)."""

    name, stage = "exchange_order", "schedule"

    def enabled(self, config) -> bool:
        return config.hp > 1

    def run(self, request: ScheduleRequest, ctx: PassContext) -> dict[str, Any]:
        order, holds, report = order_schedule(request.items)
        request.order, request.holds = order, request.holds + holds
        groups = report["groups"]
        return {"matched": len(groups), "changed": sum(g["nodes_moved"] > 0 for g in groups), **report}
