"""Activation management end to end on one process: classification and its bytes, MEMO's
policy (offload + token-slice recompute) for every alpha, against activations="none".

To keep the suite fast, each model is traced by Dynamo once (``helpers.captured``) and its
graph handed to a fresh ``LoongBackend`` per configuration (``helpers.run_step``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong_compile import LoongBackend, LoongConfigError, _compat
from helpers import (
    BATCH, BUDGET, DIM, FFN, HEADS, KV_HEADS, SEQ, assert_same_loss_and_grads, example_llama, run_step,
    tiny_llama, token_ids,
)

_references: dict[str, tuple] = {}


def reference(model_name):
    """activations="none" (Inductor's default partition), once per model."""
    if model_name not in _references:
        loss, grads, report = run_step(model_name, {"activations": "none"})
        _references[model_name] = (loss, grads, report)
    return _references[model_name]


# -- the matrix: every policy and alpha gives the numbers of activations="none" ----------

# alpha is read by "memo" only: none and sc++ run with some alphas to show it changes nothing.
CASES = [("example", "none", 0.125), ("example", "sc++", 0.0), ("example", "sc++", 1.0)]
CASES += [("example", "memo", alpha) for alpha in (0.0, 0.125, 0.5, 1.0)]
CASES += [("hf", "sc++", 0.5)] + [("hf", "memo", alpha) for alpha in (0.0, 0.125, 1.0)]
# on the oldest and newest torch too: transformers builds its causal mask under compile on
# torch 2.11 and skips it from 2.13 on (_compat: dynamo_traces_is_exporting)
CASES += [pytest.param("hf", "memo", 0.5, marks=pytest.mark.compat)]


@pytest.mark.slow
@pytest.mark.parametrize("model_name,policy,alpha", CASES)
def test_same_losses_and_gradients_as_none(model_name, policy, alpha):
    ref_loss, ref_grads, _ = reference(model_name)
    # resident_layers=0: both layers of the small models are swapped (MEMO keeps the last 2).
    loss, grads, report = run_step(model_name, {"activations": policy, "alpha": alpha,
                                                "resident_layers": 0})
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    if policy != "memo":
        assert "recompute" not in [p.name for p in report.passes]
        return
    recompute = report.summary("recompute")
    for layer in recompute["layers"]:
        assert layer["offloaded_tokens"] == [0, round(alpha * SEQ)]
        if alpha == 0:      # every "other" tensor recomputed in full
            assert not layer["sliced"] and not layer["kept"] and layer["full"]
            assert all("no token offloaded" in f["reason"] for f in layer["full"])
        elif alpha == 1:    # none recomputed
            assert not layer["sliced"] and not layer["full"] and layer["kept"]
            assert layer["recomputed_bytes"] == 0 and layer["recompute_flops"] == 0
        else:               # Llama's chains are token-wise: everything sliced, except a value
            # no token reaches (the causal mask's where, built only where transformers keeps
            # its mask under compile): it has no token rows to slice, so it is recomputed whole
            assert layer["sliced"] and not layer["kept"]
            token_free = [f for f in layer["full"]
                          if f["reason"] == "no token-sliced input reaches it: recomputed whole"]
            assert token_free == layer["full"], layer["full"]
            assert not token_free or not _compat.has("dynamo_traces_is_exporting"), token_free
    offload = report.summary("offload")
    assert all(row["device_bytes"] == 0 and row["offloaded_bytes"] > 0 for row in offload["layers"])


@pytest.mark.compat
@pytest.mark.slow
def test_memo_through_inductor(tmp_path):
    """One configuration lowered by Inductor (dump_dir: no cache hit, so the passes run)."""
    ref_loss, ref_grads, _ = reference("example")
    loss, grads, report = run_step("example", {"activations": "memo", "alpha": 0.5,
                                               "resident_layers": 0, "dump_dir": str(tmp_path)},
                                   lowering="inductor")
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    assert report.summary("offload")["host_bytes"] > 0
    assert all(layer["sliced"] for layer in report.summary("recompute")["layers"])


# -- the report: bytes per layer and category against the formulas ------------------------

def skeletal_bytes(b=BATCH, s=SEQ, d=DIM, h=HEADS, h_kv=KV_HEADS, f=FFN, e=4, last=False):
    """Saved bytes of one example-model layer under activations="none", from what its backward
    needs (MEMO Fig. 5 adapted to Llama: RMSNorm, GQA, RoPE, SwiGLU; fp32)."""
    head = d // h
    tokens = b * s
    others = tokens * e * (d          # attention_norm output (input of wq, wk, wv)
                           + d        # q after RoPE
                           + 2 * h_kv * head   # k after RoPE, v
                           + d        # the attention block's output or the residual after it
                           + d        # ffn_norm output
                           + 3 * f)   # gate, up, silu(gate)·up
    others += 2 * tokens * 4          # the two norms' rsqrt (fp32)
    if last:
        others += tokens * d * e      # the last layer's output, read by the final norm
    return {"input": tokens * d * e,
            "attention": tokens * d * e + b * h * s * 4,   # out, lse (fp32)
            "other": others}


@pytest.mark.compat
def test_report_bytes_match_the_formulas():
    _, _, report = reference("example")
    rows = report.summary("activations")["layers"]
    assert [r["layer"] for r in rows] == ["layers.0", "layers.1"]
    for i, row in enumerate(rows):
        want = skeletal_bytes(last=i == len(rows) - 1)
        assert {c: row[c]["bytes"] for c in want} == want, row["layer"]
        assert row["input"]["count"] == 1 and row["attention"]["count"] >= 2
        assert row["total_bytes"] == sum(want.values())


def test_memo_report_per_layer_matches_the_formulas():
    alpha, resident = 0.25, 1
    _, _, report = run_step("example", {"activations": "memo", "alpha": alpha,
                                        "resident_layers": resident})
    a = round(alpha * SEQ)
    summary = report.summary("activations")
    assert summary["swapped_layers"] == ["layers.0"]
    assert summary["lp"]["decision"]["binding"] == "forced by the alpha option"
    rows = report.summary("offload")["layers"]
    swapped = skeletal_bytes()
    assert rows[0] == {"layer": "layers.0", "swapped": True, "device_bytes": 0,
                       "offloaded_bytes": swapped["input"] + swapped["attention"] + swapped["other"] * a // SEQ,
                       "recomputed_bytes": swapped["other"] * (SEQ - a) // SEQ}
    resident_bytes = sum(skeletal_bytes(last=True).values())
    assert rows[1] == {"layer": "layers.1", "swapped": False, "device_bytes": resident_bytes,
                       "offloaded_bytes": 0, "recomputed_bytes": 0}


@pytest.mark.compat
def test_hf_layers_and_categories():
    """The same skeleton as ours on every torch.  On torch < 2.13 transformers builds its causal
    mask under compile and the one-rank attention pass makes that call 2D-Attention, whose
    ``out`` is token-major as SDPA's CPU kernel's is: the model's ``transpose(1, 2).contiguous()``
    is a view there too, not a copy o_proj would save beside ``out`` (docs/compat.md)."""
    _, _, report = reference("hf")
    summary = report.summary("activations")
    assert [r["layer"] for r in summary["layers"]] == ["model.layers.0", "model.layers.1"]
    for row, want in zip(summary["layers"], (skeletal_bytes(), skeletal_bytes(last=True))):
        assert {c: row[c]["bytes"] for c in want} == want


@pytest.mark.compat
def test_sc_plus_plus_keeps_inputs_and_attention_only():
    """LoongTrain §5.2: per layer, the input and the attention's out + lse (2SD + 4SH)."""
    _, _, report = run_step("example", {"activations": "sc++"})
    rows = report.summary("activations")["layers"]
    for i, row in enumerate(rows):
        want = skeletal_bytes()
        assert row["input"]["bytes"] == want["input"]
        assert row["attention"]["bytes"] == want["attention"]
        # only the last layer's output (the final norm's input) is left among the others
        assert row["other"]["bytes"] == (BATCH * SEQ * DIM * 4 if i == len(rows) - 1 else 0)


@pytest.mark.compat
def test_full_keeps_inputs_only_and_recomputes_the_attention():
    """``full`` at one process: PyTorch's SDPA (tagged random for its dropout, here 0) is
    recomputed too, so a layer saves its input alone; the loss is as under none."""
    loss, grads, report = run_step("hf", {"activations": "full"})
    rows = report.summary("activations")["layers"]
    assert [r["layer"] for r in rows] == ["model.layers.0", "model.layers.1"]
    for i, row in enumerate(rows):
        assert row["input"]["bytes"] == skeletal_bytes()["input"] and row["attention"]["bytes"] == 0, row
        assert row["other"]["bytes"] == (BATCH * SEQ * DIM * 4 if i == len(rows) - 1 else 0), row
    assert_same_loss_and_grads((loss, grads), reference("hf")[:2])


# -- a block compiled on its own (layer.compile(), compile_blocks, FSDP2's units) ------------

# what each policy does with a block's saved values, by category: (kept on the device, put on
# the host, recomputed in the backward by memo's pass)
BLOCK_KEEPS = {"sc++": ({"input", "attention"}, set(), set()),
               "memo": (set(), {"input", "attention"}, {"other"}),
               "full": ({"input"}, set(), set()), "full_offload": (set(), {"input"}, set())}


@pytest.mark.parametrize("policy", list(BLOCK_KEEPS))
def test_a_block_compiled_alone_is_one_layer(policy):
    """A block's graph holds no ModuleList element: it is one layer whose input is a graph
    input, every block swapped (none resident).  At one process the attention is PyTorch's
    SDPA, tagged random for its dropout: without dropout ``full`` recomputes it (saving no
    out or lse) and the passes after the partition still see it."""
    model, ids = tiny_llama(hf=True), token_ids()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    eager = model(ids, position_ids=positions, labels=ids).loss
    eager.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    reports = []
    options = {"lowering": "aot_eager", "activations": "memo" if policy == "memo" else policy,
               "alpha": 0.0, **BUDGET}
    backend = LoongBackend(options, on_report=reports.append)
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend=backend)
    loss = model(ids, position_ids=positions, labels=ids).loss
    loss.backward()
    assert_same_loss_and_grads((loss.detach(), {n: p.grad for n, p in model.named_parameters()}),
                               (eager.detach(), want))
    (row,) = reports[-1].summary("activations")["layers"]
    assert row["layer"] == "block" and row["input"]["count"] == 1, row
    device, host, recomputed = BLOCK_KEEPS[policy]
    saved = {c for c in ("input", "attention", "other") if row[c]["bytes"]}
    assert saved == device | host | recomputed, row
    if host:
        offload = reports[-1].summary("offload")
        assert offload["host_bytes"] == sum(row[c]["bytes"] for c in host), offload
        assert offload["recomputed_bytes"] == sum(row[c]["bytes"] for c in recomputed), offload


# -- bad input: a clear error or a reported fall-back, never a wrong gradient -------------

def test_alpha_outside_unit_interval_is_a_config_error():
    with pytest.raises(LoongConfigError, match=r"alpha=1\.5.*\[0, 1\].*fix:"):
        LoongBackend({"activations": "memo", "alpha": 1.5})


def test_host_budget_too_small_degrades_to_full_recompute():
    ref_loss, ref_grads, _ = reference("example")
    loss, grads, report = run_step("example", {"activations": "memo", "alpha": "auto",
                                               "resident_layers": 0, "host_memory": 1000.0})
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    summary = report.summary("activations")
    assert "already exceeds the host memory budget" in summary["fallback"]
    assert summary["alpha"] == 0.0 and summary["lp"]["decision"]["feasible"] is False
    assert report.summary("offload")["host_bytes"] == 0
    for layer in report.summary("recompute")["layers"]:
        assert layer["full"] and not layer["sliced"]


class NoLayers(torch.nn.Module):
    """No ModuleList of blocks: nothing to classify by layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 256))

    def forward(self, ids):
        return self.mlp(self.embed(ids))


def test_unclassifiable_model_is_a_reported_fallback():
    """Through torch.compile itself (the other tests hand Dynamo's graph to the backend)."""
    torch.manual_seed(0)
    model, ids = NoLayers(), token_ids()
    results = []
    for options in ({"activations": "none"}, {"activations": "memo", "alpha": 0.5}):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        reports = []
        backend = LoongBackend({"lowering": "aot_eager", **BUDGET, **options}, on_report=reports.append)
        logits = torch.compile(model, backend=backend, fullgraph=True)(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    report = reports[-1]
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    assert "no transformer layer" in report.summary("activations")["fallback"]
    assert report.summary("recompute")["matched"] == 0
    assert report.summary("offload")["matched"] == 0


def test_symbolic_sequence_length_is_a_reported_fallback():
    """dynamic=True: memo needs a static length; it says so and changes nothing."""
    torch._dynamo.reset()
    model, ids, reports = example_llama(), token_ids(), []
    backend = LoongBackend({"lowering": "aot_eager", "activations": "memo", "alpha": 0.5,
                            "resident_layers": 0, **BUDGET}, on_report=reports.append)
    loss = F.cross_entropy(torch.compile(model, backend=backend, dynamic=True)(ids)[:, :-1].flatten(0, 1),
                           ids[:, 1:].flatten())
    loss.backward()
    assert "memo needs a static sequence length" in reports[-1].summary("activations")["fallback"]
    assert reports[-1].summary("offload")["host_bytes"] == 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    eager.backward()
    assert_same_loss_and_grads((loss.detach(), grads), (eager.detach(), {n: p.grad for n, p in model.named_parameters()}))
