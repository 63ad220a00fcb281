"""The LM head and its loss, token-chunked (issue 22): every head and loss form the pass matches
equals the unchunked computation in float64 (loss; hidden, weight, bias gradients) under
aot_eager and Inductor, Inductor's code holds no full-logits buffer, and the peak memory of a
step follows the chunk.  What cannot be chunked is left as it is and reported, and logits that
leave the graph are reported with their cost and the fix."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loong_compile as lc
from helpers import allocated_shapes
from loong_compile._compat.inductor import generated_code
from loong_compile.report.allocator import measure_peak_bytes
from loong_compile.config import LoongConfig
from loong_compile.errors import LoongConfigError
from loong_compile.estimate.lm_head import chunk_tokens
from loong_compile.ops import lm_head_loss

B, T, H, V = 2, 40, 8, 96          # 80 tokens: chunks of 16 leave a short last one
CHUNK = 16
CAP, COHERE, GRANITE = 3.0, 0.5, 4.0


class Heads(nn.Module):
    """One loss per form the pass matches, each on its own projection (a graph of many heads
    compiles once for all of them)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)                 # tied: the head reads its weight
        self.head = nn.Linear(H, V, bias=False)
        self.biased = nn.Linear(H, V)

    def forward(self, hidden, labels, n):
        flat = labels.flatten()

        def ce(logits, **kw):
            return F.cross_entropy(logits.flatten(0, 1), flat, **kw)

        return {
            "sum over a global count": ce(self.head(hidden), reduction="sum") / n,
            "bias, mean": ce(self.biased(hidden)),
            "tied": ce(F.linear(hidden, self.embed.weight), reduction="sum"),
            "log_softmax + nll_loss, ignore_index=3": F.nll_loss(
                F.log_softmax(self.head(hidden), dim=-1).view(-1, V), flat.where(flat >= 0, 3),
                ignore_index=3),
            "softcap (Gemma)": ce(torch.tanh(self.biased(hidden) / CAP) * CAP, reduction="sum"),
            "logit_scale (Cohere)": ce(self.head(hidden) * COHERE),
            "logits_scaling (Granite)": ce(self.head(hidden) / GRANITE, reduction="sum"),
            "hidden @ W.T": ce(hidden @ self.head.weight.T, reduction="sum"),
        }


def inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, -5:] = -100                               # padding
    labels[0, :3] = 3
    return hidden, labels, torch.tensor(int((labels != -100).sum()))


def step(fn, model, hidden, labels, n):
    """Per-form losses, then the gradients of their sum (hidden's, each parameter's)."""
    hidden = hidden.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    losses = fn(hidden, labels, n)
    sum(losses.values()).backward()
    grads = {"hidden": hidden.grad} | {n: p.grad for n, p in model.named_parameters()}
    return {k: v.detach() for k, v in losses.items()}, grads


def compiled(model, lowering, reports, **options):
    backend = lc.LoongBackend({"lowering": lowering, "lm_head_chunk": CHUNK, **options},
                              on_report=reports.append)
    return torch.compile(model, backend=backend, fullgraph=True)


def assert_exact(got, want, rtol=1e-12):
    (losses, grads), (ref_losses, ref_grads) = got, want
    for name, ref in ref_losses.items():
        torch.testing.assert_close(losses[name], ref, rtol=rtol, atol=0, msg=name)
    for name, ref in ref_grads.items():
        assert ref.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=rtol, atol=rtol * ref.abs().max(), msg=name)


@pytest.mark.compat
def test_every_form_equals_the_unchunked_graph_in_float64_aot_eager():
    model, reports = Heads().double(), []
    plain = copy.deepcopy(model)
    reference = step(compiled(plain, "aot_eager", [], disable_passes=["lm_head_loss"]), plain,
                     *inputs())
    got = step(compiled(model, "aot_eager", reports), model, *inputs())
    assert_exact(got, reference)
    summary = reports[-1].summary("lm_head_loss")
    assert len(summary["changed"]) == 8 and not summary["not_chunked"]
    forms = {(c["bias"], c["softcap"], c["pre_scale"], c["post_scale"], c["reduction"],
              c["ignore_index"]) for c in summary["changed"]}
    assert (True, True, 1 / CAP, CAP, "sum", -100) in forms          # Gemma: tanh(z / cap) * cap
    assert (False, False, COHERE, 1.0, "mean", -100) in forms
    assert (False, False, 1 / GRANITE, 1.0, "sum", -100) in forms
    assert (False, False, 1.0, 1.0, "mean", 3) in forms
    for c in summary["changed"]:
        assert (c["tokens"], c["vocab"], c["chunk"], c["chunks"]) == (B * T, V, CHUNK, 5)


@pytest.mark.slow
def test_every_form_equals_eager_under_inductor_without_a_full_logits_buffer():
    model, reports = Heads().double(), []
    eager = copy.deepcopy(model)
    reference = step(eager, eager, *inputs())
    fn = compiled(model, "inductor", reports)
    got, code = generated_code(step, fn, model, *inputs())
    assert_exact(got, reference)
    assert len(reports[-1].summary("lm_head_loss")["changed"]) == 8
    assert len(code) == 2 and all("torch.ops.loong.lm_head_loss.default" in c for c in code[:1])
    # every buffer Inductor allocates: none holds a (tokens, vocabulary) logits tensor; the
    # largest are the weights' gradients (V, h)
    shapes = allocated_shapes(code)
    assert shapes and max(math.prod(s) for s in shapes) <= V * H, shapes
    # the same graph without the pass does allocate the logits
    plain = copy.deepcopy(model)
    _, plain_code = generated_code(
        step, compiled(plain, "inductor", [], disable_passes=["lm_head_loss"]), plain, *inputs())
    assert max(math.prod(s) for s in allocated_shapes(plain_code)) >= B * T * V


class OneHead(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.head = nn.Linear(H, vocab, bias=False)

    def forward(self, hidden, labels):
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")


@pytest.mark.slow
def test_peak_memory_follows_the_chunk_not_the_logits():
    """Forward + backward of a 4096-token, 1024-word head under Inductor: the chunked step's peak
    is a fraction of the logits it no longer holds (32 MiB in float64); the unchunked one holds
    them."""
    torch.manual_seed(0)
    model = OneHead(1024).double()
    hidden = torch.randn(1, 4096, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 1024, (1, 4096))
    logits_bytes = 4096 * 1024 * 8

    def peak(fn):
        fn(hidden, labels).backward()                    # compile
        return measure_peak_bytes(lambda: fn(hidden, labels).backward())[1]

    chunked = peak(compiled(model, "inductor", [], lm_head_chunk=256))
    unchunked = peak(compiled(copy.deepcopy(model), "inductor", [], disable_passes=["lm_head_loss"]))
    assert unchunked >= logits_bytes
    assert chunked <= logits_bytes / 8, (chunked, unchunked)


def test_transformers_loss_paths_are_chunked_and_equal_the_unchunked_graph():
    """transformers' own loss (labels=, shift_labels= + num_items_in_batch=), float upcast
    included; Gemma3 with final-logit softcapping and tied embeddings.  The loss runs in
    float32 after transformers' upcast: float32 round-off."""
    from hf_models import build

    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(48).expand(2, -1)
    for arch, habit in (("llama", "labels"), ("gemma3", "shift_labels")):
        model = build(arch, dtype=torch.float64)
        model.config.final_logit_softcapping = CAP if arch == "gemma3" else None

        def loss_of(m):
            if habit == "labels":
                return lambda i, p, y: m(i, position_ids=p, labels=y).loss
            return lambda i, p, y: m(i, position_ids=p, labels=y, shift_labels=y,
                                     num_items_in_batch=torch.tensor(80)).loss

        results, reports = [], []
        for options in ({"disable_passes": ["lm_head_loss"]}, {}):
            m = copy.deepcopy(model)
            backend = lc.LoongBackend({"lowering": "aot_eager", "lm_head_chunk": CHUNK, **options},
                                      on_report=reports.append)
            loss = torch.compile(loss_of(m), backend=backend, fullgraph=True)(ids, pos, ids)
            loss.backward()
            results.append(({"loss": loss.detach()}, {n: p.grad for n, p in m.named_parameters()}))
        assert_exact(results[1], results[0], rtol=1e-5)
        (chunked,) = reports[-1].summary("lm_head_loss")["changed"]
        assert chunked["softcap"] == (arch == "gemma3") and chunked["chunks"] == 6
        assert chunked["weight"].endswith("embed_tokens_parameters_weight_") == (arch == "gemma3")


@pytest.mark.compat
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transform", [(1.0, False, 1.0), (1 / CAP, True, CAP), (0.25, False, 2.0)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_op_equals_cross_entropy_in_float64(bias, transform, reduction):
    pre, softcap, post = transform
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, H, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (37,), generator=g)
    labels[::4] = -100
    leaves = [hidden, weight] + ([b] if bias else [])
    logits = F.linear(hidden, weight, b) * pre
    logits = torch.tanh(logits) * post if softcap else logits * post
    want = F.cross_entropy(logits, labels, reduction=reduction)
    want_grads = torch.autograd.grad(want * 3, leaves)
    got = lm_head_loss(hidden, weight, b, labels, reduction=reduction, chunk=8, pre_scale=pre,
                       softcap=softcap, post_scale=post, dtype="float64")
    got_grads = torch.autograd.grad(got * 3, leaves)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for mine, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-14)


def test_all_labels_ignored_gives_the_same_as_cross_entropy():
    hidden, weight = torch.randn(6, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    labels = torch.full((6,), -100)
    for reduction in ("sum", "mean"):
        want = F.cross_entropy(hidden @ weight.T, labels, reduction=reduction)
        got = lm_head_loss(hidden, weight, None, labels, reduction=reduction, chunk=4,
                           dtype="float64")
        torch.testing.assert_close(got, want, equal_nan=True)


def test_without_grad_the_op_computes_no_gradient():
    model, reports = OneHead(V).double(), []
    hidden, labels, _ = inputs()
    with torch.no_grad():
        got = compiled(model, "aot_eager", reports)(hidden, labels)
        want = model(hidden, labels)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    (site,) = reports[-1].summary("lm_head_loss")["changed"]
    assert site["with_grad"] is False and site["kept_bytes"] == 0


class LogitsAndLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, hidden, labels):
        logits = self.head(hidden).float()
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.0)


def test_logits_that_leave_the_graph_are_reported_with_their_cost_and_the_fix():
    hidden, labels, _ = inputs(torch.float32)
    report = lc.explain(LogitsAndLoss(), hidden, labels, lowering="aot_eager")
    summary = report.summary("lm_head_loss")
    assert summary["changed"] == []
    (left,) = summary["not_chunked"]
    assert "a graph output" in left["reason"] and "feed the loss alone" in left["reason"]
    (output,) = summary["logits_outputs"]
    assert output["shape"] == [B, T, V] and output["gib"] == pytest.approx(B * T * V * 4 / 2 ** 30)
    assert "graph output" in output["message"] and "NextTokenLoss" in output["fix"]
    assert "logits_outputs" in report.to_markdown()


def test_what_cannot_be_chunked_is_left_and_said():
    def smoothed(hidden, weight, labels):
        return F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(),
                               label_smoothing=0.1)

    def per_token(hidden, weight, labels):
        return F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(),
                               reduction="none").sum()

    hidden, labels, _ = inputs()
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    for fn, words in ((smoothed, "label_smoothing"), (per_token, "reduction='none'")):
        reports = []
        got = compiled(fn, "aot_eager", reports)(hidden, weight, labels)
        torch.testing.assert_close(got, fn(hidden, weight, labels))
        (left,) = reports[-1].summary("lm_head_loss")["not_chunked"]
        assert words in left["reason"]


def test_chunk_rule_and_option():
    assert chunk_tokens(131072, 128256) == 256                   # 125 MiB of float32 logits
    assert chunk_tokens(100, 128256) == 100                      # never more than the tokens
    assert chunk_tokens(10 ** 6, 256) == 131072 and chunk_tokens(500, 256, 64) == 64
    assert LoongConfig.from_options({}).lm_head_chunk == "auto"
    assert LoongConfig.from_options({}, environ={"LOONG_LM_HEAD_CHUNK": "512"}).lm_head_chunk == 512
    for bad in (0, "big", 1.5, True):
        with pytest.raises(LoongConfigError, match="lm_head_chunk"):
            LoongConfig.from_options({"lm_head_chunk": bad})
