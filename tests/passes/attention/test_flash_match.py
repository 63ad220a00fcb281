"""passes/attention/flash_match.py on real Dynamo graphs of the flash-attn 2.8 stand-in's flash_attn_func."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from loong_compile.passes.attention.flash_match import match_flash_attn


class GraphCaptured(Exception):
    """Raised by the captured graph instead of running it (the stand-in refuses some extras)."""


def graph_without_running(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)

        def refuse_to_run(*_):
            raise GraphCaptured

        return refuse_to_run

    with pytest.raises(GraphCaptured):
        torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def matches(gm):
    return [(n, match_flash_attn(n)) for n in gm.graph.nodes]


def projections(head_dim, requires_grad):
    """x (B=2, S=16, 32) -> q with 4 heads, k with 2 heads, v = 2k: (B, S, H, D) as flash-attn.

    With grad, Dynamo emits autograd_function_apply; without, it inlines the Function."""
    def qkv(x, w):
        q = (x @ w[:, :4 * head_dim]).view(2, 16, 4, head_dim)
        k = (x @ w[:, 4 * head_dim:]).view(2, 16, 2, head_dim)
        return q, k, k * 2
    return qkv, torch.randn(2, 16, 32), torch.randn(32, 6 * head_dim,
                                                    requires_grad=requires_grad)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_defaults_matched_with_resolved_scale(flash_attn_stand_in, requires_grad):
    qkv, x, w = projections(8, requires_grad)
    gm = graph_without_running(
        lambda x, w: flash_attn_stand_in.flash_attn_func(*qkv(x, w), causal=True), x, w)
    found = [r for _, r in matches(gm) if r is not None]
    assert len(found) == 1
    (call,) = found
    traced_as = (torch.ops.higher_order.autograd_function_apply if requires_grad
                 else torch.ops.flash_attn._flash_attn_forward)
    assert call.node.target is traced_as
    shapes = [tuple(n.meta["example_value"].shape) for n in (call.q, call.k, call.v)]
    assert shapes == [(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8)]
    assert call.v.target is operator.mul and call.v.args[0] is call.k
    assert (call.causal, call.softmax_scale, call.dropout_p, call.window_size, call.softcap,
            call.alibi_slopes, call.reads_attn_probs) == (True, 8 ** -0.5, 0.0, (-1, -1), 0.0,
                                                           None, False)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_padded_head_dim_and_extras_read_from_the_op(flash_attn_stand_in, requires_grad):
    """Head dim 12 is padded inside the Function: q/k/v still map to the outer (unpadded) nodes."""
    qkv, x, w = projections(12, requires_grad)
    slopes = torch.rand(4)

    def f(x, w, slopes):
        out, lse, _ = flash_attn_stand_in.flash_attn_func(
            *qkv(x, w), softmax_scale=0.3, window_size=(5, 0), softcap=30.0,
            alibi_slopes=slopes, return_attn_probs=True)
        return out.sum() + lse.sum()

    gm = graph_without_running(f, x, w, slopes)
    (call,) = [r for _, r in matches(gm) if r is not None]
    assert [n.meta["example_value"].size(-1) for n in (call.q, call.k, call.v)] == [12] * 3
    assert call.alibi_slopes.op == "placeholder"
    assert (call.causal, call.softmax_scale, call.window_size, call.softcap,
            call.reads_attn_probs) == (False, 0.3, (5, 0), 30.0, True)


def test_other_nodes_are_not_matched(flash_attn_stand_in):
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    def f(q):
        return Double.apply(F.scaled_dot_product_attention(q, q, q, is_causal=True))

    gm = graph_without_running(f, torch.randn(1, 2, 8, 8, requires_grad=True))
    nodes = matches(gm)
    assert any(n.target is torch.ops.higher_order.autograd_function_apply for n, _ in nodes)
    assert all(r is None for _, r in nodes)
