"""The layout rules (loong_compile/parallel/rules.py) and the agreement they buy: the backend and the
estimator/planner accept and refuse the same (seq, dp, cp, hp, inner ring, placement, heads)."""

import pytest
import torch

from loong_compile.config import LoongConfig
from loong_compile.parallel.tokens import local_token_indices
from loong_compile.errors import LoongError
from loong_compile.estimate.hardware import load_hardware
from loong_compile.estimate.memory import ParallelConfig
from loong_compile.estimate.models import ModelSpec
from loong_compile.estimate.search import plan
from loong_compile.parallel.rules import ring_position, sequence_divisor
from loong_compile.ops.attention.attention_2d import check_attention_inputs

# (seq, dp, cp, hp, inner_ring, placement, heads, kv_heads), accepted?
CASES = [
    ((4098, 1, 1, 2, 1, "head_first", 4, 4), True),       # cp = 1: no zigzag, seq % hp only
    ((4097, 1, 1, 2, 1, "head_first", 4, 4), False),
    ((4096, 1, 2, 2, 1, "context_first", 4, 4), True),
    ((4100, 1, 2, 2, 1, "head_first", 4, 4), False),      # 4100 % (2*2*2) = 4
    ((24, 1, 2, 3, 1, "context_first", 6, 6), True),
    ((6, 1, 3, 1, 1, "head_first", 2, 2), True),
    ((9, 1, 3, 1, 1, "head_first", 2, 2), False),         # 9 % (2*3) = 3
    ((4096, 1, 4, 1, 2, "head_first", 4, 4), True),
    ((4096, 1, 4, 1, 4, "head_first", 4, 4), True),       # one inner ring of all of cp
    ((4096, 1, 4, 1, 3, "head_first", 4, 4), False),      # inner ring does not divide cp
    ((4096, 1, 4, 2, 3, "context_first", 4, 4), False),
    ((4096, 1, 1, 4, 1, "head_first", 6, 6), False),      # hp does not divide the heads
    ((4096, 1, 1, 6, 1, "head_first", 12, 4), False),     # 4 KV heads: neither split nor replicated
    ((4096, 1, 1, 8, 1, "head_first", 8, 2), True),       # each KV head replicated 4 times
    ((12, 1, 1, 3, 1, "head_first", 3, 1), True),         # MQA over hp = 3
    ((4096, 1, 1, 1, 1, "head_first", 6, 4), False),      # not GQA groups
    ((4096, 2, 2, 2, 2, "context_first", 8, 8), True),
    ((4096, 2, 1, 1, 1, "head_first", 4, 4), True),
]
IDS = ["seq{}-dp{}-cp{}-hp{}-w{}-{}-H{}-Hkv{}".format(*case) for case, _ in CASES]
H100 = load_hardware("h100")


def backend_refusal(seq, dp, cp, hp, inner_ring, placement, heads, kv_heads) -> LoongError | None:
    """What the backend checks without processes: the options, the data layout (``shard_batch``
    cuts the sequence with ``local_token_indices``) and the attention op's inputs."""
    try:
        LoongConfig(hp=hp, cp=cp, inner_ring=inner_ring, placement=placement)
        local_token_indices(seq, cp, hp, 0, 0)
        local = torch.empty(1, heads, seq // (cp * hp), 8, device="meta")
        kv = torch.empty(1, kv_heads, seq // (cp * hp), 8, device="meta")
        check_attention_inputs(local, kv, kv, hp=hp, cp=cp, inner_ring=inner_ring)
    except LoongError as exc:
        return exc
    return None


def model_spec(heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(name="tiny", hidden=16 * heads, layers=2, heads=heads, kv_heads=kv_heads,
                     ffn=64, vocab=128)


def estimator_refusal(seq, dp, cp, hp, inner_ring, placement, heads, kv_heads) -> LoongError | None:
    """``loong estimate``'s checks: the model, then the configuration against it."""
    try:
        ParallelConfig(seq=seq, dp=dp, cp=cp, hp=hp, inner_ring=inner_ring).validate(
            model_spec(heads, kv_heads))
    except LoongError as exc:
        return exc
    return None


def planner_refusal(seq, dp, cp, hp, inner_ring, placement, heads, kv_heads) -> str | None:
    """``loong plan``'s verdict on this grid: the reason it pruned it for its layout, or None
    when it estimated it (ranked, or pruned for memory or as dominated)."""
    try:
        model = model_spec(heads, kv_heads)  # loong plan loads the model first
    except LoongError as exc:
        return str(exc)
    result = plan(model, seq, dp * cp * hp, H100, policies=("none",), zero_stages=(0,),
                  placements=(placement,))
    # plan enumerates inner rings below cp: w = cp is the same single ring as w = 1
    ring = 1 if inner_ring == cp else inner_ring
    wanted = {"dp": dp, "cp": cp, "hp": hp, "placement": placement, "inner_ring": ring}
    estimated = [c.describe() for c in result.ranked] + [
        p.config for p in result.pruned if "inner_ring" in p.config]
    if any(all(d[k] == v for k, v in wanted.items()) for d in estimated):
        return None
    grid = {"dp": dp, "cp": cp, "hp": hp}
    reasons = [p.reason for p in result.pruned if p.config == grid]
    return reasons[0] if reasons else f"inner_ring={inner_ring} never enumerated for cp={cp}"


@pytest.mark.parametrize("case,accepted", CASES, ids=IDS)
def test_backend_and_planner_agree(case, accepted):
    backend = backend_refusal(*case)
    estimator = estimator_refusal(*case)
    planner = planner_refusal(*case)
    assert (backend is None, estimator is None, planner is None) == (accepted,) * 3, \
        f"backend: {backend}; estimator: {estimator}; planner: {planner}"
    if not accepted:    # one rule, one wording: every side names the backend's rule
        assert backend.rule == estimator.rule
        if backend.rule not in planner:    # inner rings that do not divide cp are never enumerated
            assert "inner_ring" in backend.what and "never enumerated" in planner


def test_sequence_divisor():
    assert [sequence_divisor(cp, hp) for cp, hp in ((1, 1), (1, 4), (2, 1), (2, 3), (4, 2))] == \
        [1, 4, 4, 12, 16]


def test_ring_position():
    assert [ring_position(r, 2) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [ring_position(r, 1) for r in range(3)] == [(0, 0), (1, 0), (2, 0)]


@pytest.mark.parametrize("window", [1024, 4096, 8192])
def test_plan_keeps_windowed_models_distributed(window):
    """The backend distributes sliding windows of any length (masked 2D-Attention, issue 13),
    so the planner prunes no hp*cp > 1 grid for a window."""
    model = ModelSpec(name="windowed", hidden=64, layers=2, heads=4, kv_heads=4, ffn=64, vocab=128,
                      sliding_window=window, local_layers=1)
    result = plan(model, 4096, 2, H100, policies=("none",), zero_stages=(0,))
    distributed = {(c.config.cp, c.config.hp) for c in result.ranked}
    assert {(1, 1), (2, 1), (1, 2)} <= distributed
    assert not any("sliding_window" in p.reason for p in result.pruned)
