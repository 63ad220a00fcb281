"""flash-attn 2.8's ``flash_attn_interface``, implemented with math attention on CPU.

Layout ``(B, S, H, D)``; K/V may have fewer heads than Q (query head ``i`` uses
KV head ``i // (H / H_kv)``); ``causal`` and ``window_size`` are aligned to the
bottom-right of the score matrix as in flash-attn.  The ops take one head size
for q, k and v, a multiple of 8 (``flash_attn_func`` pads to it), as flash-attn 2's
kernels do.  Dropout, softcap and ALiBi are traced like the real ops (their fake
kernels) but refused when run.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from kernel_layout import kernel_reads


def _round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _refuse_unimplemented(dropout_p, softcap, alibi_slopes) -> None:
    if dropout_p or softcap or alibi_slopes is not None:
        raise NotImplementedError("the flash-attn stand-in computes no dropout, softcap or ALiBi")


def _check_head_sizes(*tensors: torch.Tensor) -> None:
    """flash-attn 2.8's mha_fwd / mha_bwd: one head size for all, a multiple of 8."""
    sizes = {t.size(-1) for t in tensors}
    if len(sizes) != 1 or next(iter(sizes)) % 8:
        raise RuntimeError(f"head sizes {sorted(sizes)}: flash-attn takes one head size, "
                           "a multiple of 8")


def _probabilities(q, k, softmax_scale, causal, window_left, window_right, lse=None):
    """Probabilities (B, H, S_q, S_k) in float32/float64 and the LSE they were normalised by."""
    acc = torch.promote_types(q.dtype, torch.float32)
    groups = q.size(2) // k.size(2)
    qh = q.transpose(1, 2).to(acc)
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1).to(acc)
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    s_q, s_k = q.size(1), k.size(1)
    # bottom-right alignment: query row i sits at key position i + s_k - s_q
    diagonal = torch.arange(s_q).unsqueeze(1) + (s_k - s_q)
    cols = torch.arange(s_k).unsqueeze(0)
    if causal:
        window_right = 0
    hidden = torch.zeros(s_q, s_k, dtype=torch.bool)
    if window_right >= 0:
        hidden |= cols > diagonal + window_right
    if window_left >= 0:
        hidden |= cols < diagonal - window_left
    scores = scores.masked_fill(hidden, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1).to(torch.float32)
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)
    return probs, lse


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                        softmax_scale: float, causal: bool, window_size_left: int,
                        window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_unimplemented(dropout_p, softcap, alibi_slopes)
    _check_head_sizes(q, k, v)
    probs, lse = _probabilities(q, k, softmax_scale, causal, window_size_left, window_size_right)
    vh = v.transpose(1, 2).repeat_interleave(q.size(2) // v.size(2), dim=1).to(probs.dtype)
    out = (probs @ vh).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse.contiguous(), q.new_empty(0), torch.zeros(2, dtype=torch.int64)


def _flash_attn_forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                             window_size_right, softcap, alibi_slopes, return_softmax):
    batch, s_q, heads, _ = q.shape
    probs_shape = ((batch, heads, _round_multiple(s_q, 128), _round_multiple(k.size(1), 128))
                   if return_softmax else (0,))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((batch, heads, s_q), dtype=torch.float32), q.new_empty(probs_shape),
            q.new_empty((2,), dtype=torch.int64))


def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                         dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], dropout_p: float,
                         softmax_scale: float, causal: bool, window_size_left: int,
                         window_size_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _refuse_unimplemented(dropout_p, softcap, alibi_slopes)
    _check_head_sizes(dout, q, k, v, out)
    dout, out, softmax_lse = (kernel_reads(t) for t in (dout, out, softmax_lse))
    probs, _ = _probabilities(q, k, softmax_scale, causal, window_size_left, window_size_right,
                              softmax_lse)
    acc, groups = probs.dtype, q.size(2) // k.size(2)
    dout_h = dout.transpose(1, 2).to(acc)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1).to(acc)
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1).to(acc)
    delta = (dout_h * out.transpose(1, 2).to(acc)).sum(-1)
    dscores = probs * (dout_h @ vh.transpose(-1, -2) - delta.unsqueeze(-1)) * softmax_scale
    grads = {"dq": dscores @ kh, "dk": dscores.transpose(-1, -2) @ q.transpose(1, 2).to(acc),
             "dv": probs.transpose(-1, -2) @ dout_h}
    for name, target in (("dq", dq), ("dk", dk), ("dv", dv)):
        grad = grads[name]
        if name != "dq":  # the sum over the query heads of each KV group
            grad = grad.unflatten(1, (-1, groups)).sum(2)
        target.copy_(grad.transpose(1, 2))
    padded = _round_multiple(q.size(1), 128)
    return torch.nn.functional.pad(delta.to(torch.float32), (0, padded - q.size(1)))


def _flash_attn_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                              softmax_scale, causal, window_size_left, window_size_right, softcap,
                              alibi_slopes, deterministic, rng_state=None):
    batch, s_q, heads, _ = q.shape
    return q.new_empty((batch, heads, _round_multiple(s_q, 128)), dtype=torch.float32)


def _register_ops() -> None:
    """Once per process: the fixture may import this module again after removing it."""
    if hasattr(torch.ops.flash_attn, "_flash_attn_forward"):
        return
    torch.library.custom_op("flash_attn::_flash_attn_forward", _flash_attn_forward,
                            mutates_args=())
    torch.library.register_fake("flash_attn::_flash_attn_forward", _flash_attn_forward_fake)
    torch.library.custom_op("flash_attn::_flash_attn_backward", _flash_attn_backward,
                            mutates_args=("dq", "dk", "dv"))
    torch.library.register_fake("flash_attn::_flash_attn_backward", _flash_attn_backward_fake)


_register_ops()


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    pad = -x.size(-1) % 8
    return torch.nn.functional.pad(x, [0, pad]) if pad else x


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_dim = q.size(3)
        keep_for_backward = is_grad_enabled and any(t.requires_grad for t in (q, k, v))
        q, k, v = (_pad_head_dim(t) for t in (q, k, v))
        out_padded, softmax_lse, probs, rng_state = torch.ops.flash_attn._flash_attn_forward(
            q, k, v, dropout_p, softmax_scale, causal=causal, window_size_left=window_size[0],
            window_size_right=window_size[1], softcap=softcap, alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0)
        if keep_for_backward:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.settings = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic)
        out = out_padded[..., :head_dim]
        return out if not return_softmax else (out, softmax_lse, probs)

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic = (
            ctx.settings)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_dim = dout.size(3)
        torch.ops.flash_attn._flash_attn_backward(
            _pad_head_dim(dout), q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
            causal, window_size[0], window_size[1], softcap, alibi_slopes, deterministic,
            rng_state=rng_state)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim],
                None, None, None, None, None, None, None, None, None)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Attention of ``(B, S, H, D)`` tensors, as ``flash_attn.flash_attn_func`` 2.8."""
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs,
                               torch.is_grad_enabled())
