"""Local attention kernels behind one adapter, in SDPA layout ``(B, H, S, D)``.

``attention_forward(q, k, v)`` returns ``(out, lse)`` and
``attention_backward(dout, q, k, v, out, lse)`` returns ``(dq, dk, dv)``, where
``lse`` is the kernel's own log-sum-exp of the scaled scores per query row,
``(B, H, S_q)``, float32 (float64 for float64 inputs).  K/V may have fewer
heads than Q (GQA, query head ``i`` uses KV head ``i // (H / H_kv)``, as
``repeat_interleave``).  ``is_causal`` is only used for square blocks (the
diagonal blocks of the ring), where top-left and bottom-right alignment agree.

The adapter honours the CUDA kernels' layout contract for every caller: the
kernels read the LSE, the output and its gradient from their data pointers as
contiguous arrays, whatever their strides (the ring hands them row slices), so
every tensor goes to a kernel contiguous; and PyTorch's CUDA flash kernel, like
flash-attn, takes head dims that are multiples of 8, so q/k/v (and out/dout)
are zero-padded to one and the results cut back (the scale is the caller's).

Kernels, chosen per call:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward
  (all float dtypes, GQA native).
* CUDA, fp16/bf16: flash-attn >= 2.7 when installed (the ``cuda`` extra), else
  ``aten._scaled_dot_product_flash_attention`` (KV expanded locally for GQA).
* anything else (CUDA float32/float64): an exact matmul implementation that
  materialises the ``S_q × S_k`` scores of one block.

A boolean block ``mask`` (masked 2D-Attention, ops/masked.py) goes to the CPU
kernel as an additive mask, and on CUDA to the exact matmul implementation
(flash-attn's varlen / ``window_size`` kernels are not wired in yet).  The
adapter owns the empty-row contract: a row with no allowed key returns
``out = 0``, ``lse = -inf`` and zero gradients (the CPU kernel itself reports
``lse = 0`` for such rows).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from loong_compile._compat.kernels import sdpa_flash_cpu, sdpa_flash_cpu_backward, sdpa_flash_cuda, sdpa_flash_cuda_backward

FLASH_ATTN_MIN_VERSION = "2.7"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of LSE and of every accumulator: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float,
                      mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)``; with a boolean ``mask`` (True = allowed, broadcast to ``(B, H, S_q, S_k)``)
    a row with no allowed key gives ``out = 0`` and ``lse = -inf``."""
    if mask is None:
        return _kernel(q)[0](*_contiguous(q, k, v), is_causal, scale)
    out, lse = _masked_kernel(q)[0](*_contiguous(q, k, v), mask, scale)
    return out, lse.masked_fill(~mask.any(-1), -math.inf)


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       is_causal: bool, scale: float,
                       mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``; with ``mask``, rows whose ``lse`` is ``-inf`` (no key anywhere) get
    zero gradients."""
    if mask is None:
        return _kernel(q)[1](*_contiguous(dout, q, k, v, out, lse), is_causal, scale)
    # such a row's keys are all masked here, so any finite lse gives it probabilities 0
    lse = lse.masked_fill(torch.isinf(lse), 0.0)
    return _masked_kernel(q)[1](*_contiguous(dout, q, k, v, out, lse), mask, scale)


def _contiguous(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in tensors)


def kernel_name(q: Tensor) -> str:
    """Which kernel the adapter uses for tensors like ``q`` (for logs and reports)."""
    return _kernel(q)[2]


def _kernel(q: Tensor):
    if q.device.type == "cpu":
        return sdpa_flash_cpu, sdpa_flash_cpu_backward, "aten_flash_cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        if _flash_attn_usable():
            return _flash_attn_forward, _flash_attn_backward, "flash_attn"
        return _cuda_forward, _cuda_backward, "aten_flash_cuda"
    return _math_forward, _math_backward, "math"


def _masked_kernel(q: Tensor):
    """Kernels that take a boolean mask: the CPU flash kernel (as an additive mask), else the
    exact matmul path (CUDA's flash kernels take no arbitrary mask)."""
    if q.device.type == "cpu":
        return _cpu_masked_forward, _cpu_masked_backward
    return _math_forward, _math_backward


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _cpu_masked_forward(q, k, v, mask, scale):
    return sdpa_flash_cpu(q, k, v, False, scale, attn_mask=_additive(mask, q.dtype))


def _cpu_masked_backward(dout, q, k, v, out, lse, mask, scale):
    return sdpa_flash_cpu_backward(dout, q, k, v, out, lse, False, scale,
                                   attn_mask=_additive(mask, q.dtype))


# --- GQA for kernels that want as many KV heads as Q heads -------------------

def _expand_kv(q: Tensor, kv: Tensor) -> Tensor:
    return kv.repeat_interleave(q.size(1) // kv.size(1), dim=1)


def _sum_kv_grad(grad: Tensor, kv_heads: int) -> Tensor:
    return grad.unflatten(1, (kv_heads, -1)).sum(2)


# --- CUDA kernels take head dims that are multiples of 8 ---------------------

def _pad_head_dim(x: Tensor) -> Tensor:
    """Zero columns up to a multiple of 8: they add nothing to scores or outputs."""
    pad = -x.size(-1) % 8
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _cut_head_dim(x: Tensor, head_dim: int) -> Tensor:
    return x[..., :head_dim] if x.size(-1) != head_dim else x


# --- CUDA: PyTorch's flash kernel ---------------------------------------------

def _cuda_forward(q, k, v, is_causal, scale):
    out, lse = sdpa_flash_cuda(_pad_head_dim(q), _pad_head_dim(_expand_kv(q, k)),
                               _pad_head_dim(_expand_kv(q, v)), is_causal, scale)
    return _cut_head_dim(out, q.size(-1)), lse


def _cuda_backward(dout, q, k, v, out, lse, is_causal, scale):
    padded = (_pad_head_dim(t) for t in (dout, q, _expand_kv(q, k), _expand_kv(q, v), out))
    dq, dk, dv = (_cut_head_dim(g, q.size(-1))
                  for g in sdpa_flash_cuda_backward(*padded, lse, is_causal, scale))
    return dq, _sum_kv_grad(dk, k.size(1)), _sum_kv_grad(dv, v.size(1))


# --- CUDA: flash-attn ---------------------------------------------------------

@functools.cache
def _flash_attn_usable() -> bool:
    try:
        import flash_attn
    except ImportError:
        return False
    from packaging.version import Version

    return Version(flash_attn.__version__) >= Version(FLASH_ATTN_MIN_VERSION)


def _to_flash_layout(x: Tensor) -> Tensor:
    """(B, H, S, D) -> contiguous (B, S, H, D), head dim padded to a multiple of 8."""
    return _pad_head_dim(x.transpose(1, 2)).contiguous()


def _from_flash_layout(x: Tensor, head_dim: int) -> Tensor:
    return _cut_head_dim(x, head_dim).transpose(1, 2)


# flash-attn >= 2.7 registers its kernels as torch.ops.flash_attn.* (flash_attn_interface.py)
def _flash_attn_forward(q, k, v, is_causal, scale):
    out, lse, _, _ = torch.ops.flash_attn._flash_attn_forward(
        _to_flash_layout(q), _to_flash_layout(k), _to_flash_layout(v), 0.0, scale, is_causal,
        -1, -1, 0.0, None, False)
    return _from_flash_layout(out, q.size(-1)), lse


def _flash_attn_backward(dout, q, k, v, out, lse, is_causal, scale):
    qf, kf, vf = _to_flash_layout(q), _to_flash_layout(k), _to_flash_layout(v)
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    torch.ops.flash_attn._flash_attn_backward(
        _to_flash_layout(dout), qf, kf, vf, _to_flash_layout(out), lse, dq, dk, dv, 0.0, scale,
        is_causal, -1, -1, 0.0, None, False, None)
    return tuple(_from_flash_layout(g, q.size(-1)) for g in (dq, dk, dv))


# --- exact fallback -----------------------------------------------------------

def _math_probabilities(q, k, lse, mask, scale):
    """Scaled scores (accumulation dtype, KV expanded) and, given ``lse``, the probabilities.

    ``mask``: True = causal, False = none, or a boolean tensor of allowed pairs.  A row with
    no allowed key gets probabilities 0 and ``lse = -inf``."""
    acc = accumulation_dtype(q.dtype)
    scores = q.to(acc) @ _expand_kv(q, k).to(acc).transpose(-1, -2) * scale
    if mask is True:
        scores = scores.masked_fill(
            torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), -math.inf)
    elif mask is not False:
        scores = scores.masked_fill(~mask, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.exp(scores - finite.unsqueeze(-1)), lse


def _math_forward(q, k, v, mask, scale):
    probs, lse = _math_probabilities(q, k, None, mask, scale)
    out = probs @ _expand_kv(q, v).to(probs.dtype)
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, mask, scale):
    probs, _ = _math_probabilities(q, k, lse, mask, scale)
    acc = probs.dtype
    dout_acc = dout.to(acc)
    dv = probs.transpose(-1, -2) @ dout_acc
    dprobs = dout_acc @ _expand_kv(q, v).to(acc).transpose(-1, -2)
    delta = (dout_acc * out.to(acc)).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = dscores @ _expand_kv(q, k).to(acc)
    dk = dscores.transpose(-1, -2) @ q.to(acc)
    return (dq.to(q.dtype), _sum_kv_grad(dk, k.size(1)).to(k.dtype),
            _sum_kv_grad(dv, v.size(1)).to(v.dtype))
