"""Local attention kernels behind one adapter, in SDPA layout ``(B, H, S, D)``.

``attention_forward(q, k, v)`` returns ``(out, lse)`` and
``attention_backward(dout, q, k, v, out, lse)`` returns ``(dq, dk, dv)``, where
``lse`` is the kernel's own log-sum-exp of the scaled scores per query row,
``(B, H, S_q)``, float32 (float64 for float64 inputs).  K/V may have fewer
heads than Q (GQA, query head ``i`` uses KV head ``i // (H / H_kv)``, as
``repeat_interleave``), and V its own head dim (MLA: ``D_v != D_qk``, as SDPA
allows; ``out`` has V's).  ``is_causal`` is only used for square blocks (the
diagonal blocks of the ring), where top-left and bottom-right alignment agree.

The adapter honours the kernels' contracts for every caller: the CUDA kernels
read the LSE, the output and its gradient from their data pointers as
contiguous arrays, whatever their strides (the ring hands them row slices), so
every tensor goes to a kernel contiguous; and the flash kernels (CPU, CUDA,
flash-attn 2) take one head dim for q, k and v, on CUDA a multiple of 8, so
q/k/v (and out/dout) are zero-padded to the kernel's width and the results cut
back.  Zero columns add nothing to a score (q, k) and give zero output columns
(v), so this is exact; the scale is the caller's.

Kernels, chosen per call:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward
  (all float dtypes, GQA native).
* CUDA, fp16/bf16: flash-attn >= 2.7 when installed (the ``cuda`` extra), else
  ``aten._scaled_dot_product_flash_attention`` (KV expanded locally for GQA).
* anything else (CUDA float32/float64): an exact matmul implementation that
  materialises the ``S_q × S_k`` scores of one block.

A block ``mask`` (masked 2D-Attention, ops/attention/masked.py) is a flex ``BlockMask`` on CUDA
(ops/attention/flex.py: ``flex_attention``, tiles without an allowed pair skipped), else a boolean
mask of at most one tile: to the CPU kernel as an additive mask, on CUDA in float64 to the
exact matmul implementation.  The
adapter owns the empty-row contract: a row with no allowed key returns
``out = 0``, ``lse = -inf`` and zero gradients (the CPU kernel itself reports
``lse = 0`` for such rows).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from loong_compile._compat.kernels import sdpa_flash_cpu, sdpa_flash_cpu_backward, sdpa_flash_cuda, sdpa_flash_cuda_backward
from loong_compile.ops.attention.flex import (FLEX_HEAD_DIM_MULTIPLE, BlockMask, flex_backward,
                                    flex_forward)

FLASH_ATTN_MIN_VERSION = "2.7"
CUDA_HEAD_DIM_MULTIPLE = 8   # PyTorch's CUDA flash kernel and flash-attn 2 take no other head dims


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of LSE and of every accumulator: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def token_major(out: Tensor) -> Tensor:
    """Attention's ``out`` ``(B, H, S, D)`` stored as ``(B, S, H, D)``, the layout its output
    projection reads (ops/attention/op_pair.py: what every attention op returns)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


class Kernel(NamedTuple):
    """``forward(q, k, v, causal_or_mask, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, causal_or_mask, scale) -> (dq, dk, dv)``;
    ``head_dim_multiple``: the kernel takes q, k and v of one head dim, a multiple of it
    (None: any head dims)."""
    forward: Callable
    backward: Callable
    name: str
    head_dim_multiple: int | None


def attention_forward(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float,
                      mask: Tensor | BlockMask | None = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)``; with a boolean ``mask`` (True = allowed, broadcast to ``(B, H, S_q, S_k)``)
    a row with no allowed key gives ``out = 0`` and ``lse = -inf``."""
    kernel = _kernel(q) if mask is None else _masked_kernel(q, mask)
    width = _kernel_head_dim(kernel, q, v)
    out, lse = kernel.forward(*_padded(width, q, k, v), is_causal if mask is None else mask,
                              scale)
    out = _cut_head_dim(out, v.size(-1))
    if not isinstance(mask, Tensor):  # no mask, or flex's (which reports -inf itself)
        return out, lse
    return out, lse.masked_fill(~mask.any(-1), -math.inf)


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       is_causal: bool, scale: float,
                       mask: Tensor | BlockMask | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``; with ``mask``, rows whose ``lse`` is ``-inf`` (no key anywhere) get
    zero gradients."""
    kernel = _kernel(q) if mask is None else _masked_kernel(q, mask)
    if mask is not None:
        # such a row's keys are all masked here, so any finite lse gives it probabilities 0
        lse = lse.masked_fill(torch.isinf(lse), 0.0)
    width = _kernel_head_dim(kernel, q, v)
    dq, dk, dv = kernel.backward(*_padded(width, dout, q, k, v, out), lse.contiguous(),
                                 is_causal if mask is None else mask, scale)
    return (_cut_head_dim(dq, q.size(-1)), _cut_head_dim(dk, k.size(-1)),
            _cut_head_dim(dv, v.size(-1)))


def kernel_name(q: Tensor) -> str:
    """Which kernel the adapter uses for tensors like ``q`` (for logs and reports)."""
    return _kernel(q).name


def _kernel(q: Tensor) -> Kernel:
    if q.device.type == "cpu":
        return Kernel(sdpa_flash_cpu, sdpa_flash_cpu_backward, "aten_flash_cpu", 1)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        if _flash_attn_usable():
            return Kernel(_flash_attn_forward, _flash_attn_backward, "flash_attn",
                          CUDA_HEAD_DIM_MULTIPLE)
        return Kernel(_cuda_forward, _cuda_backward, "aten_flash_cuda", CUDA_HEAD_DIM_MULTIPLE)
    return Kernel(_math_forward, _math_backward, "math", None)


def _masked_kernel(q: Tensor, mask: Tensor | BlockMask) -> Kernel:
    """Kernels that take a mask: flex_attention for a ``BlockMask`` (ops/attention/flex.py); for a
    boolean mask the CPU flash kernel (as an additive mask), else the exact matmul path."""
    if isinstance(mask, BlockMask):
        return Kernel(flex_forward, flex_backward, "flex_attention", FLEX_HEAD_DIM_MULTIPLE)
    if q.device.type == "cpu":
        return Kernel(_cpu_masked_forward, _cpu_masked_backward, "aten_flash_cpu", 1)
    return Kernel(_math_forward, _math_backward, "math", None)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _cpu_masked_forward(q, k, v, mask, scale):
    return sdpa_flash_cpu(q, k, v, False, scale, attn_mask=_additive(mask, q.dtype))


def _cpu_masked_backward(dout, q, k, v, out, lse, mask, scale):
    return sdpa_flash_cpu_backward(dout, q, k, v, out, lse, False, scale,
                                   attn_mask=_additive(mask, q.dtype))


# --- one head dim for q, k and v, a multiple of the kernel's --------------------

def _kernel_head_dim(kernel: Kernel, q: Tensor, v: Tensor) -> int | None:
    """The head dim the kernel is handed (None: each tensor keeps its own)."""
    multiple = kernel.head_dim_multiple
    if multiple is None:
        return None
    return -(-max(q.size(-1), v.size(-1)) // multiple) * multiple


def _padded(width: int | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor contiguous, its head dim zero-padded to ``width`` (None: kept)."""
    return tuple((t if width is None or t.size(-1) == width
                  else torch.nn.functional.pad(t, (0, width - t.size(-1)))).contiguous()
                 for t in tensors)


def _cut_head_dim(x: Tensor, head_dim: int) -> Tensor:
    return x[..., :head_dim] if x.size(-1) != head_dim else x


# --- GQA for kernels that want as many KV heads as Q heads -------------------

def _expand_kv(q: Tensor, kv: Tensor) -> Tensor:
    return kv.repeat_interleave(q.size(1) // kv.size(1), dim=1)


def _sum_kv_grad(grad: Tensor, kv_heads: int) -> Tensor:
    return grad.unflatten(1, (kv_heads, -1)).sum(2)


# --- CUDA: PyTorch's flash kernel ---------------------------------------------

def _cuda_forward(q, k, v, is_causal, scale):
    return sdpa_flash_cuda(q, _expand_kv(q, k), _expand_kv(q, v), is_causal, scale)


def _cuda_backward(dout, q, k, v, out, lse, is_causal, scale):
    dq, dk, dv = sdpa_flash_cuda_backward(dout, q, _expand_kv(q, k), _expand_kv(q, v), out, lse,
                                          is_causal, scale)
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
    """(B, H, S, D) -> contiguous (B, S, H, D)."""
    return x.transpose(1, 2).contiguous()


# flash-attn >= 2.7 registers its kernels as torch.ops.flash_attn.* (flash_attn_interface.py)
def _flash_attn_forward(q, k, v, is_causal, scale):
    out, lse, _, _ = torch.ops.flash_attn._flash_attn_forward(
        _to_flash_layout(q), _to_flash_layout(k), _to_flash_layout(v), 0.0, scale, is_causal,
        -1, -1, 0.0, None, False)
    return out.transpose(1, 2), lse


def _flash_attn_backward(dout, q, k, v, out, lse, is_causal, scale):
    qf, kf, vf = _to_flash_layout(q), _to_flash_layout(k), _to_flash_layout(v)
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    torch.ops.flash_attn._flash_attn_backward(
        _to_flash_layout(dout), qf, kf, vf, _to_flash_layout(out), lse, dq, dk, dv, 0.0, scale,
        is_causal, -1, -1, 0.0, None, False, None)
    return tuple(g.transpose(1, 2) for g in (dq, dk, dv))


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
