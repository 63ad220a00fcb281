"""The DSA planner: optimal on small instances, the verifier, fall-backs, alignment, bad input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loong_compile.errors import LoongError
from loong_compile.passes.memory_plan.solver import (
    Buffer, LoongPlanError, LoongPlanOverlapError, lower_bound, plan, verify,
)
from loong_compile.passes.memory_plan.solver import mip as mip_module
from loong_compile.passes.memory_plan.solver import solve as solve_module
from loong_compile.passes.memory_plan.solver.generate import tiled_instance
from loong_compile.passes.memory_plan.solver.greedy import greedy_plan
from loong_compile.passes.memory_plan.solver.mip import MipResult, solve_mip
from loong_compile.passes.memory_plan.solver.problem import Instance
from loong_compile.passes.memory_plan.solver.search import FOUND, INFEASIBLE, CanonicalSearch, preorder


def brute_force_arena(buffers: list[Buffer]) -> int:
    """The optimal arena, by trying every order of stacking.

    Any plan can be pushed down until each buffer rests on the floor or on a
    buffer it overlaps in time; listed by offset, each then sits on the highest
    top among the earlier ones.  So the best over all orders of "put the next
    buffer on top of the placed ones it overlaps" is optimal.
    """
    n = len(buffers)
    best = [sum(b.size for b in buffers)]

    def overlap(a: Buffer, b: Buffer) -> bool:
        return a.start < b.end and b.start < a.end

    def extend(order: list[int], tops: dict[int, int], height: int) -> None:
        if height >= best[0]:
            return
        if len(order) == n:
            best[0] = height
            return
        for i in range(n):
            if i not in tops:
                off = max((tops[j] for j in order if overlap(buffers[i], buffers[j])), default=0)
                tops[i] = off + buffers[i].size
                order.append(i)
                extend(order, tops, max(height, tops[i]))
                order.pop()
                del tops[i]

    extend([], {}, 0)
    return best[0]


# Greedy is 18, the optimum 16, the lower bound 14: the solvers have work to do.
GAP_INSTANCE = [Buffer(*spec) for spec in
                [(2, 5, 9), (7, 10, 14), (7, 4, 7), (7, 9, 12), (7, 4, 5), (3, 7, 10), (4, 5, 10)]]


def random_buffers(rng: random.Random, n: int, horizon: int = 10, max_size: int = 9,
                   max_len: int = 6) -> list[Buffer]:
    out = []
    for k in range(n):
        start = rng.randint(0, horizon)
        out.append(Buffer(rng.randint(1, max_size), start, start + rng.randint(1, max_len),
                          name=f"b{k}"))
    return out


def small_instances() -> list[list[Buffer]]:
    rng = random.Random(11)
    cases = [GAP_INSTANCE]
    while len(cases) < 8:
        bufs = random_buffers(rng, rng.randint(5, 8), max_size=7)
        inst = Instance(bufs, 1)
        if inst.arena(greedy_plan(inst)[0]) > inst.lower_bound:  # keep the ones greedy misses
            cases.append(bufs)
    return cases


@pytest.mark.parametrize("case", range(8))
def test_mip_is_optimal_on_small_instances(case):
    buffers = small_instances()[case]
    optimum = brute_force_arena(buffers)
    inst = Instance(buffers, 1)
    result = solve_mip(inst, greedy_plan(inst)[0], time_limit=20)
    assert result.status == "optimal"
    assert inst.arena(result.offsets) == optimum == result.bound
    verify(buffers, inst.to_bytes(result.offsets), optimum)
    for method in ("mip", "search", "auto"):
        p = plan(buffers, alignment=1, time_limit=20, method=method)
        assert (p.arena, p.status, p.gap) == (optimum, "optimal", 0.0), (method, p.notes)


def test_gap_instance_bounds():
    p = plan(GAP_INSTANCE, alignment=1, method="mip")
    assert (p.lower_bound, p.bound, p.arena) == (14, 16, 16)
    assert p.ratio == pytest.approx(16 / 14)
    inst = Instance(GAP_INSTANCE, 1)
    search = CanonicalSearch(inst, preorder(inst, "crowd-length-area"))
    assert search.run(15)[0] == INFEASIBLE
    status, offsets = search.run(16)
    assert status == FOUND and inst.arena(offsets) == 16


def test_identical_buffers_symmetry_breaking():
    # Six copies of one buffer plus two others: the MIP fixes the copies' order.
    buffers = [Buffer(4, 0, 5)] * 6 + [Buffer(3, 3, 8), Buffer(5, 4, 9)]
    inst = Instance(buffers, 1)
    assert len(mip_module.identical_chains(inst)) == 15
    result = solve_mip(inst, greedy_plan(inst)[0], time_limit=20)
    assert inst.arena(result.offsets) == brute_force_arena(buffers)
    copies = result.offsets[:6]
    assert copies == sorted(copies)


def test_verifier_catches_planted_overlaps():
    buffers = [Buffer(8, 0, 4, "a"), Buffer(8, 2, 6, "b"), Buffer(8, 4, 8, "c")]
    verify(buffers, [0, 8, 0], arena=16)  # a and c never live together: sharing is fine
    with pytest.raises(LoongPlanOverlapError, match="overlap in memory"):
        verify(buffers, [0, 4, 16], arena=24)  # a [0,8) and b [4,12) live at steps 2-3
    with pytest.raises(LoongPlanOverlapError, match="inside the arena"):
        verify(buffers, [0, 8, 0], arena=15)
    with pytest.raises(LoongPlanOverlapError, match="multiples of 64"):
        verify(buffers, [0, 8, 0], arena=16, alignment=64)
    with pytest.raises(LoongPlanOverlapError, match="one offset per buffer"):
        verify(buffers, [0, 8])
    # Planted in a real plan: move one buffer onto a neighbour it overlaps in time.
    p = plan(GAP_INSTANCE, alignment=1)
    inst = Instance(GAP_INSTANCE, 1)
    i, j = inst.pairs[0]
    bad = list(p.offsets)
    bad[i] = bad[j]
    with pytest.raises(LoongPlanOverlapError):
        verify(GAP_INSTANCE, bad, p.arena)


def test_half_open_live_ranges_share_memory():
    # Freed at step 3 and allocated at step 3: the same bytes (Inductor's convention).
    buffers = [Buffer(100, 0, 3), Buffer(100, 3, 6)]
    p = plan(buffers, alignment=1)
    assert p.arena == 100 and p.offsets == (0, 0)


buffer_lists = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(0, 40), st.integers(0, 15)).map(
        lambda t: Buffer(t[0], t[1], t[1] + t[2])),
    min_size=0, max_size=60)


@settings(max_examples=60, deadline=None)
@given(buffer_lists, st.sampled_from([1, 64, 512]))
def test_greedy_is_always_valid(buffers, alignment):
    p = plan(buffers, alignment=alignment, method="greedy")  # plan() verifies; check again here
    verify(buffers, p.offsets, p.arena, alignment)
    assert p.lower_bound == lower_bound(buffers, alignment) <= p.arena
    assert p.status in ("optimal", "heuristic")


@settings(max_examples=15, deadline=None)
@given(buffer_lists)
def test_search_plans_are_valid(buffers):
    p = plan(buffers, alignment=64, method="search", time_limit=0.2)
    verify(buffers, p.offsets, p.arena, 64)
    assert p.bound <= p.arena


def test_time_limit_is_kept_and_reported():
    buffers = tiled_instance(0, 100)  # optimum = lower bound; greedy is 1.41x
    greedy = plan(buffers, alignment=1, method="greedy")
    p = plan(buffers, alignment=1, method="mip", time_limit=1.0)
    assert p.solve_time < 1.0 + 10.0  # the greedy and the final verify run outside the limit (slack for a loaded machine)
    assert p.arena <= greedy.arena
    if p.status != "optimal":
        assert p.status == "time_limit" and p.gap > 0
        assert any("MIP time_limit" in note for note in p.notes)


def test_solver_timeout_falls_back_to_the_heuristic_plan(monkeypatch):
    def timed_out(inst, incumbent, time_limit):
        return MipResult("time_limit", None, inst.lower_bound, time_limit)

    monkeypatch.setattr(solve_module, "solve_mip", timed_out)
    greedy = plan(GAP_INSTANCE, alignment=1, method="greedy")
    p = plan(GAP_INSTANCE, alignment=1, method="mip", time_limit=1)
    assert (p.status, p.offsets, p.arena) == ("time_limit", greedy.offsets, 18)


@pytest.mark.parametrize("how", ["raise", "highs_unavailable", "error_status"])
def test_solver_failure_falls_back_to_the_heuristic_plan(monkeypatch, how):
    if how == "raise":
        def broken(inst, incumbent, time_limit):
            raise RuntimeError("solver crashed")
        monkeypatch.setattr(solve_module, "solve_mip", broken)
    elif how == "highs_unavailable":
        def unavailable(time_limit):
            raise RuntimeError("pyomo's appsi HiGHS interface reports highspy unavailable")
        monkeypatch.setattr(mip_module, "_make_solver", unavailable)
    else:
        def error(inst, incumbent, time_limit):
            return MipResult("error", None, inst.lower_bound, 0.0, "HiGHS ended with error")
        monkeypatch.setattr(solve_module, "solve_mip", error)
    p = plan(GAP_INSTANCE, alignment=1, method="mip", time_limit=5)
    assert p.status == "solver_failed"
    assert p.arena == 18 and p.method.startswith("greedy")
    assert any("MIP failed" in note for note in p.notes)


@pytest.mark.parametrize("alignment", [64, 512])
def test_alignment_is_honoured(alignment):
    rng = random.Random(alignment)
    buffers = [Buffer(rng.randint(1, 3 * alignment), s, s + rng.randint(1, 6))
               for s in (rng.randint(0, 20) for _ in range(40))]
    p = plan(buffers, alignment=alignment, time_limit=2)
    assert all(off % alignment == 0 for off in p.offsets)
    assert p.arena % alignment == 0
    assert p.lower_bound == lower_bound(buffers, alignment)
    verify(buffers, p.offsets, p.arena, alignment)


def test_bad_input():
    with pytest.raises(LoongPlanError, match="start <= end"):
        plan([Buffer(8, 5, 2)])
    with pytest.raises(LoongPlanError, match="sizes are >= 0"):
        plan([Buffer(-8, 0, 2)])
    with pytest.raises(LoongPlanError, match="integers"):
        plan([Buffer(8.5, 0, 2)])
    with pytest.raises(LoongPlanError, match="positive integer"):
        plan([Buffer(8, 0, 2)], alignment=0)
    with pytest.raises(LoongPlanError, match="positive number of seconds"):
        plan([Buffer(8, 0, 2)], time_limit=0)
    with pytest.raises(LoongPlanError, match="method"):
        plan([Buffer(8, 0, 2)], method="cplex")
    with pytest.raises(LoongPlanError, match="capacity") as err:
        plan([Buffer(600, 0, 4), Buffer(600, 2, 6)], alignment=1, capacity=1000)
    assert isinstance(err.value, LoongError) and "1200" in str(err.value)
    with pytest.raises(LoongPlanError, match="planner.Buffer"):
        plan([(8, 0, 2)])


def test_degenerate_input_gets_a_correct_plan():
    assert plan([]).arena == 0
    single = plan([Buffer(100, 3, 7)], alignment=64)
    assert (single.offsets, single.arena, single.status) == ((0,), 128, "optimal")
    # Zero-size buffers and empty live ranges take no memory and get offset 0.
    buffers = [Buffer(0, 0, 5), Buffer(64, 2, 2), Buffer(64, 0, 5), Buffer(64, 1, 4)]
    p = plan(buffers, alignment=64)
    assert p.arena == 128 and p.offsets[:2] == (0, 0)
    fits = plan([Buffer(600, 0, 4), Buffer(400, 2, 6)], alignment=1, capacity=1000)
    assert fits.arena == 1000


def test_the_names_before_stop_29_still_work():
    """``Plan`` meant both the memory planner's plan and the estimator's ranking; each has a
    name of its own now, and the old name still imports."""
    from loong_compile import estimate
    from loong_compile.passes.memory_plan import solver

    assert solver.Plan is solver.MemoryPlan and solver.plan([]).__class__.__name__ == "MemoryPlan"
    assert estimate.Plan is estimate.Ranking
