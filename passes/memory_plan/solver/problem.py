"""The offline Dynamic Storage Allocation (DSA) problem: buffers, plans, the verifier.

A buffer is live on the half-open step range ``[start, end)`` (Inductor's
convention): a buffer freed at step ``t`` and one allocated at step ``t`` may
share memory.  A plan gives every buffer a byte offset inside one arena; it is
valid when no two buffers whose live ranges overlap also overlap in memory.

Internally the solvers work on an :class:`Instance`: the buffers that occupy
memory (non-zero size, non-empty live range), sizes counted in *units* (the
alignment times the gcd of the aligned sizes, so numbers stay small for the
MIP), and the precomputed overlap lists and time sections every solver needs.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Hashable, Sequence

import numpy as np

from loong_compile.errors import LoongError


class LoongPlanError(LoongError, ValueError):
    """Planner input that cannot be planned: bad sizes, live ranges, alignment or capacity."""


class LoongPlanOverlapError(LoongError, RuntimeError):
    """A memory plan places two simultaneously live buffers on overlapping bytes."""


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One allocation: ``size`` bytes live on the steps ``[start, end)``.

    ``layer`` is the transformer-layer key the bi-level planner groups by
    (``None``: the buffer belongs to no layer); ``name`` is for reports.
    """

    size: int
    start: int
    end: int
    name: str = ""
    layer: Hashable | None = None


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A verified memory plan.

    ``lower_bound`` is the largest total of simultaneously live (aligned)
    bytes; ``bound`` the best lower bound proven for this instance (the MIP's
    dual bound or a capacity the search proved infeasible), never below
    ``lower_bound``.  ``status`` is ``"optimal"`` (``arena == bound``),
    ``"time_limit"`` (the solvers ran out of time; the best plan found is
    used), ``"solver_failed"`` (the MIP failed; the heuristic plan is used),
    ``"heuristic"`` (``method="greedy"``, above the bound) or, for a bi-level
    plan, ``"level_optimal"`` (each level optimal, the whole above the bound).
    ``method`` names what produced the offsets; ``notes`` say what happened.
    """

    buffers: tuple[Buffer, ...]
    offsets: tuple[int, ...]
    arena: int
    lower_bound: int
    bound: int
    status: str
    method: str
    solve_time: float
    alignment: int
    notes: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """Arena over the lower bound (1.0 when nothing is live)."""
        return self.arena / self.lower_bound if self.lower_bound else 1.0

    @property
    def gap(self) -> float:
        """Relative optimality gap ``(arena - bound) / arena`` (0.0: proven optimal)."""
        return (self.arena - self.bound) / self.arena if self.arena else 0.0

    def summary(self) -> str:
        return (f"{len(self.buffers)} buffers, arena {self.arena} B, lower bound "
                f"{self.lower_bound} B (x{self.ratio:.4f}), gap {self.gap:.2%}, "
                f"{self.status} via {self.method} in {self.solve_time:.2f} s")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_buffers(buffers: Sequence[Buffer], alignment: int) -> None:
    """Raise :class:`LoongPlanError` for input no plan can honour."""
    if not _is_int(alignment) or alignment < 1:
        raise LoongPlanError(f"alignment={alignment!r}", "alignment is a positive integer "
                             "number of bytes", "pass e.g. alignment=64")
    for i, b in enumerate(buffers):
        if not isinstance(b, Buffer):
            raise LoongPlanError(f"buffers[{i}]={b!r}", "every buffer is a planner.Buffer",
                                 "build Buffer(size, start, end)")
        label = b.name or f"buffers[{i}]"
        for field in ("size", "start", "end"):
            if not _is_int(getattr(b, field)):
                raise LoongPlanError(f"{label}.{field}={getattr(b, field)!r}",
                                     "sizes and steps are integers", "round to whole bytes/steps")
        if b.size < 0:
            raise LoongPlanError(f"{label}.size={b.size}", "sizes are >= 0 bytes",
                                 "pass the buffer's byte count")
        if b.end < b.start:
            raise LoongPlanError(f"{label} live on [{b.start}, {b.end})",
                                 "a live range [start, end) needs start <= end",
                                 "swap start and end, or fix the step numbering")


def aligned(size: int, alignment: int) -> int:
    """``size`` rounded up to a multiple of ``alignment``."""
    return -(-size // alignment) * alignment


def lower_bound(buffers: Sequence[Buffer], alignment: int = 1) -> int:
    """The largest total of (aligned) bytes live at one step: no plan's arena is smaller."""
    delta: dict[int, int] = {}
    for b in buffers:
        if b.size and b.end > b.start:
            delta[b.start] = delta.get(b.start, 0) + aligned(b.size, alignment)
            delta[b.end] = delta.get(b.end, 0) - aligned(b.size, alignment)
    live = best = 0
    for step in sorted(delta):
        live += delta[step]
        best = max(best, live)
    return best


def overlapping_pairs(starts: Sequence[int], ends: Sequence[int]) -> list[tuple[int, int]]:
    """All pairs ``(i, j)``, ``i < j``, of non-empty live ranges that share a step."""
    order = sorted((s, e, i) for i, (s, e) in enumerate(zip(starts, ends)) if e > s)
    sorted_starts = [s for s, _, _ in order]
    pairs = []
    for k, (_, e, i) in enumerate(order):
        # Every later-starting range that starts before this one ends overlaps it.
        for _, _, j in order[k + 1:bisect.bisect_left(sorted_starts, e, lo=k + 1)]:
            pairs.append((min(i, j), max(i, j)))
    return pairs


def verify(buffers: Sequence[Buffer], offsets: Sequence[int], arena: int | None = None,
           alignment: int = 1) -> None:
    """Raise :class:`LoongPlanOverlapError` unless ``offsets`` is a valid plan.

    Valid: one non-negative, ``alignment``-aligned integer offset per buffer,
    every buffer inside ``[0, arena)`` (when given), and no two buffers that are
    live at the same step share a byte.
    """
    if len(offsets) != len(buffers):
        raise LoongPlanOverlapError(f"{len(offsets)} offsets for {len(buffers)} buffers",
                                    "one offset per buffer", "plan all buffers")
    for i, (b, off) in enumerate(zip(buffers, offsets)):
        label = b.name or f"buffer {i}"
        if not _is_int(off) or off < 0 or off % alignment:
            raise LoongPlanOverlapError(f"{label} at offset {off!r}",
                                        f"offsets are non-negative multiples of {alignment}",
                                        "re-plan with the same alignment")
        if arena is not None and b.size and b.end > b.start and off + b.size > arena:
            raise LoongPlanOverlapError(f"{label} ends at byte {off + b.size} > arena {arena}",
                                        "every buffer lies inside the arena", "re-plan")
    live = [i for i, b in enumerate(buffers) if b.size]
    for a, c in overlapping_pairs([buffers[i].start for i in live], [buffers[i].end for i in live]):
        i, j = live[a], live[c]
        bi, bj = buffers[i], buffers[j]
        if offsets[i] < offsets[j] + bj.size and offsets[j] < offsets[i] + bi.size:
            raise LoongPlanOverlapError(
                f"{bi.name or f'buffer {i}'} [{offsets[i]}, {offsets[i] + bi.size}) and "
                f"{bj.name or f'buffer {j}'} [{offsets[j]}, {offsets[j] + bj.size}) overlap in "
                f"memory while both are live (steps [{max(bi.start, bj.start)}, "
                f"{min(bi.end, bj.end)}))",
                "buffers live at the same step occupy disjoint bytes",
                "this is a planner bug: report it; compile without memory_plan meanwhile")


class Instance:
    """The buffers that occupy memory, in units, with the facts every solver needs.

    ``index[k]`` is the position in the caller's list of the k-th planned
    buffer; buffers left out (zero size or empty live range) get offset 0.
    """

    def __init__(self, buffers: Sequence[Buffer], alignment: int):
        self.buffers = tuple(buffers)
        self.alignment = alignment
        self.index = [i for i, b in enumerate(buffers) if b.size and b.end > b.start]
        sizes = [aligned(buffers[i].size, alignment) for i in self.index]
        self.unit = alignment * (math.gcd(*(a // alignment for a in sizes)) if sizes else 1)
        self.sizes = [a // self.unit for a in sizes]
        self.starts = [buffers[i].start for i in self.index]
        self.ends = [buffers[i].end for i in self.index]
        self.n = len(self.index)
        self.pairs = overlapping_pairs(self.starts, self.ends)
        self.overlaps: list[list[int]] = [[] for _ in range(self.n)]
        for i, j in self.pairs:
            self.overlaps[i].append(j)
            self.overlaps[j].append(i)
        # Sections: the time axis cut at every start and end; buffer k covers
        # sections [sec_lo[k], sec_hi[k]).
        steps = sorted(set(self.starts) | set(self.ends))
        where = {s: k for k, s in enumerate(steps)}
        self.sec_lo = np.array([where[s] for s in self.starts], dtype=np.int64)
        self.sec_hi = np.array([where[e] for e in self.ends], dtype=np.int64)
        delta = np.zeros(max(len(steps), 1), dtype=np.int64)
        np.add.at(delta, self.sec_lo, self.sizes)
        np.add.at(delta, self.sec_hi, [-s for s in self.sizes])
        self.section_totals = np.cumsum(delta)[:-1] if len(steps) > 1 else np.zeros(0, np.int64)
        self.lower_bound = int(self.section_totals.max()) if self.n else 0
        # Per buffer: the largest total live in any section it spans.  Buffers
        # in the most crowded moments have the least freedom: place them first.
        self.crowd = [int(self.section_totals[lo:hi].max())
                      for lo, hi in zip(self.sec_lo, self.sec_hi)]

    def arena(self, offsets: Sequence[int]) -> int:
        return max((o + s for o, s in zip(offsets, self.sizes)), default=0)

    def to_bytes(self, offsets: Sequence[int]) -> tuple[int, ...]:
        """Unit offsets of the planned buffers -> byte offsets of all buffers."""
        out = [0] * len(self.buffers)
        for k, off in zip(self.index, offsets):
            out[k] = int(off) * self.unit
        return tuple(out)

    def compact(self, offsets: Sequence[float]) -> list[int]:
        """Drop every buffer as low as the buffers below it allow (gravity).

        Keeps each overlapping pair's vertical order, so the result is valid
        whenever the input is (up to solver tolerance) and never taller.  It
        turns a MIP's floating-point addresses into exact integers.
        """
        new = [0] * self.n
        done = [False] * self.n
        for i in sorted(range(self.n), key=lambda k: (offsets[k], k)):
            new[i] = max((new[j] + self.sizes[j] for j in self.overlaps[i] if done[j]), default=0)
            done[i] = True
        return new
