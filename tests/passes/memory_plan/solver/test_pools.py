"""Pools over time (solver/pools.py): the layout never raises the peak above every-buffer-alone
nor holds unused bytes at volatile steps, the segment choice has the fewest allocations
(checked by brute force), and planner misses are corrected."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loong_compile.passes.memory_plan.solver import Buffer, LoongPlanError, MemoryPlan, lower_bound, verify
from loong_compile.passes.memory_plan.solver import pools as pools_module
from loong_compile.passes.memory_plan.solver.pools import _Segments, plan_pools, room_per_step

STEPS = 10


def held_at_each_step(layout, background):
    """Bytes held per step, simulated from the layout alone (independent of the planner)."""
    held = list(background) + [0] * 4
    for plan, members in zip(layout.pools, layout.members):
        start = min(layout.buffers[i].start for i in members)
        end = max(layout.buffers[i].end for i in members)
        for t in range(start, end):
            held[t] += plan.arena
    for i in layout.alone:
        b = layout.buffers[i]
        for t in range(b.start, b.end):
            held[t] += -(-b.size // 64) * 64
    return held


def held_alone(buffers, background):
    """Bytes held per step with every buffer allocated on its own."""
    held = list(background) + [0] * 4
    for b in buffers:
        for t in range(b.start, b.end):
            held[t] += -(-b.size // 64) * 64
    return held


def alone_peak(buffers, background):
    return max(held_alone(buffers, background))


def check_layout(layout, buffers, background, volatile=()):
    placed = [i for members in layout.members for i in members] + list(layout.alone)
    assert sorted(placed) == list(range(len(buffers)))
    for plan, members in zip(layout.pools, layout.members):
        verify([buffers[i] for i in members], plan.offsets, plan.arena, 64)
    assert layout.bound == alone_peak(buffers, background)
    held = held_at_each_step(layout, background)
    assert layout.peak == max(held) <= layout.bound
    alone = held_alone(buffers, background)
    assert all(held[t] <= alone[t] for t, flag in enumerate(volatile) if flag)


buffer_lists = st.lists(
    st.builds(lambda size, start, length: Buffer(64 * size, start, min(start + length, STEPS)),
              st.integers(1, 8), st.integers(0, STEPS - 1), st.integers(1, 6)),
    min_size=1, max_size=7)
backgrounds = st.lists(st.integers(0, 16).map(lambda x: 64 * x), min_size=STEPS, max_size=STEPS)
volatiles = st.lists(st.sampled_from([False, False, False, True]), min_size=STEPS,
                     max_size=STEPS)


@settings(max_examples=60, deadline=None)
@given(buffer_lists, backgrounds, volatiles)
def test_layout_never_raises_the_peak(buffers, background, volatile):
    layout = plan_pools(buffers, [background], volatile, time_limit=1)
    check_layout(layout, buffers, background, volatile)


@settings(max_examples=40, deadline=None)
@given(buffer_lists, backgrounds, backgrounds)
def test_layout_keeps_every_background_scenario_at_its_bound(buffers, first, second):
    layout = plan_pools(buffers, [first, second], time_limit=1)
    check_layout(layout, buffers, first)
    held = held_at_each_step(layout, second)
    assert max(held) <= alone_peak(buffers, second)


def brute_force_allocations(buffers, background, volatile):
    """The fewest (allocations, pools) over all cut sets whose layout keeps the peak at
    the bound and holds no more than every-buffer-alone at volatile steps, each pool as
    tall as its lower bound."""
    bound = alone_peak(buffers, background)
    alone = held_alone(buffers, background)
    points = sorted({b.start for b in buffers} | {b.end for b in buffers})
    best = None
    for k in range(len(points) - 1):
        for cuts in itertools.combinations(points[1:-1], k):
            edges = [points[0], *cuts, points[-1]]
            held = list(background) + [0] * 4
            pools = allocations = 0
            for lo, hi in zip(edges, edges[1:]):
                inside = [b for b in buffers if lo <= b.start and b.end <= hi]
                if inside:
                    pools += 1
                    for t in range(min(b.start for b in inside), max(b.end for b in inside)):
                        held[t] += lower_bound(inside, 64)
            for b in buffers:
                if not any(lo <= b.start and b.end <= hi for lo, hi in zip(edges, edges[1:])):
                    allocations += 1
                    for t in range(b.start, b.end):
                        held[t] += b.size
            if max(held) <= bound and all(held[t] <= alone[t]
                                          for t, flag in enumerate(volatile) if flag):
                cost = (allocations + pools, pools)
                best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=80, deadline=None)
@given(buffer_lists, backgrounds, volatiles)
def test_segment_choice_has_the_fewest_allocations(buffers, background, volatile):
    sizes, starts, ends = ([b.size for b in buffers], [b.start for b in buffers],
                           [b.end for b in buffers])
    segments = _Segments(sizes, starts, ends,
                         room_per_step(sizes, starts, ends, [background], volatile))
    chosen = segments.choose({})
    inside = [segments.inside(s) for s in chosen]
    pools = sum(1 for members in inside if members)
    alone = len(buffers) - sum(len(members) for members in inside)
    assert (pools + alone, pools) == brute_force_allocations(buffers, background, volatile)


def test_one_pool_when_the_background_is_flat():
    buffers = [Buffer(128, 0, 3, layer="layers.0"), Buffer(64, 1, 5, layer="layers.0"),
               Buffer(192, 3, 6, layer="layers.1"), Buffer(64, 5, 8)]
    layout = plan_pools(buffers, [[1000] * STEPS], time_limit=2)
    assert len(layout.pools) == 1 and layout.alone == ()
    assert layout.peak == layout.bound == layout.single_pool_peak
    check_layout(layout, buffers, [1000] * STEPS)


def test_rising_background_splits_the_pool():
    # A backward in miniature: one big temporary early, small ones late while the
    # outputs (background) pile up.  One arena would hold the big one's bytes to the end.
    buffers = [Buffer(640, 0, 2), Buffer(64, 2, 4), Buffer(64, 3, 6), Buffer(128, 6, 8)]
    background = [0, 0, 100, 300, 500, 700, 900, 1000, 1100, 1100]
    layout = plan_pools(buffers, [background], time_limit=2)
    check_layout(layout, buffers, background)
    assert layout.single_pool_peak > layout.bound == layout.peak
    assert len(layout.pools) >= 2


def test_no_unused_pool_bytes_at_volatile_steps():
    # Flat background: one pool would do, but at step 4 (a custom op that may allocate
    # temporaries) it would hold the 640-byte buffer's space unused.
    buffers = [Buffer(640, 0, 3), Buffer(64, 2, 6), Buffer(64, 5, 8)]
    background = [100] * STEPS
    flat = plan_pools(buffers, [background], time_limit=1)
    assert len(flat.pools) == 1
    volatile = [t == 4 for t in range(STEPS)]
    layout = plan_pools(buffers, [background], volatile, time_limit=1)
    check_layout(layout, buffers, background, volatile)
    assert len(layout.pools) + len(layout.alone) > 1
    assert any("volatile" in note for note in layout.notes)


def test_segments_whose_plan_misses_the_lower_bound_are_replanned(monkeypatch):
    # Every pool's plan stacks its buffers (valid, but taller than the lower bound):
    # the layout must still keep the peak at the bound.
    def stacking_plan(buffers, time_limit, alignment, bilevel, method):
        offsets, top = [], 0
        for b in buffers:
            offsets.append(top)
            top += -(-b.size // alignment) * alignment
        lb = lower_bound(buffers, alignment)
        return MemoryPlan(tuple(buffers), tuple(offsets), top, lb, lb, "heuristic", "stack", 0.0,
                    alignment), []

    monkeypatch.setattr(pools_module, "_plan_buffers", stacking_plan)
    buffers = [Buffer(64, 0, 2), Buffer(64, 2, 4), Buffer(128, 1, 3), Buffer(64, 4, 6),
               Buffer(64, 5, 7)]
    background = [0, 0, 0, 0, 0, 0, 500, 500, 0, 0]
    layout = plan_pools(buffers, [background], time_limit=2)
    check_layout(layout, buffers, background)


def test_solver_failure_falls_back_to_greedy_per_pool(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("HiGHS is gone")

    monkeypatch.setattr(pools_module, "plan_bilevel", broken)
    buffers = [Buffer(128, 0, 3, layer="layers.0"), Buffer(64, 1, 5, layer="layers.0")]
    layout = plan_pools(buffers, [[0] * STEPS], time_limit=1)
    check_layout(layout, buffers, [0] * STEPS)
    assert any("HiGHS is gone" in note and "greedy" in note for note in layout.notes)


def test_degenerate_and_bad_input():
    layout = plan_pools([Buffer(0, 0, 3), Buffer(64, 2, 2)], [[5] * 4], time_limit=1)
    assert layout.pools == () and layout.alone == (0, 1) and layout.peak == layout.bound == 5
    single = plan_pools([Buffer(100, 0, 1)], [[]], time_limit=1)
    assert single.placement() == [(0, 0)] and single.peak == 128
    with pytest.raises(LoongPlanError):
        plan_pools([Buffer(64, 0, 1)], [[-1]], time_limit=1)
    with pytest.raises(LoongPlanError):
        plan_pools([Buffer(64, 0, 1)], [], time_limit=1)
    with pytest.raises(LoongPlanError):
        plan_pools([Buffer(64, 0, 1)], [[0]], time_limit=0)
    with pytest.raises(LoongPlanError):
        plan_pools([Buffer(64, 3, 1)], [[0]], time_limit=1)


def test_draw_a_pool_layout(tmp_path):
    from loong_compile.passes.memory_plan.solver import draw_plan

    buffers = [Buffer(640, 0, 2), Buffer(64, 2, 4), Buffer(64, 3, 6), Buffer(128, 6, 8),
               Buffer(64, 1, 7)]
    layout = plan_pools(buffers, [[0, 0, 100, 300, 500, 700, 900, 1000, 1100, 1100]],
                        time_limit=1)
    assert layout.alone  # the long buffer crosses the cuts
    path = draw_plan(layout, tmp_path / "layout.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
