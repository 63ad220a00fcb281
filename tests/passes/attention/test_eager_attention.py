"""passes/attention/eager_attention.py on Dynamo graphs: attention written as ops (transformers'
eager chain and its variants) becomes one SDPA call computing the same; a chain with a step SDPA
cannot express is refused by name; a softmax that is no attention is left alone."""

import pytest
import torch
import torch.nn.functional as F

from loong_compile import LoongConfig
from loong_compile.errors import LoongUnsupportedError
from loong_compile.passes.attention.eager_attention import EagerAttentionPass
from loong_compile.passes.base import PassContext

B, H, KV, T, D = 2, 4, 2, 12, 8


def rewritten(fn, *inputs):
    """fn compiled with the pass run on its graph: (its output, the pass's summary, the ops)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["summary"] = EagerAttentionPass().run(gm, PassContext(config=LoongConfig(cp=2)))
        seen["ops"] = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes]
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return out, seen["summary"], seen["ops"]


def repeat_kv(x, n):
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)


def causal_additive(dtype):
    keep = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    return torch.where(keep[None, None].expand(B, 1, T, T), torch.zeros((), dtype=dtype),
                       torch.finfo(dtype).min)


def transformers_eager(q, k, v):
    """transformers' eager_attention_forward: GQA repeat, a where mask, float32 softmax."""
    k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    scores = scores + causal_additive(q.dtype)
    p = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    p = F.dropout(p, p=0.0, training=True)
    return torch.matmul(p, v)


def falcon_eager(q, k, v):
    scores = q @ k.transpose(-1, -2)
    scores /= D ** 0.5
    return F.softmax(scores + causal_additive(q.dtype), dim=-1, dtype=q.dtype) @ v


def gptj_eager(q, k, v):
    scores = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(2, 3)) / D ** 0.5
    p = F.softmax(scores + causal_additive(torch.float32), dim=-1).to(v.dtype)
    return torch.matmul(p, v)


def qkv(kv_heads=H, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, kv_heads, T, D, dtype=dtype),
            torch.randn(B, kv_heads, T, D, dtype=dtype))


@pytest.mark.parametrize("fn,kv_heads,tol", [(transformers_eager, KV, 1e-6),
                                             (falcon_eager, H, 1e-12), (gptj_eager, H, 1e-6)],
                         ids=["transformers", "falcon", "gptj"])
def test_each_chain_becomes_one_sdpa_call_that_computes_the_same(fn, kv_heads, tol):
    inputs = qkv(kv_heads)
    out, summary, ops = rewritten(fn, *inputs)
    assert ops.count("scaled_dot_product_attention") == 1
    assert not {"softmax", "matmul", "dropout"} & set(ops), ops
    (call,) = summary["changed"]
    assert call["scale"] == pytest.approx(D ** -0.5) and call["mask"].startswith("where(")
    # the float32 steps are dropped: float64 attention is float32's round-off from the chain
    torch.testing.assert_close(out, fn(*inputs), rtol=tol, atol=tol)


def test_the_boolean_mask_under_the_additive_one_is_what_sdpa_gets():
    out, summary, _ = rewritten(transformers_eager, *qkv(KV))
    keep = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    q, k, v = qkv(KV)
    want = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=keep,
                                          scale=D ** -0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert summary["changed"][0]["softmax_dtype"] == "torch.float32"


def softcapped(q, k, v):
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 / 50.0) * 50.0
    return torch.matmul(F.softmax(scores + causal_additive(q.dtype), dim=-1), v)


SINKS = torch.randn(H, dtype=torch.float64)


def gpt_oss_eager(q, k, v, sinks=SINKS):
    """gpt-oss's eager chain: a per-head sink logit joins the scores as a last column."""
    k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + causal_additive(q.dtype)[:, :, :, :T]
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(F.dropout(probs, p=0.0, training=True), v)


def test_sinks_chain_becomes_sdpa_with_sinks():
    inputs = qkv(KV)
    out, summary, ops = rewritten(gpt_oss_eager, *inputs)
    assert ops.count("sdpa_with_sinks") == 1 and "softmax" not in ops and "cat" not in ops
    assert summary["changed"][0]["sinks"] is not None
    torch.testing.assert_close(out, gpt_oss_eager(*inputs), rtol=1e-12, atol=1e-12)


def column_not_per_head(q, k, v):
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + causal_additive(q.dtype)
    combined = torch.cat([scores, torch.zeros(B, H, T, 1, dtype=q.dtype)], dim=-1)
    return torch.matmul(F.softmax(combined, dim=-1)[..., :-1], v)


def live_dropout(q, k, v):
    p = F.softmax(torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + causal_additive(q.dtype), dim=-1)
    return torch.matmul(F.dropout(p, p=0.1, training=True), v)


def score_bias(q, k, v):
    bias = torch.arange(T, dtype=q.dtype)[None, :] - torch.arange(T, dtype=q.dtype)[:, None]
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) + bias, dim=-1), v)


def weights_returned(q, k, v):
    p = F.softmax(torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + causal_additive(q.dtype), dim=-1)
    return torch.matmul(p, v), p


@pytest.mark.parametrize("fn,words", [
    (softcapped, ["softcapped score", "attn_logit_softcapping"]),
    (column_not_per_head, ["not one logit per head"]),
    (live_dropout, ["dropout p=0.1 is live", "attention_dropout=0.0"]),
    (score_bias, ["score bias"]),
    (weights_returned, ["read by 2 nodes", "output_attentions=False"]),
], ids=["softcap", "column_not_per_head", "dropout", "score_bias", "weights_returned"])
def test_a_step_sdpa_cannot_express_is_refused_by_name(fn, words):
    with pytest.raises(Exception) as info:
        rewritten(fn, *qkv())
    error = info.value
    while error is not None and not isinstance(error, LoongUnsupportedError):
        error = error.__cause__ or error.__context__
    assert error is not None, info.value
    missing = [w for w in words + ["attention written as ops", "fix:"] if w not in str(error)]
    assert not missing, str(error)


def test_a_softmax_that_is_no_attention_is_left_alone():
    router = torch.nn.Linear(D, 4, dtype=torch.float64)

    def routed(x):
        return F.softmax(router(x), dim=-1).topk(2, dim=-1).values

    x = torch.randn(B, T, D, dtype=torch.float64)
    out, summary, ops = rewritten(routed, x)
    assert summary == {"matched": 0, "changed": []} and "softmax" in ops
    torch.testing.assert_close(out, routed(x))
