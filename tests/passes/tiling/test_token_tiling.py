"""Token tiling (issue 52): the MLP of every family, found by what its nodes compute, runs a tile
of tokens at a time and equals the untiled model in float64 (loss and every gradient); the
report names each region, its tile and the bytes it frees; one tile shape whatever the count
(so one compile); tokens that fit one tile are left whole with the reason.  Under hp*cp > 1 and
every activation policy: tests/test_trust_matrix_inductor.py (``TILED``)."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

import loong_compile as lc
from helpers import allocated_shapes
from hf_models import build
from trust_cases import Case, _lora_setup, precision
from loong_compile._compat.dynamo import graphs_compiled
from loong_compile._compat.inductor import generated_code
from loong_compile.ops.tiling.region import Region

B, T = 2, 36          # tiles of 8 tokens a row: the last one short (4), padded to 8
TILE = 16             # tile_tokens counts the tokens of every row: 8 a row
# the MLP of each family: SwiGLU, GeGLU, GELU with a bias (GPT-2's Conv1D: addmm), the
# experts of a mixture on the rank's tokens, MLA's model (DeepSeek-V3's dense MLP)
FAMILIES = ["llama", "gemma3", "gpt2", "qwen3moe", "deepseek_v3"]
# float64 models agree to float64 round-off, but where a model computes in float32 inside the
# region: Gemma's norms (``x * (1 + w)`` in float32: the norm's weight gradient summed tile by
# tile rounds differently) and Qwen3-MoE, float32 throughout (grouped_mm has no float64)
RTOL = {"gemma3": 1e-6, "qwen3moe": 1e-5}


def ids() -> torch.Tensor:
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(3))


def train_step(call, model, tokens):
    """The loss of ``call`` (``model`` or its compiled form; transformers' own loss, labels=) and
    every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = call(tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def tilings(reports) -> list[dict]:
    """The token-tiling summary of each graph compiled (a graph break makes two)."""
    graphs = {id(report): report for report in reports}.values()   # published after each stage
    return [report.summary("token_tiling") for report in graphs]


def tiled(model, lowering="aot_eager", **options):
    reports = []
    backend = lc.LoongBackend({"lowering": lowering, "tile_tokens": TILE, **options},
                              on_report=reports.append)
    return torch.compile(model, backend=backend), reports


def assert_same(got, want, rtol=1e-10):
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=rtol, atol=rtol * ref.abs().max(),
                                   msg=name)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_mlp_of_every_family_is_tiled_and_exact(arch):
    model = build(arch, dtype=precision(arch))
    eager = copy.deepcopy(model)
    reference = train_step(eager, eager, ids())
    compiled, reports = tiled(model)
    assert_same(train_step(compiled, model, ids()), reference, RTOL.get(arch, 1e-10))
    changed = [region for summary in tilings(reports) for region in summary["changed"]]
    # one per decoder layer: its MLP, from the norm before it (the narrowest entry), handing
    # out one value as wide as what entered; DeepSeek-V3's MLA has two more regions (its rotary
    # angles, and its low-rank down projections from the norm, three outputs)
    mlps = [r for r in changed if re.search(r"(layers|h)\.\d+$", r["module"])
            and len(r["outputs"]) == 1]
    assert len({r["module"] for r in mlps}) == model.config.num_hidden_layers, changed
    for region in mlps:
        assert (region["tile"], region["tiles"], region["tokens"]) == (TILE, 5, B * T), region
    for region in changed:
        assert region["tiles"] > 1, region
    # attention's projections to heads and the LM head are wider at their outputs: never one
    assert not any("lm_head" in r["source"] or "q_proj" in r["source"] for r in changed)


def test_lora_adapters_in_a_tiled_mlp_are_exact():
    """PEFT's LoRA on the MLP's up projection (and attention's q and v), the base weights frozen:
    the region's frozen weights get no gradient (each an empty return of its own: an op's returns
    may not alias one another), the adapters their untiled gradients, under Inductor."""
    model = _lora_setup(Case("llama", habit="lora"), build("llama")).double()   # adapters too
    eager = copy.deepcopy(model)
    reference = train_step(eager, eager, ids())
    compiled, reports = tiled(model, lowering="inductor")
    # transformers' loss takes the logits to float32 (``logits.float()``): one float32 ulp apart
    assert_same(train_step(compiled, model, ids()), reference, rtol=1e-6)
    (region,) = [r for summary in tilings(reports) for r in summary["changed"]]
    assert "up_proj" in str(region) and any("lora" in name for name in reference[1])


def test_every_tile_runs_at_one_shape(monkeypatch):
    """The last, shorter tile is padded: the region is one compiled function whatever the tile
    count (compile time does not grow with the tiles)."""
    shapes = set()
    forward, gradients = Region.forward, Region.gradients
    monkeypatch.setattr(Region, "forward", lambda self, entry, others: (
        shapes.add(("forward", *entry.shape)), forward(self, entry, others))[1])
    monkeypatch.setattr(Region, "gradients", lambda self, entry, *rest: (
        shapes.add(("backward", *entry.shape)), gradients(self, entry, *rest))[1])
    model = build("llama")
    compiled, reports = tiled(model, tile_tokens=4)      # 18 tiles of 2 tokens a row
    train_step(compiled, model, ids())
    (region,) = [r for summary in tilings(reports) for r in summary["changed"]]
    assert region["tiles"] == 18
    assert shapes == {("forward", B, 2, 32), ("backward", B, 2, 32)}


@pytest.mark.parametrize("tile", [B * T, "auto"])
def test_tokens_that_fit_one_tile_are_left_whole_with_the_reason(tile):
    """A tile as long as the sequence, and the default's budget (1 GiB of intermediates), which
    the tiny model's whole graph fits: nothing tiled, and the report says why."""
    compiled, reports = tiled(build("llama"), tile_tokens=tile)
    compiled(ids(), labels=ids(), use_cache=False)
    (summary,) = tilings(reports)
    assert not summary["changed"]
    reasons = [r["reason"] for r in summary["not_tiled"]] + [summary.get("reason", "")]
    assert any("fit one tile" in r for r in reasons), summary


@pytest.mark.slow
def test_under_inductor_no_buffer_holds_the_whole_sequences_intermediates():
    model = build("llama")
    eager = copy.deepcopy(model)
    reference = train_step(eager, eager, ids())
    compiled, reports = tiled(model, lowering="inductor")
    got, code = generated_code(train_step, compiled, model, ids())
    assert_same(got, reference, rtol=1e-6)          # the model's float32 loss, fused differently
    (region,) = [r for summary in tilings(reports) for r in summary["changed"]]
    assert region["lowering"] == "inductor"
    # the model's graphs call the op; the region's own graphs (a tile's forward, its forward
    # and backward) hold its intermediates at one tile's length (8 tokens a row): no buffer of
    # the whole sequence's (B*T, F) anywhere
    ffn = model.config.intermediate_size
    assert any("torch.ops.loong.tiled_region.default" in c for c in code)
    wide = [s for s in allocated_shapes(code) if ffn in s]
    assert any(math.prod(s) == B * 8 * ffn for s in wide), wide
    assert max(math.prod(s) for s in wide) < B * T * ffn, wide
    # the region's two compiled functions serve every later step: none compiles again (the
    # second step's forward once reached the region with another dispatch state and recompiled)
    compiled_so_far = graphs_compiled()
    for _ in range(2):
        train_step(compiled, model, ids())
    assert graphs_compiled() == compiled_so_far


def test_under_sc_plus_plus_a_tiled_layer_saves_nothing_of_its_mlp():
    """At hp = cp = 1 under ``sc++`` with tiles, each layer saves its input and its attention's
    outputs (out, lse), nothing of the MLP's intermediates (the tiles recompute them): what the
    untiled layer saves.  The last layer may also hold the final norm's input (outside the layers)."""
    saved = {}
    for tiles in (0, TILE):
        model = build("llama")
        compiled, reports = tiled(model, activations="sc++", tile_tokens=tiles)
        train_step(compiled, model, ids())
        report = {id(r): r for r in reports}.popitem()[1]
        saved[tiles] = report.summary("activations")["layers"]
    assert report.summary("token_tiling")["changed"]
    width = model.config.hidden_size * B * T * 8             # one float64 (B, T, D) value
    for layer in saved[TILE]:
        assert (layer["input"]["count"], layer["input"]["bytes"]) == (1, width), layer
        assert layer["attention"]["count"] == 2, layer
    for layer in saved[TILE][:-1]:
        assert layer["other"]["count"] == 0, layer
    assert saved[TILE][-1]["other"]["bytes"] in (0, width)
    strip = lambda layers: [{c: layer[c]["bytes"] for c in ("input", "attention", "other")}
                            for layer in layers]
    assert strip(saved[TILE]) == strip(saved[0])
