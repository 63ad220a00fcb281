"""Configuration search: enumeration, pruning with reasons, ranking, the recommended options."""

import dataclasses
import json
import re

import pytest

from loong_compile.config import LoongConfig
from loong_compile.parallel.rules import ACTIVATION_POLICIES, head_group_choices
from loong_compile.errors import LoongConfigError
from loong_compile.estimate.hardware import load_hardware
from loong_compile.estimate.memory import GIB, MemoryOptions, ParallelConfig, estimate_memory
from loong_compile.estimate.longest import longest_sequence
from loong_compile.estimate.presets import load_model
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
            # the most head groups the search tried (the fewest that fit are kept)
            config = ParallelConfig(seq=131072, dp=p.config["dp"], cp=p.config["cp"], hp=p.config["hp"],
                                    inner_ring=p.config["inner_ring"],
                                    head_groups=p.config["head_groups"])
            alpha = 1.0 if p.config["alpha"] is None else p.config["alpha"]
            options = MemoryOptions.loongtrain(activations=p.config["activations"], alpha=alpha,
                                               zero=p.config["zero"], states_on_host=p.config["states_on_host"])
            memory = estimate_memory(LLAMA31_8B, config, options, H100.memory_gib)
            assert memory.verdict != "fits"
            assert f"{memory.estimate_gib:.2f} GiB" in p.reason


def test_search_space_is_complete(result):
    """Every (dp, cp, hp, placement, w, policy, model states) appears either ranked or pruned."""
    seen = {tuple(c.describe().values()) for c in result.ranked}
    seen |= {tuple(p.config.values()) for p in result.pruned if "placement" in p.config}
    grids = {(p.config["dp"], p.config["cp"], p.config["hp"]) for p in result.pruned if "placement" not in p.config}
    expected = 0
    for hp in (1, 2, 4, 8, 16, 32):
        for cp in (x for x in (1, 2, 4, 8, 16, 32, 64) if 64 % (x * hp) == 0):
            placements = 2 if hp > 1 and cp > 1 else 1
            rings = max(1, len([w for w in (1, 2, 4, 8, 16, 32) if cp % w == 0 and w < cp]))
            # none, sc++, full, full_offload, memo x 3 alphas; ZeRO 0-3 and ZeRO-3 with the
            # states on the host
            expected += placements * rings * (4 + 3) * 5
    assert len(seen) == expected and grids == {(1, 1, 64)}


def test_recommended_options_are_valid_backend_options(result):
    best = result.best
    config = LoongConfig(**best.options)
    assert (config.hp, config.cp, config.inner_ring) == (best.config.hp, best.config.cp, best.config.inner_ring)
    assert config.activations in ACTIVATION_POLICIES


def test_tighter_memory_prefers_memory_saving_policies():
    small = dataclasses.replace(H100, memory_gib=40)
    tight = plan(LLAMA31_8B, 131072, 64, small, zero_stages=(3,))
    assert tight.ranked and all(c.memory.estimate_gib <= 32 for c in tight.ranked)
    assert {c.activations for c in tight.ranked} & {"sc++", "memo", "full", "full_offload"}
    nothing = plan(LLAMA31_8B, 131072, 64, dataclasses.replace(H100, memory_gib=4))
    assert nothing.best is None and nothing.pruned


def test_host_memory_prunes_memo():
    starved = dataclasses.replace(H100, host_memory_gib=1)
    result = plan(LLAMA31_8B, 131072, 64, starved, policies=("memo",), alphas=(1.0,))
    assert result.pruned_reasons()["host memory"] > 0
    assert all("host memory" in p.reason or p.reason.startswith(("memory", "heads")) for p in result.pruned)


@pytest.mark.parametrize("gpus", [1, 8])
def test_host_memory_of_a_node_limits_the_states_on_host(gpus):
    """Issue 52 item 5: ZeRO-3 with the states on the host keeps 18 bytes per parameter on the
    host over the GPUs of a node, whatever their number: within 0.8 x the node's host memory it
    fits, and its launch line is the example's; below, it is pruned for host memory.  On one
    H100 nothing else fits (ZeRO-3 over one rank shards nothing); on eight, ZeRO-3 on the
    device fits too and ranks first (it copies nothing over PCIe)."""
    states_gib = 18 * LLAMA31_8B.parameters / GIB

    def planned(host_memory_gib):
        hardware = dataclasses.replace(H100, host_memory_gib=host_memory_gib)
        return plan(LLAMA31_8B, 32768, gpus, hardware, policies=("sc++",), zero_stages=(3,))

    roomy, tight = planned(states_gib / 0.8 + 1), planned(states_gib / 0.8 - 1)
    on_host = [c for c in roomy.ranked if c.states_on_host]
    assert on_host and all(gpus * c.memory.host_gib == pytest.approx(states_gib) for c in on_host)
    assert all(" --fsdp --offload-states  # ZeRO-3 + host: " in c.launch() for c in on_host)
    assert roomy.best.states_on_host == (gpus == 1)
    assert not any(c.states_on_host for c in tight.ranked)
    host_pruned = [p for p in tight.pruned if p.config.get("states_on_host")]
    assert host_pruned and all(p.reason.startswith(f"host memory: {states_gib:.2f} GiB per node ({gpus} GPUs x")
                               for p in host_pruned)


def test_states_on_host_in_the_cli(capsys):
    """``loong estimate --states-on-host`` (ZeRO-3 only) and ``loong plan`` naming it."""
    from loong_compile.cli import main

    estimate = ["estimate", "--model", "llama3.1-8b", "--seq", "32K", "--gpus", "8", "--gpu", "h100",
                "--states-on-host", "--json"]
    assert main(estimate + ["--zero", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "parameters (gathered on device)" in out["terms_gib"] and "parameters" not in out["terms_gib"]
    assert "host: optimizer states" in out["host_gib"]
    assert main(estimate) == 2 and "states_on_host=True with zero=1" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3.1-8b", "--max-seq", "--gpus", "1", "--gpu", "h100",
                 "--activations", "sc++", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sc\+\+(, head groups \d+)?, ZeRO-3 \+ host", out)
    assert "--fsdp --offload-states  # ZeRO-3 + host" in out


def test_sequence_that_does_not_split_is_pruned():
    result = plan(LLAMA31_8B, 131072 + 8, 64, H100, policies=("sc++",))
    assert result.pruned_reasons()["sequence"] > 0


@pytest.mark.parametrize("kwargs,named", [(dict(gpus=0), "gpus=0"), (dict(policies=("selective",)), "activations"),
                                          (dict(placements=("diagonal",)), "placements"),
                                          (dict(seq=-5), "seq=-5")])
def test_bad_input_names_the_value(kwargs, named):
    args = dict(model=LLAMA31_8B, seq=131072, gpus=64, hardware=H100)
    args.update(kwargs)
    with pytest.raises(LoongConfigError, match=named):
        plan(args.pop("model"), args.pop("seq"), args.pop("gpus"), args.pop("hardware"), **args)


def test_longest_sequence_fits_and_nothing_fits_at_1_1x():
    """``loong plan --max-seq``: Llama-3.1-8B on 8 H100s.  Its configuration fits at the length
    it returns (the estimator's verdict, asked again here), nothing fits at 1.1x that length
    (rounded to a length every mesh accepts), and on every mesh one step more does not fit.
    No length is hard-coded: the answer moves with the estimator's terms."""
    longest = longest_sequence(LLAMA31_8B, 8, H100)
    best = longest.plan.best
    assert longest.seq > 0 and best.config.seq == longest.seq and best.config.gpus == 8
    options = MemoryOptions.loongtrain(activations=best.activations, zero=best.zero,
                                       states_on_host=best.states_on_host,
                                       alpha=1.0 if best.alpha is None else best.alpha)
    assert estimate_memory(LLAMA31_8B, best.config, options, H100.memory_gib).verdict == "fits"
    beyond = -(-int(1.1 * longest.seq) // 16) * 16          # 16 = 2 * gpus: every 2*cp*hp divides it
    assert plan(LLAMA31_8B, beyond, 8, H100).best is None
    assert longest.seq == max(m.longest for m in longest.meshes)
    assert {(m.dp, m.cp, m.hp) for m in longest.meshes} == {
        (8 // (cp * hp), cp, hp) for hp in (1, 2, 4, 8) for cp in (1, 2, 4, 8) if cp * hp <= 8}
    for m in longest.meshes:
        def on_mesh(seq):
            return [c for c in plan(LLAMA31_8B, seq, 8, H100).ranked
                    if (c.config.dp, c.config.cp, c.config.hp) == (m.dp, m.cp, m.hp)]
        assert m.longest % m.step == 0 and on_mesh(m.longest) and not on_mesh(m.longest + m.step)
        assert min(c.memory.estimate_gib for c in on_mesh(m.longest)) == pytest.approx(m.estimate_gib)


def test_the_plan_takes_the_fewest_head_groups_that_fit():
    """Issue 52: head groups are searched, the fewest that fit (more run more rounds of
    collectives): for every configuration ranked at 128K tokens and at the longest sequence on 8
    H100s, the next fewer groups do not fit.  At the longest the configuration runs attention in
    groups (its options and launch line say how many); at 128K the fastest needs none."""
    def fewer_do_not_fit(candidate):
        choices = head_group_choices(LLAMA31_8B.heads, LLAMA31_8B.kv_heads, candidate.config.hp)
        index = choices.index(candidate.config.head_groups)
        if index == 0:
            return True
        fewer = dataclasses.replace(candidate.config, head_groups=choices[index - 1])
        options = MemoryOptions.loongtrain(activations=candidate.activations, zero=candidate.zero,
                                           states_on_host=candidate.states_on_host,
                                           alpha=1.0 if candidate.alpha is None else candidate.alpha)
        return estimate_memory(LLAMA31_8B, fewer, options, H100.memory_gib).verdict != "fits"

    longest = longest_sequence(LLAMA31_8B, 8, H100).plan
    groups = longest.best.config.head_groups
    assert groups > 1 and longest.best.options["head_groups"] == groups
    assert f"--head-groups {groups} " in longest.best.launch()
    short = plan(LLAMA31_8B, 131072, 8, H100)
    assert short.best.config.head_groups == 1 and "head_groups" not in short.best.options
    assert any(c.config.head_groups > 1 for c in short.ranked)
    assert all(fewer_do_not_fit(c) for c in (*longest.ranked, *short.ranked))


def test_longest_sequence_honours_the_multiple_and_reports_none_that_fit():
    exact = longest_sequence(LLAMA31_8B, 8, H100, policies=("memo",), alphas=(0.0,), zero_stages=(3,))
    rounded = longest_sequence(LLAMA31_8B, 8, H100, seq_multiple=1024, policies=("memo",), alphas=(0.0,),
                               zero_stages=(3,))
    assert rounded.seq % 1024 == 0 and exact.seq - 1024 < rounded.seq <= exact.seq
    nothing = longest_sequence(LLAMA31_8B, 8, dataclasses.replace(H100, memory_gib=4))
    assert nothing.seq == 0 and nothing.plan is None and all(m.longest == 0 for m in nothing.meshes)


@pytest.mark.parametrize("model,gpus", [("llama3.1-8b", 8), ("llama3.1-70b", 32)])
def test_one_million_tokens_fit_with_the_lm_head_chunked(model, gpus, capsys):
    """Issue 22: with the LM head and its loss chunked (what the compiler runs when the loss is
    in the graph) both models fit 1M tokens on H100s; counting every token's logits (4D eq. 14,
    ``--unchunked-lm-head``), the best of them does not: the head is what would not fit."""
    from loong_compile.cli import main

    assert main(["plan", "--model", model, "--seq", "1M", "--gpus", str(gpus), "--gpu", "h100",
                 "--json", "--top", "3"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["ranked"], chunked["pruned_reasons"]
    for c in chunked["ranked"]:
        assert c["memory"]["verdict"] == "fits"
        assert c["memory"]["terms_gib"]["activations: LM head"] < 5
    # (the MLP untiled too, as before issue 52)
    best = plan(load_model(model), 2 ** 20, gpus, H100).ranked[0]
    unchunked = MemoryOptions.loongtrain(lm_head_chunk=None, tile_tokens=None, zero=best.zero,
                                         states_on_host=best.states_on_host, activations=best.activations,
                                         alpha=best.alpha or 0.0)
    every_logit = estimate_memory(load_model(model), best.config, unchunked, H100.memory_gib)
    assert every_logit.verdict != "fits", every_logit.terms
