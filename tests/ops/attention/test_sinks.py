"""Attention sinks (ops/attention/sinks.py): 2D-Attention with ``sinks=`` equals one process's softmax over
[scores, sink] in float64, the sink counted once per query across KV blocks and ranks, and the
sink parameter gets one process's gradient."""

import pytest
import torch
import torch.distributed as dist

from loong_compile import init_mesh
from loong_compile.ops import attention_2d
from loong_compile.ops.attention.sinks import sdpa_with_sinks
from loong_compile.parallel.tokens import mesh_token_indices
from loong_compile.testing import run_distributed

B, H, KV, S, D = 2, 4, 2, 48, 8
WINDOW = 10


def inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, H, S, D, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, KV, S, D, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(H, generator=gen, dtype=dtype) * 2, dout


def one_process(q, k, v, sinks, dout, window=None):
    """(out, dq, dk, dv, dsinks) of the definition, GQA repeated, causal (and windowed)."""
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    rows, cols = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keep = (cols <= rows) & ((rows - cols < window) if window else True)
    out = sdpa_with_sinks(q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1),
                          sinks, attn_mask=keep)
    return out.detach(), *torch.autograd.grad(out, (q, k, v, sinks), dout)


def test_sinks_op_and_its_gradient_in_float64_one_process():
    q, k, v, sinks, dout = inputs()
    want = one_process(q, k, v, sinks, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = attention_2d(*leaves[:3], is_causal=True, sinks=leaves[3])
    got = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)
    assert want[-1].abs().min() > 1e-3       # every head's sink has a gradient to check
    small = [t[:, :, :8].clone().requires_grad_() for t in (q, k, v)]
    small.append(sinks.clone().requires_grad_())
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: attention_2d(q, k, v, is_causal=True, sinks=s), small)


def test_a_row_that_sees_no_key_gives_zeros_as_one_process():
    q, k, v, sinks, _ = inputs()
    keep = torch.zeros(S, S, dtype=torch.bool)
    out = sdpa_with_sinks(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), sinks,
                          attn_mask=keep)
    assert torch.equal(out, torch.zeros_like(out))


def _distributed(rank, world, hp, cp, window):
    mesh = init_mesh(hp=hp, cp=cp, inner_ring=2 if cp == 2 and hp == 1 else 1)
    q, k, v, sinks, dout = inputs()
    index = mesh_token_indices(S, mesh)
    leaves = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    leaves.append(sinks.clone().requires_grad_())
    out = attention_2d(*leaves[:3], is_causal=True, window=window, sinks=leaves[3],
                       **mesh.attention_kwargs())
    dq, dk, dv, dsinks = torch.autograd.grad(out, leaves, dout[:, :, index])
    dist.all_reduce(dsinks)    # each rank's rows' share: summed, one process's gradient
    want = one_process(q, k, v, sinks, dout, window)
    errors = {name: float((g - w[:, :, index] if w.dim() == 4 else g - w).abs().max())
              for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"),
                                    (out.detach(), dq, dk, dv, dsinks), want)}
    return errors


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("hp,cp,window", [(2, 2, None), (2, 2, WINDOW), (1, 4, None)],
                         ids=["hp2cp2-ring", "hp2cp2-masked", "cp4-ring"])
def test_sinks_counted_once_per_query_across_blocks_and_ranks(hp, cp, window):
    for rank, errors in enumerate(run_distributed(_distributed, 4, hp, cp, window, timeout=150)):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-12, f"rank {rank}: {worst} off by {errors[worst]:.1e}"
