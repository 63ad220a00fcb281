"""MEMO's LP for alpha (eqs. 1-3): which constraint binds, infeasibility, forced alphas, and
the LP against the closed form of this one-variable problem."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loong_compile.estimate.alpha import AlphaInputs, evaluate_alpha, solve_alpha
from loong_compile.passes.activations.measure import (
    agree_min, available_host_memory, measure_host_bandwidth, measure_matmul_rate,
)

MB = 2**20


def inputs(**kw) -> AlphaInputs:
    """A layer of 100 MB input + attention and 400 MB others, 10 layers (8 swapped)."""
    base = {"s_input": 60 * MB, "s_attention": 40 * MB, "s_other": 400 * MB, "layers": 10,
            "resident_layers": 2, "bandwidth": 1000 * MB, "layer_time": 1.0, "host_memory": 1e15}
    return AlphaInputs(**(base | kw))


def test_bandwidth_binds():
    d = solve_alpha(inputs(layer_time=0.3))          # 300 MB per layer time: (300 - 100) / 400
    assert d.feasible and d.binding == "bandwidth" and d.alpha == pytest.approx(0.5)
    assert d.transfer_seconds == pytest.approx(0.3)


def test_host_memory_binds():
    d = solve_alpha(inputs(host_memory=8 * 200 * MB))  # 8 swapped layers of 200 MB: (200 - 100) / 400
    assert d.feasible and d.binding == "host_memory" and d.alpha == pytest.approx(0.25)
    assert d.host_bytes == pytest.approx(8 * 200 * MB)


def test_room_to_spare_swaps_everything():
    d = solve_alpha(inputs())
    assert d.feasible and d.alpha == pytest.approx(1.0) and d.binding == "alpha <= 1"


@pytest.mark.parametrize("kw,budget", [({"layer_time": 0.05}, "bandwidth budget"),
                                       ({"host_memory": 100 * MB}, "host memory budget")])
def test_infeasible_even_at_alpha_zero_is_reported(kw, budget):
    d = solve_alpha(inputs(**kw))
    assert not d.feasible and d.alpha == 0.0 and d.binding == "infeasible"
    assert "swapping layer inputs and attention outputs alone already exceeds the " + budget in d.message
    assert "degrades to full recompute" in d.message


def test_no_swapped_layer_needs_no_lp():
    d = solve_alpha(inputs(layers=2))
    assert d.feasible and d.alpha == 1.0 and "resident" in d.message


def test_forced_alpha_reports_the_budgets_it_breaks():
    ok = evaluate_alpha(inputs(), 0.5)
    assert ok.feasible and ok.alpha == 0.5 and ok.binding == "forced by the alpha option"
    over = evaluate_alpha(inputs(layer_time=0.3), 1.0)
    assert not over.feasible and "bandwidth" in over.message


@settings(max_examples=25, deadline=None)
@given(fixed=st.integers(1, 10**9), others=st.integers(1, 10**10), layers=st.integers(3, 80),
       bandwidth=st.floats(1e8, 1e11), layer_time=st.floats(1e-4, 10.0), host=st.floats(1e8, 1e13))
def test_lp_equals_the_closed_form(fixed, others, layers, bandwidth, layer_time, host):
    x = AlphaInputs(fixed // 2, fixed - fixed // 2, others, layers, 2, bandwidth, layer_time, host)
    cap = min(bandwidth * layer_time, host / (layers - 2))     # bytes one swapped layer may send
    d = solve_alpha(x)
    if fixed > cap * (1 + 1e-7):
        assert not d.feasible
    elif fixed < cap * (1 - 1e-7):
        assert d.feasible
        assert d.alpha == pytest.approx(min(1.0, (cap - fixed) / others), rel=1e-6, abs=1e-7)


def test_measurements_are_positive_and_cached():
    cpu = torch.device("cpu")
    assert measure_host_bandwidth(cpu) > 1e8
    assert measure_host_bandwidth(cpu) == measure_host_bandwidth(cpu)
    assert measure_matmul_rate(cpu, torch.float32) > 1e8
    assert 0 < available_host_memory(local_ranks=4) < available_host_memory(local_ranks=1)
    assert math.isfinite(available_host_memory())


def test_agree_min_is_the_identity_in_one_process():
    assert agree_min([3.0, 1e12, 0.5]) == [3.0, 1e12, 0.5]
