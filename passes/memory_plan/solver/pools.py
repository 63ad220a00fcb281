"""Pools over time: a graph's buffers in as few allocations as keep its peak at the bound.

One pool for the whole graph (MEMO's plan) holds its arena from the first
buffer's allocation to the last one's free.  Meanwhile the rest of the
graph's memory (the *background*: outputs such as weight gradients piling up
in a backward or saved activations in a forward, saved activations the
backward frees) changes, so at the step where the background is highest the
pool may hold far more than the buffers live there: the peak rises above
what allocating every buffer on its own would reach,

    bound = max_t (live(t) + background(t)),

the least any placement can reach (every live byte needs memory).  When
the background is not known for sure (does the caller keep the inputs the
graph frees?), each possibility is one background *scenario*, with its own
bound, and the layout must keep the peak at the bound in every scenario.
Some steps are *volatile*: a kernel there may allocate temporaries nobody can
size (a fallback kernel or custom op), so the true peak at that step is
unknown and a pool must hold no unused bytes there (then whatever the kernel
allocates comes on top of exactly what it would without pools).
:func:`plan_pools` keeps the peak at the bound with as few allocations as it
can find:

1. The whole graph in one arena (:func:`~loong_compile.passes.memory_plan.solver.plan_bilevel`).
   If that pool is admissible (below), it is the answer.
2. Otherwise the time axis is cut into segments.  A buffer inside a segment
   goes to that segment's pool; a buffer crossing a cut is allocated on its
   own.  A segment ``[a, b)`` is *admissible* when its pool never holds more
   unused bytes than the step leaves free, for every step ``t`` of the pool's span:

       arena(a, b) - inside_live(t) <= room(t),
       room(t) = 0 if t is volatile, else min over scenarios of
                 bound_s - live(t) - background_s(t),

   which keeps the whole layout at the bound (each step lies in one segment;
   everything else at that step is allocated exactly as without pools).  A
   dynamic program over the cut points picks the admissible segments with
   the fewest allocations (pools plus buffers on their own), taking each
   segment's arena to be its lower bound; the chosen segments are then
   planned, and a segment whose plan turns out taller than its lower bound
   and no longer admissible gets its real arena and the program runs again.
   Segments one step long are always admissible (their buffers are all live
   at that step, so their arena is their lower bound), so a layout is always
   found.

Every pool's plan is verified, and the layout's peak is checked against the
bound before it is returned.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from loong_compile.passes.memory_plan.solver.bilevel import plan_bilevel
from loong_compile.passes.memory_plan.solver.problem import (
    Buffer, LoongPlanError, MemoryPlan, aligned, check_buffers,
)
from loong_compile.passes.memory_plan.solver.solve import plan

# The whole-graph plan's share of the time limit (the segments get the rest).
WHOLE_SHARE = 0.5

# Rounds of "plan the chosen segments, correct the arenas that missed their
# lower bound, choose again" before the one-step segments are taken as they are.
MAX_ROUNDS = 8


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Where each buffer of a graph goes: a pool and an offset in it, or its own allocation.

    ``pools[k]`` is the verified plan of pool ``k``'s buffers ``members[k]``
    (indices into ``buffers``); ``alone`` lists the buffers allocated on their
    own.  ``whole`` is the single-arena plan of all buffers (MEMO's plan).
    Peaks count the background (of the first scenario) too: ``peak`` with
    this layout, ``bound`` with every buffer on its own (the least possible),
    ``single_pool_peak`` with ``whole`` as one pool.
    """

    buffers: tuple[Buffer, ...]
    pools: tuple[MemoryPlan, ...]
    members: tuple[tuple[int, ...], ...]
    alone: tuple[int, ...]
    whole: MemoryPlan
    peak: int
    bound: int
    single_pool_peak: int
    solve_time: float
    notes: tuple[str, ...] = ()

    def placement(self) -> list[tuple[int, int] | None]:
        """Per buffer: ``(pool index, byte offset)``, or None when allocated on its own."""
        out: list[tuple[int, int] | None] = [None] * len(self.buffers)
        for k, (p, members) in enumerate(zip(self.pools, self.members)):
            for i, off in zip(members, p.offsets):
                out[i] = (k, off)
        return out


def layout_peak(background: Sequence[int], pools: Sequence[tuple[int, int, int]],
                alone: Sequence[tuple[int, int, int]]) -> int:
    """The most bytes held at once: ``background[t]`` plus every ``(bytes, start, end)``
    pool and lone buffer live at ``t`` (half-open ranges)."""
    steps = max([len(background)] + [e for _, _, e in pools] + [e for _, _, e in alone])
    delta = np.zeros(steps + 1, dtype=np.int64)
    for size, start, end in list(pools) + list(alone):
        if end > start:
            delta[start] += size
            delta[end] -= size
    held = np.cumsum(delta)[:steps]
    held[:len(background)] += np.asarray(background, dtype=np.int64)
    return int(held.max()) if steps else 0


def _plan_buffers(buffers: list[Buffer], time_limit: float, alignment: int, bilevel: bool,
                  method: str) -> tuple[MemoryPlan, list[str]]:
    """One arena for ``buffers`` (bi-level when they carry layers), greedy if that raises."""
    try:
        if bilevel and any(b.layer is not None for b in buffers):
            return plan_bilevel(buffers, time_limit=time_limit, alignment=alignment,
                                method=method), []
        return plan(buffers, time_limit=time_limit, alignment=alignment, method=method), []
    except Exception as exc:  # the compile never fails because of the solver
        return (plan(buffers, time_limit=time_limit, alignment=alignment, method="greedy"),
                [f"planner raised {type(exc).__name__}: {exc}; using the greedy plan"])


class _Segments:
    """The cut points of one graph and the dynamic program over them.

    Sections are the step ranges between consecutive cut points (every start
    and end of a buffer); ``slack[k]`` is the least ``room`` (bytes a pool may
    leave unused, per step) of section ``k``'s steps.
    """

    def __init__(self, sizes, starts, ends, room):
        self.cuts = np.array(sorted(set(starts) | set(ends)), dtype=np.int64)
        where = {int(c): k for k, c in enumerate(self.cuts)}
        self.lo = np.array([where[s] for s in starts], dtype=np.int64)
        self.hi = np.array([where[e] for e in ends], dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        n_sec = len(self.cuts) - 1
        self.slack = np.array([room[self.cuts[k]:self.cuts[k + 1]].min() for k in range(n_sec)],
                              dtype=np.int64)
        self.ending_at = [[] for _ in range(n_sec + 1)]
        for i in np.argsort(self.lo, kind="stable"):
            self.ending_at[self.hi[i]].append(int(i))
        self.starting_before = np.searchsorted(np.sort(self.lo), np.arange(n_sec + 1))

    def choose(self, arena_of: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
        """The admissible segments (section index ranges) with the fewest allocations.

        ``arena_of`` overrides a segment's arena (otherwise its lower bound).
        """
        n_sec = len(self.cuts) - 1
        best = [(0, 0)] + [None] * n_sec           # (allocations, pools) up to cut j
        back = [0] * (n_sec + 1)
        reach = np.zeros(n_sec + 1, dtype=np.int64)  # live bytes of buffers starting at >= i
        np.add.at(reach, self.lo, self.sizes)
        np.add.at(reach, self.hi, -self.sizes)
        reach = np.cumsum(reach)[:n_sec]
        lo, sizes, starting_before = self.lo.tolist(), self.sizes.tolist(), \
            self.starting_before.tolist()
        for i in range(n_sec):
            for k in np.flatnonzero(self.lo == i - 1):
                reach[self.lo[k]:self.hi[k]] -= self.sizes[k]
            # Buffers inside [i, j) as a difference array: cheap to extend, summed only
            # when a segment has to be checked.
            delta = [0] * (n_sec + 1)
            first, last, count = n_sec, 0, 0
            for j in range(i + 1, n_sec + 1):
                for k in self.ending_at[j]:
                    if lo[k] >= i:
                        delta[lo[k]] += sizes[k]
                        delta[j] -= sizes[k]
                        first, last, count = min(first, lo[k]), j, count + 1
                pools = 1 if count else 0
                crossing = starting_before[j] - starting_before[i] - count
                cost = (best[i][0] + crossing + pools, best[i][1] + pools)
                if best[j] is not None and cost >= best[j]:
                    continue  # no better than what reaches j already: skip the check
                if count:  # the pool lives on sections [first, last)
                    inside = np.cumsum(delta[:last])[first:]
                    lower = int(inside.max())
                    room = self.slack[first:last]
                    if arena_of.get((i, j), lower) > int((inside + room).min()):
                        if lower > int((reach[first:last] + room).min()):
                            break  # longer segments only hold more: none is admissible
                        continue
                best[j], back[j] = cost, i
        segments, j = [], n_sec
        while j > 0:
            segments.append((back[j], j))
            j = back[j]
        return segments[::-1]

    def inside(self, segment: tuple[int, int]) -> list[int]:
        i, j = segment
        return [int(k) for k in np.flatnonzero((self.lo >= i) & (self.hi <= j))]

    def admissible(self, segment: tuple[int, int], arena: int) -> bool:
        members = self.inside(segment)
        if not members:
            return True
        first, last = int(self.lo[members].min()), int(self.hi[members].max())
        inside = np.zeros(len(self.slack), dtype=np.int64)
        for k in members:
            inside[self.lo[k]:self.hi[k]] += self.sizes[k]
        return arena <= int((inside + self.slack)[first:last].min())


def room_per_step(sizes, starts, ends, backgrounds, volatile) -> np.ndarray:
    """Bytes a pool may hold unused at each step without raising the peak above the
    bound in any background scenario; 0 at volatile steps."""
    steps = max([len(b) for b in backgrounds] + [len(volatile), max(ends, default=0)])
    live = np.zeros(steps + 1, dtype=np.int64)
    np.add.at(live, starts, sizes)
    np.add.at(live, ends, [-s for s in sizes])
    live = np.cumsum(live)[:steps]
    room = None
    for background in backgrounds:
        held = live.copy()
        held[:len(background)] += np.asarray(background, dtype=np.int64)
        room = held.max() - held if room is None else np.minimum(room, held.max() - held)
    room[:len(volatile)][np.asarray(volatile, dtype=bool)] = 0
    return room


def plan_pools(buffers: Sequence[Buffer], backgrounds: Sequence[Sequence[int]],
               volatile: Sequence[bool] = (), *, time_limit: float = 10.0, alignment: int = 64,
               bilevel: bool = True, method: str = "auto") -> PoolPlan:
    """Place ``buffers`` in pools (or on their own) without raising the peak above the bound.

    ``backgrounds``: one or more scenarios of the bytes held at each step
    ``t`` by everything not in ``buffers`` (steps beyond a list's end hold
    nothing); the layout keeps the peak at the bound in each.
    ``volatile[t]`` marks the steps where pools may hold no unused bytes.
    ``time_limit`` bounds all the solves together; ``bilevel`` plans each
    pool with :func:`~loong_compile.passes.memory_plan.solver.plan_bilevel` when its buffers
    carry layers.  A pool's plan falls back to greedy when the solver raises
    (its notes say so).
    """
    t0 = time.monotonic()
    check_buffers(buffers, alignment)
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise LoongPlanError(f"time_limit={time_limit!r}", "the time limit is a positive "
                             "number of seconds", "pass e.g. time_limit=10")
    if not backgrounds or any(not isinstance(b, (int, np.integer)) or b < 0
                              for background in backgrounds for b in background):
        raise LoongPlanError("backgrounds", "one or more lists of bytes (integers >= 0) per "
                             "step", "pass [background] for a single scenario")
    # Buffers that take no memory need no pool.
    planned = [i for i, b in enumerate(buffers) if b.size and b.end > b.start]
    sizes = [aligned(buffers[i].size, alignment) for i in planned]
    starts = [buffers[i].start for i in planned]
    ends = [buffers[i].end for i in planned]
    bounds = [layout_peak(background, [], list(zip(sizes, starts, ends)))
              for background in backgrounds]

    whole, notes = _plan_buffers([buffers[i] for i in planned], time_limit * WHOLE_SHARE,
                                 alignment, bilevel, method)
    span = (min(starts), max(ends)) if planned else (0, 0)
    single_peak = layout_peak(backgrounds[0], [(whole.arena, *span)], [])
    unplanned = sorted(set(range(len(buffers))) - set(planned))

    def result(pools, members, alone, extra_notes):
        pool_spans = [(p.arena, min(buffers[m].start for m in ms), max(buffers[m].end for m in ms))
                      for p, ms in zip(pools, members)]
        lone = [(aligned(buffers[i].size, alignment), buffers[i].start, buffers[i].end)
                for i in alone]
        peaks = [layout_peak(background, pool_spans, lone) for background in backgrounds]
        if any(peak > bound for peak, bound in zip(peaks, bounds)):
            # Never hand out a layout that raises the peak.
            raise LoongPlanError(f"pool layout peaks {peaks} B > bounds {bounds} B",
                                 "pools never raise the peak above every-buffer-alone",
                                 "this is a planner bug: report it; compile without memory_plan")
        return PoolPlan(tuple(buffers), tuple(pools), tuple(tuple(m) for m in members),
                        tuple(sorted(alone)), whole, peaks[0], bounds[0], single_peak,
                        time.monotonic() - t0, tuple(notes + extra_notes))

    if not planned:
        return result([], [], unplanned, ["no buffer takes memory"])
    segments = _Segments(sizes, starts, ends,
                         room_per_step(sizes, starts, ends, backgrounds, volatile))
    everything = (0, len(segments.cuts) - 1)
    if segments.admissible(everything, whole.arena):
        return result([whole], [planned], unplanned,
                      ["one pool: the whole graph's arena keeps the peak at the bound"])
    why = (f"would peak at {single_peak} B > bound {bounds[0]} B" if single_peak > bounds[0]
           else "would hold unused bytes at volatile steps or in another background scenario")
    arena_of: dict[tuple[int, int], int] = {everything: whole.arena}
    plans: dict[tuple[int, int], tuple[MemoryPlan, list[str]]] = {}
    deadline = t0 + time_limit
    for _ in range(MAX_ROUNDS):
        chosen = [s for s in segments.choose(arena_of) if segments.inside(s)]
        todo = [s for s in chosen if s not in plans]
        total = sum(len(segments.inside(s)) for s in todo) or 1
        for s in todo:
            members = segments.inside(s)
            share = max((deadline - time.monotonic()) * len(members) / total, 0.05)
            total -= len(members)
            plans[s] = _plan_buffers([buffers[planned[k]] for k in members], share, alignment,
                                     bilevel, method)
        missed = [s for s in chosen if not segments.admissible(s, plans[s][0].arena)]
        if not missed:
            break
        for s in missed:
            arena_of[s] = plans[s][0].arena
    else:
        # Rounds spent: one-step segments (always admissible, arena = lower bound).
        chosen = [(k, k + 1) for k in range(len(segments.cuts) - 1) if segments.inside((k, k + 1))]
        for s in chosen:
            if s not in plans:
                plans[s] = _plan_buffers([buffers[planned[k]] for k in segments.inside(s)],
                                         0.05, alignment, bilevel, "greedy")
    members = [[planned[k] for k in segments.inside(s)] for s in chosen]
    inside = {i for ms in members for i in ms}
    alone = [i for i in range(len(buffers)) if i not in inside]
    pool_notes = [note for s in chosen for note in plans[s][1]]
    return result([plans[s][0] for s in chosen], members, alone,
                  [f"{len(chosen)} pools over time, {len(alone) - len(unplanned)} buffers on "
                   f"their own: one arena for the whole graph {why}"] + pool_notes)
