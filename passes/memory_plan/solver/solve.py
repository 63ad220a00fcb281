"""``plan``: one DSA instance, from greedy to search to the MIP, always verified.

1. Greedy best-fit over several orders gives the incumbent and the MIP's
   big-M.  If it meets the lower bound it is optimal and nothing else runs.
2. Canonical tree search (``search``) lowers the incumbent; a capacity
   it exhausts raises the proven bound.
3. The MIP (``mip``), warm-started from the incumbent, improves it or
   proves a bound within the remaining time.  If it fails or runs out of time,
   the best heuristic plan is used and ``MemoryPlan.status``/``notes`` say so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from loong_compile.passes.memory_plan.solver.greedy import greedy_plan
from loong_compile.passes.memory_plan.solver.mip import solve_mip
from loong_compile.passes.memory_plan.solver.problem import (
    Buffer, Instance, LoongPlanError, MemoryPlan, check_buffers, verify,
)
from loong_compile.passes.memory_plan.solver.search import improve_by_search

METHODS = ("auto", "greedy", "search", "mip")

# Above this many overlapping pairs the MIP is not run: its LP bound stays at
# the lower bound and HiGHS does not improve on the search's plan within a
# minute (measured on the MiniMalloc instances, 3,000-29,000 pairs), so the
# search gets all the time.  A transformer layer has far fewer pairs.
MIP_MAX_PAIRS = 2_000

# Under "auto", the share of the time limit the search gets before the MIP.
SEARCH_SHARE = 0.5


def _check_options(time_limit: float, method: str, capacity: int | None) -> None:
    if not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise LoongPlanError(f"time_limit={time_limit!r}", "the time limit is a positive "
                             "number of seconds", "pass e.g. time_limit=10")
    if method not in METHODS:
        raise LoongPlanError(f"method={method!r}", f"method is one of {METHODS}",
                             "use method='auto'")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
        raise LoongPlanError(f"capacity={capacity!r}", "capacity is a byte count >= 0",
                             "pass the device bytes available, or None")


def plan(buffers: Sequence[Buffer], *, time_limit: float = 10.0, alignment: int = 64,
         capacity: int | None = None, method: str = "auto") -> MemoryPlan:
    """Give every buffer a byte offset so that simultaneously live buffers never overlap.

    ``time_limit`` bounds the search and the MIP together (seconds);
    ``alignment`` (bytes) divides every offset and pads every size;
    ``capacity`` (bytes), if given, is the largest arena allowed: a
    :class:`LoongPlanError` says when the buffers cannot fit.  ``method``:
    ``"auto"`` (greedy, search, then the MIP if the instance has at most
    :data:`MIP_MAX_PAIRS` overlapping pairs), ``"greedy"``, ``"search"``
    (greedy + search) or ``"mip"`` (greedy + MIP, whatever the size).  The
    returned plan has been verified.
    """
    t0 = time.monotonic()
    deadline = t0 + time_limit
    _check_options(time_limit, method, capacity)
    check_buffers(buffers, alignment)
    inst = Instance(buffers, alignment)
    if capacity is not None and inst.lower_bound * inst.unit > capacity:
        raise LoongPlanError(
            f"{inst.lower_bound * inst.unit} bytes are live at once > capacity {capacity}",
            "the buffers live at any one step must fit in the capacity",
            "raise the capacity, or shrink the graph (smaller batch/sequence, recompute)")
    offsets, method_used = greedy_plan(inst)
    bound, failed = inst.lower_bound, False
    notes = [f"{method_used}: x{inst.arena(offsets) / max(bound, 1):.4f} of the lower bound"]

    if inst.arena(offsets) > bound and method in ("auto", "search"):
        use_mip = method == "auto" and len(inst.pairs) <= MIP_MAX_PAIRS
        stop = t0 + time_limit * SEARCH_SHARE if use_mip else deadline
        found, bound, nodes = improve_by_search(inst, offsets, stop)
        if inst.arena(found) < inst.arena(offsets):
            offsets, method_used = found, "search"
        notes.append(f"search: {nodes} nodes, arena x{inst.arena(offsets) / bound:.4f} of "
                     f"the best bound")

    if inst.arena(offsets) > bound and method in ("auto", "mip"):
        remaining = deadline - time.monotonic()
        if method == "auto" and len(inst.pairs) > MIP_MAX_PAIRS:
            notes.append(f"MIP skipped: {len(inst.pairs)} overlapping pairs > {MIP_MAX_PAIRS}")
        elif remaining <= 0:
            notes.append("MIP skipped: no time left")
        else:
            try:
                result = solve_mip(inst, offsets, remaining)
            except Exception as exc:  # the compile never fails because of the solver
                failed = True
                notes.append(f"MIP failed ({type(exc).__name__}: {exc}); using the "
                             f"{method_used} plan")
            else:
                bound = max(bound, result.bound)
                if result.offsets is not None and inst.arena(result.offsets) < inst.arena(offsets):
                    offsets, method_used = result.offsets, "mip"
                if result.status == "error":
                    failed = True
                    notes.append(f"MIP failed ({result.message}); using the {method_used} plan")
                else:
                    notes.append(f"MIP {result.status} after {result.solve_time:.2f} s, bound "
                                 f"{result.bound * inst.unit} B")

    arena = inst.arena(offsets)
    if arena == bound:
        status = "optimal"
    elif failed:
        status = "solver_failed"
    else:
        status = "heuristic" if method == "greedy" else "time_limit"
    if capacity is not None and arena * inst.unit > capacity:
        raise LoongPlanError(
            f"best plan found needs {arena * inst.unit} bytes > capacity {capacity} "
            f"(lower bound {inst.lower_bound * inst.unit})",
            "the plan must fit in the capacity",
            "raise time_limit or the capacity")
    byte_offsets = inst.to_bytes(offsets)
    verify(buffers, byte_offsets, arena * inst.unit, alignment)
    return MemoryPlan(tuple(buffers), byte_offsets, arena * inst.unit, inst.lower_bound * inst.unit,
                bound * inst.unit, status, method_used, time.monotonic() - t0, alignment,
                tuple(notes))
