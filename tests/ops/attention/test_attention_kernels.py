"""The kernel adapter, the LSE merge and the single-process path of attention_2d."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from loong_compile.errors import LoongShapeError
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import attention_2d, merge_partial
from loong_compile.ops.attention.kernels import (
    _math_backward,
    _math_forward,
    attention_backward,
    attention_forward,
    kernel_name,
)

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (.ci/compat)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _reference(q, k, v, dout, is_causal, scale):
    """float64 SDPA (and its grads) plus the LSE from the scores."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    scores = q @ k.repeat_interleave(q.size(1) // k.size(1), 1).transpose(-1, -2) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
    return out, torch.logsumexp(scores, -1), *grads


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _random(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


KERNELS = {"adapter": (attention_forward, attention_backward), "math": (
    lambda q, k, v, *, is_causal, scale: _math_forward(q, k, v, is_causal, scale),
    lambda dout, q, k, v, out, lse, *, is_causal, scale: _math_backward(dout, q, k, v, out, lse,
                                                                        is_causal, scale))}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", [(6, 6, 10, 10), (6, 2, 10, 10),
                                                         (4, 1, 6, 10), (4, 2, 10, 6)])
@pytest.mark.parametrize("v_head_dim", [40, 24, 56])  # V's own head dim (MLA): narrower, wider
def test_kernel_matches_sdpa(kernel, dtype, is_causal, heads, kv_heads, q_len, kv_len, v_head_dim):
    if is_causal and q_len != kv_len:
        pytest.skip("causal blocks are square in the ring")
    forward, backward = KERNELS[kernel]
    q = _random((2, heads, q_len, 40), dtype, 0)
    dout = _random((2, heads, q_len, v_head_dim), dtype, 1)
    k = _random((2, kv_heads, kv_len, 40), dtype, 2)
    v = _random((2, kv_heads, kv_len, v_head_dim), dtype, 3)
    scale = 0.3
    out, lse = forward(q, k, v, is_causal=is_causal, scale=scale)
    grads = backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale)
    want = _reference(q, k, v, dout, is_causal, scale)
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32)
    assert [t.shape for t in (out, *grads)] == [dout.shape, q.shape, k.shape, v.shape]
    for got, ref in zip((out, lse, *grads), want):
        assert _rel(got, ref) <= TOLERANCE[dtype]


def test_cpu_uses_the_flash_kernel():
    assert kernel_name(torch.empty(1, 1, 1, 8)) == "aten_flash_cpu"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_sdpa(dtype):
    q, dout = (_random((2, 8, 128, 64), dtype, s).cuda() for s in (0, 1))
    k, v = (_random((2, 2, 128, 64), dtype, s).cuda() for s in (2, 3))
    out, lse = attention_forward(q, k, v, is_causal=True, scale=0.125)
    grads = attention_backward(dout, q, k, v, out, lse, is_causal=True, scale=0.125)
    want = _reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), True, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in zip((out, lse, *grads), want):
        assert _rel(got.cpu(), ref) <= tolerance


def test_merge_equals_softmax_over_the_union():
    scores = _random((3, 7), torch.float64, 0)
    values = _random((7, 5), torch.float64, 1)

    def part(cols):
        s = scores[:, cols]
        return torch.softmax(s, -1) @ values[cols], torch.logsumexp(s, -1)

    out, lse = merge_partial(*part(slice(0, 3)), *part(slice(3, 7)))
    assert torch.allclose(out, torch.softmax(scores, -1) @ values, rtol=1e-14, atol=1e-14)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), rtol=1e-14, atol=0)


def test_merge_handles_empty_rows_without_nan():
    """A fully masked row (LSE -inf, output 0) on either or both sides stays finite."""
    out_a = torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    lse_a = torch.tensor([0.5, -math.inf, -math.inf], dtype=torch.float64)
    out_b = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    lse_b = torch.tensor([-math.inf, 1.5, -math.inf], dtype=torch.float64)
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any() and not lse.isnan().any()
    assert out.tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]
    assert lse.tolist() == [0.5, 1.5, -math.inf]


def test_merge_is_stable_for_far_apart_lse():
    """LSEs 2000 apart: exp of their difference overflows, the merge must not."""
    out, lse = merge_partial(torch.ones(1, 1), torch.tensor([1000.0]),
                             torch.full((1, 1), 7.0), torch.tensor([-1000.0]))
    assert out.item() == 1.0 and lse.item() == 1000.0


@pytest.mark.parametrize("v_head_dim", [40, 24])
def test_single_process_attention_equals_sdpa_without_distributed(v_head_dim):
    mesh = init_mesh()
    assert mesh.sp == 1 and mesh.device_mesh is None
    q, k = _random((1, 6, 12, 40), torch.float64, 0), _random((1, 2, 12, 40), torch.float64, 2)
    v = _random((1, 2, 12, v_head_dim), torch.float64, 3)
    dout = _random((1, 6, 12, v_head_dim), torch.float64, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_2d(*leaves, is_causal=True, scale=None, return_lse=True,
                            **mesh.attention_kwargs())
    grads = torch.autograd.grad(out, leaves, dout)
    want = _reference(q, k, v, dout, True, 1 / math.sqrt(40))
    for got, ref in zip((out, lse, *grads), want):
        assert _rel(got, ref) <= 1e-12
    assert not lse.requires_grad


@pytest.mark.parametrize("what,k_shape,v_shape", [
    ("k's head dim", (1, 2, 12, 16), (1, 2, 12, 40)),
    ("v's tokens", (1, 2, 12, 40), (1, 2, 10, 24)),
    ("v's heads", (1, 2, 12, 40), (1, 3, 12, 24)),
    ("v's batch", (1, 2, 12, 40), (2, 2, 12, 24)),
])
def test_inconsistent_shapes_are_refused_by_name(what, k_shape, v_shape):
    """V may have its own head dim, nothing else of its own; k has q's head dim."""
    q = torch.randn(1, 6, 12, 40)
    with pytest.raises(LoongShapeError, match="D_v") as error:
        attention_2d(q, torch.randn(k_shape), torch.randn(v_shape), is_causal=True)
    assert f"k {k_shape}, v {v_shape}" in str(error.value) and "fix:" in str(error.value), what
