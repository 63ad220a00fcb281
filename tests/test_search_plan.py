"""Configuration search: enumeration, pruning with reasons, ranking, the recommended options."""

import dataclasses
import json

import pytest

from loong_compile.config import LoongConfig
from loong_compile.errors import LoongConfigError
from loong_compile.estimate.hardware import load_hardware
from loong_compile.estimate.memory import MemoryOptions, ParallelConfig, estimate_memory
from loong_compile.estimate.models import load_model
from loong_compile.estimate.search import plan

H100 = load_hardware("h100")
LLAMA31_8B = load_model("llama3.1-8b")


@pytest.fixture(scope="module")
def result():
    return plan(LLAMA31_8B, 131072, 64, H100)


def test_every_candidate_fits_and_is_ranked_by_throughput(result):
    assert result.ranked
    for c in result.ranked:
        assert c.config.gpus == 64
        assert c.memory.verdict == "fits"
        assert c.memory.estimate_gib <= 0.8 * H100.memory_gib
    speeds = [c.tokens_per_gpu_s for c in result.ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_pruned_configurations_say_why(result):
    reasons = result.pruned_reasons()
    assert reasons["heads"] == 1                       # d_hp = 64 > 32 heads
    assert reasons["memory"] + reasons["memory (headroom rule)"] > 0
    for p in result.pruned:
        if p.reason.startswith("memory"):
            config = ParallelConfig(seq=131072, dp=p.config["dp"], cp=p.config["cp"], hp=p.config["hp"],
                                    inner_ring=p.config["inner_ring"])
            alpha = 1.0 if p.config["alpha"] is None else p.config["alpha"]
            options = MemoryOptions.loongtrain(activations=p.config["activations"], alpha=alpha,
                                               zero=p.config["zero"])
            memory = estimate_memory(LLAMA31_8B, config, options, H100.memory_gib)
            assert memory.verdict != "fits"
            assert f"{memory.estimate_gib:.2f} GiB" in p.reason


def test_search_space_is_complete(result):
    """Every (dp, cp, hp, placement, w, policy, ZeRO stage) appears either ranked or pruned."""
    seen = {tuple(c.describe().values()) for c in result.ranked}
    seen |= {tuple(p.config.values()) for p in result.pruned if "placement" in p.config}
    grids = {(p.config["dp"], p.config["cp"], p.config["hp"]) for p in result.pruned if "placement" not in p.config}
    expected = 0
    for hp in (1, 2, 4, 8, 16, 32):
        for cp in (x for x in (1, 2, 4, 8, 16, 32, 64) if 64 % (x * hp) == 0):
            placements = 2 if hp > 1 and cp > 1 else 1
            rings = max(1, len([w for w in (1, 2, 4, 8, 16, 32) if cp % w == 0 and w < cp]))
            expected += placements * rings * (2 + 3) * 4      # none, sc++, memo x 3 alphas; ZeRO 0-3
    assert len(seen) == expected and grids == {(1, 1, 64)}


def test_recommended_options_are_valid_backend_options(result):
    best = result.best
    config = LoongConfig(**best.options)
    assert (config.hp, config.cp, config.inner_ring) == (best.config.hp, best.config.cp, best.config.inner_ring)
    assert config.activations in ("none", "sc++", "memo")


def test_tighter_memory_prefers_memory_saving_policies():
    small = dataclasses.replace(H100, memory_gib=40)
    tight = plan(LLAMA31_8B, 131072, 64, small, zero_stages=(3,))
    assert tight.ranked and all(c.memory.estimate_gib <= 32 for c in tight.ranked)
    assert {c.activations for c in tight.ranked} <= {"none", "sc++", "memo"}
    nothing = plan(LLAMA31_8B, 131072, 64, dataclasses.replace(H100, memory_gib=4))
    assert nothing.best is None and nothing.pruned


def test_host_memory_prunes_memo():
    starved = dataclasses.replace(H100, host_memory_gib=1)
    result = plan(LLAMA31_8B, 131072, 64, starved, policies=("memo",), alphas=(1.0,))
    assert result.pruned_reasons()["host memory"] > 0
    assert all("host memory" in p.reason or p.reason.startswith(("memory", "heads")) for p in result.pruned)


def test_sequence_that_does_not_split_is_pruned():
    result = plan(LLAMA31_8B, 131072 + 8, 64, H100, policies=("sc++",))
    assert result.pruned_reasons()["sequence"] > 0


@pytest.mark.parametrize("kwargs,named", [(dict(gpus=0), "gpus=0"), (dict(policies=("full",)), "activations"),
                                          (dict(placements=("diagonal",)), "placements"),
                                          (dict(seq=-5), "seq=-5")])
def test_bad_input_names_the_value(kwargs, named):
    args = dict(model=LLAMA31_8B, seq=131072, gpus=64, hardware=H100)
    args.update(kwargs)
    with pytest.raises(LoongConfigError, match=named):
        plan(args.pop("model"), args.pop("seq"), args.pop("gpus"), args.pop("hardware"), **args)


@pytest.mark.parametrize("model,gpus", [("llama3.1-8b", 8), ("llama3.1-70b", 32)])
def test_one_million_tokens_fit_with_the_lm_head_chunked(model, gpus, capsys):
    """Issue 22: with the LM head and its loss chunked (what the compiler runs when the loss is
    in the graph) both models fit 1M tokens on H100s; counting every token's logits (4D eq. 14,
    ``--unchunked-lm-head``), nothing does: the head was what did not fit."""
    from loong_compile.cli import main

    assert main(["plan", "--model", model, "--seq", "1M", "--gpus", str(gpus), "--gpu", "h100",
                 "--json", "--top", "3"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["ranked"], chunked["pruned_reasons"]
    for c in chunked["ranked"]:
        assert c["memory"]["verdict"] == "fits"
        assert c["memory"]["terms_gib"]["activations: LM head"] < 5
    unchunked = plan(load_model(model), 2 ** 20, gpus, H100,
                     memory_options=MemoryOptions.loongtrain(lm_head_chunk=None))
    assert not unchunked.ranked
