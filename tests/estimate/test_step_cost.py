"""Step time, ZeRO collectives and MFU (estimate/step.py); what plan searches and says about it
(ZeRO 0-3, the MEMO headline, sliding windows, MoE, --explain); the validation tables."""

import dataclasses
import json
from pathlib import Path

import pytest

from loong_compile.cli import main
from loong_compile.config import LoongConfig
from loong_compile.estimate import validation
from loong_compile.estimate.cost import layer_cost
from loong_compile.estimate.hardware import load_hardware
from loong_compile.estimate.memory import ParallelConfig
from loong_compile.estimate.presets import load_model
from loong_compile.estimate.rationale import explain_rank, step_parts
from loong_compile.estimate.search import plan
from loong_compile.estimate.step import collective_seconds, model_flops_per_sequence, step_cost

A100, H100 = load_hardware("a100"), load_hardware("h100")
LLAMA2_7B, GQA = load_model("llama2-7b"), load_model("7b-gqa")
DATA = Path(__file__).parent / "data"


def test_collectives_are_rings_on_the_slowest_link():
    nbytes = 1e9
    inside = collective_seconds(nbytes, 8, A100)
    assert inside == pytest.approx(7 / 8 * nbytes / 300e9 + 7 * 3e-6)
    across = collective_seconds(nbytes, 64, A100, passes=2)          # all-reduce over 8 nodes
    assert across == pytest.approx(2 * (63 / 64 * nbytes / (4 * 25e9 / 8) + 63 * 30e-6))
    assert collective_seconds(nbytes, 1, A100) == 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_collectives_hide_behind_compute_as_fsdp2_prefetches(zero):
    """A short sequence on 64 GPUs: the collectives exceed a block's compute, and the step
    exposes exactly the excess (ZeRO-3: per block, forward and backward; plus the root's gather)."""
    config = ParallelConfig(seq=8192, cp=8, hp=8)
    layer = layer_cost(GQA, config, "head_first", A100, "none")
    step = step_cost(GQA, config, layer, zero, A100)
    block = GQA.layer_matmul_params + GQA.norm_params
    gather = collective_seconds(2 * block, 64, A100)
    reduce = collective_seconds(4 * block, 64, A100, passes=2 if zero == 0 else 1)
    root = collective_seconds(2 * (2 * GQA.hidden * GQA.vocab + GQA.hidden), 64, A100)
    forward = layer.attention.forward_s + layer.dense_fwd_s + layer.elementwise_fwd_s
    backward = layer.total_s - forward
    n = GQA.layers
    expected = {0: max(0.0, n * (reduce - backward)),
                1: max(0.0, n * (reduce - backward)) + n * gather + root,
                2: root + n * (max(0.0, gather - forward) + max(0.0, reduce - backward)),
                3: root + n * (max(0.0, gather - forward) + max(0.0, gather + reduce - backward))}[zero]
    assert (step.gather_s, step.reduce_s) == pytest.approx((gather, reduce))
    assert step.exposed_comm_s == pytest.approx(expected)
    assert step.total_s == pytest.approx(n * layer.total_s + step.lm_head_s + expected)


def test_model_flops_are_memo_and_megatron_count():
    """MEMO §5.1: 6 s P + 6 n h s^2 (causal attention), P the weights a token multiplies."""
    s = 65536
    weights = LLAMA2_7B.layers * (4 * 4096 ** 2 + 3 * 4096 * 11008) + 4096 * 32000
    assert model_flops_per_sequence(LLAMA2_7B, s) == pytest.approx(6 * s * weights + 6 * 32 * 4096 * s ** 2)
    config = ParallelConfig(seq=s, dp=2, cp=2, hp=2)
    step = step_cost(LLAMA2_7B, config, layer_cost(LLAMA2_7B, config, "head_first", A100, "sc++"), 3, A100)
    assert step.model_flops == pytest.approx(model_flops_per_sequence(LLAMA2_7B, s) / 4)
    assert step.mfu == pytest.approx(step.model_flops / (step.total_s * 312e12))


@pytest.fixture(scope="module")
def headline():
    """MEMO's headline workload: a 7B Llama, 1M tokens, 8 x 80 GB."""
    return plan(LLAMA2_7B, 1048576, 8, A100)


def test_memo_headline_fits_under_zero3(headline):
    assert headline.ranked
    # every model state replicated (ZeRO-0: 16 bytes a parameter, 108 GB) does not fit; with
    # the LM head chunked (issue 22) and the MLP tiled (issue 52) ZeRO-1 to 3 do
    assert {c.zero for c in headline.ranked} == {1, 2, 3}
    assert all(c.memory.verdict == "fits" for c in headline.ranked)
    mfu, source = validation.published_reference(LLAMA2_7B, 1048576, 8)
    assert mfu == pytest.approx(0.523) and "MEMO Table 3" in source and "TP=8" in source


def test_plan_prints_its_best_mfu_beside_memos(capsys):
    assert main(["plan", "--model", "llama2-7b", "--seq", "1M", "--gpus", "8", "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    fit = int(out.split(" configurations fit")[0].rsplit(" ", 1)[1])
    assert fit > 0 and "predicted best MFU: " in out and "52.30 % MFU" in out and "--fsdp" in out


def test_plan_json_has_what_users_need_per_configuration(capsys, headline):
    assert main(["plan", "--model", "llama2-7b", "--seq", "1M", "--gpus", "8", "--gpu", "a100", "--json",
                 "--explain", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["published"]["mfu"] == pytest.approx(0.523)
    assert out["explain"]["rank"] == 2 and out["explain"]["lines"][0].startswith("#2:")
    for row, c in zip(out["ranked"], headline.ranked):
        assert row["memory"]["terms_gib"] and row["step"]["total_s"] == pytest.approx(row["step_s"])
        assert row["mfu"] == pytest.approx(c.mfu)
        assert LoongConfig(**row["options"]).hp == row["hp"]
        assert f"--hp {row['hp']} --cp {row['cp']}" in row["launch"]
        # ZeRO-3 is the example's --fsdp; ZeRO-2 is said beside the command (no flag for it)
        assert ("--fsdp" in row["launch"]) == (row["zero"] == 3)
        assert row["zero"] == 3 or "ZeRO-2: fully_shard" in row["launch"]


def test_explain_parts_sum_to_the_step_and_name_the_neighbours(headline):
    for c in headline.ranked:
        assert sum(step_parts(c, LLAMA2_7B.layers).values()) == pytest.approx(c.step_s, rel=1e-9)
    lines = explain_rank(headline, 2)
    assert lines[0].startswith("#2:") and any("against #1" in x for x in lines) \
        and any("against #3" in x for x in lines)
    beyond = len(headline.ranked) + 1
    with pytest.raises(Exception, match=f"--explain {beyond}"):
        explain_rank(headline, beyond)


def test_sliding_window_models_are_planned_with_2d_attention():
    """Masked 2D-Attention runs any window exactly (issue 13): Mistral's 4096-token window
    keeps every (hp, cp) grid of 8 GPUs, which fit and are ranked (the fastest, with the MLP
    tiled since issue 52, is data parallelism alone: 32K tokens fit one GPU)."""
    mistral = load_model(str(DATA / "mistral-7b.json"))
    result = plan(mistral, 32768, 8, H100, zero_stages=(3,))
    grids = {(c.config.cp, c.config.hp) for c in result.ranked}
    assert {(cp, hp) for cp in (1, 2, 4, 8) for hp in (1, 2, 4, 8) if cp * hp <= 8} <= grids
    assert "backend" not in result.pruned_reasons()
    assert not any("window" in p.reason for p in result.pruned)


def test_windowed_and_packed_layers_cost_the_pairs_and_chunks_they_need():
    """Issue 13's masked attention: fewer FLOPs and fewer CP bytes than the dense layer."""
    mistral = load_model(str(DATA / "mistral-7b.json"))
    dense = dataclasses.replace(mistral, sliding_window=0, local_layers=0)
    config = ParallelConfig(seq=32768, cp=8)
    windowed, full = (layer_cost(m, config, "head_first", H100, "none").attention
                      for m in (mistral, dense))
    assert windowed.compute_fwd_step_s < full.compute_fwd_step_s
    assert windowed.kv_chunk_bytes < full.kv_chunk_bytes
    packed = layer_cost(dense, dataclasses.replace(config, doc_length=4096), "head_first", H100,
                        "none").attention
    assert packed.compute_fwd_step_s < full.compute_fwd_step_s
    assert packed.kv_chunk_bytes < full.kv_chunk_bytes


def test_moe_model_states_count_every_expert():
    """Mixtral: 46.7 B parameters, 18 bytes each, do not fit 8 H100s even fully sharded (105 GB
    per GPU) unless the shards are on the host; on 32, bf16 weights (87 GiB) still cannot be
    replicated (ZeRO < 3)."""
    mixtral = load_model(str(DATA / "mixtral-8x7b.json"))
    assert plan(mixtral, 32768, 8, H100, states_on_host=False).best is None
    assert plan(mixtral, 32768, 8, H100).best.states_on_host
    result = plan(mixtral, 32768, 32, H100)
    assert result.ranked and all(c.zero == 3 for c in result.ranked)
    best = result.best
    assert best.memory.terms["parameters"] == pytest.approx(2 * mixtral.parameters / 32 / 2 ** 30, rel=1e-6)


def test_validation_tables_are_complete_and_predicted():
    cells = validation.loongtrain_cells()
    assert len(cells) == 2 * 6 * 16
    assert all(0 < c.predicted < 1 for c in cells)
    groups = validation.loongtrain_best_agrees(cells)
    assert len(groups) == 2 * 4 * 2
    memo = validation.memo_cells(workloads={(8, "7B", 1024)})
    assert [c.published for c in memo] == [0.523] and "TP=8" in memo[0].note
    assert dataclasses.replace(memo[0], predicted=0.5).error == pytest.approx(0.5 / 0.523 - 1)
