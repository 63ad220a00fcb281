"""The LM head and its token-wise loss as one token-chunked op: one chunk's logits at a time
(the gradient-in-forward strategy of token tiling, ``ops/tiling/__init__.py``).

``lm_head_loss(hidden, weight, bias, labels, ...)`` equals, in value and gradient::

    logits = F.linear(hidden, weight, bias).to(compute)            # (N, V), never formed
    logits = post_scale * tanh(pre_scale * logits)                 # softcap=True (Gemma)
    logits = post_scale * pre_scale * logits                       # softcap=False (Cohere, Granite)
    F.cross_entropy(logits, labels, ignore_index=..., reduction=...).to(dtype)

but forms the logits ``chunk`` tokens at a time (``loop.tiles``).  The gradient is computed in the
forward (as Liger-Kernel's fused linear cross-entropy does), chunk by chunk: the softmax of the chunk
minus the one-hot labels, through the logit transforms, times the weight (into dL/dhidden)
and the hidden states (into dL/dweight, accumulated in float32: ``loop.Gradients``).  The loss is
a scalar, so its gradient only scales them: the backward multiplies the three by the incoming
gradient (``loop.scaled``).
docs/architecture.md ("The LM head and the loss") says why this, and not recomputing each
chunk in the backward (4/3 of the head's matmuls; measured in docs/benchmarks.md).

Compute dtype: the loss's (what ``cross_entropy`` received: transformers upcasts to float32),
at least float32; the projection runs in the weights' dtype as ``F.linear`` does, and the
weight's gradient accumulates in the wider of the two.  What the op keeps and needs per chunk is
``loong_compile/estimate/lm_head.py`` (``kept_bytes``, ``working_bytes``).

``torch.ops.loong.lm_head_loss`` is the custom op (fake kernel, autograd); the function
``lm_head_loss`` is what the LM-head pass emits (flattening, ``mean``, the output dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loong_compile.ops.tiling.loop import Gradients, scaled, tiles

_NOTHING = (0,)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss of ``dtype`` logits is computed in: float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lm_head_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, *,
                 ignore_index: int = -100, reduction: str = "mean", chunk: int = 1024,
                 pre_scale: float = 1.0, softcap: bool = False, post_scale: float = 1.0,
                 dtype: str = "float32", with_grad: bool = True) -> Tensor:
    """The loss of ``hidden`` ``(..., h)`` projected by ``weight`` ``(V, h)`` (+ ``bias``) against
    ``labels`` (``hidden``'s leading shape), as ``F.cross_entropy`` with ``reduction`` "sum" or
    "mean" returns it, in ``dtype`` (a torch dtype's name).  ``with_grad=False``: no gradient
    will be asked for (an inference graph), so none is computed."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction={reduction!r}: the chunked loss sums or averages")
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_labels = labels.reshape(-1)
    out_dtype = getattr(torch, dtype)
    loss = torch.ops.loong.lm_head_loss(flat_hidden, weight, bias, flat_labels, ignore_index,
                                        chunk, pre_scale, softcap, post_scale,
                                        compute_dtype(out_dtype), with_grad)[0]
    if reduction == "mean":  # over the labels that count, as cross_entropy averages
        loss = loss / (flat_labels != ignore_index).sum()
    return loss.to(out_dtype)


@torch.library.custom_op("loong::lm_head_loss", mutates_args=())
def lm_head_loss_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                    ignore_index: int, chunk: int, pre_scale: float, softcap: bool,
                    post_scale: float, compute: torch.dtype,
                    with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(summed loss, dL/dhidden, dL/dweight, dL/dbias)`` of ``hidden`` ``(N, h)``, the loss
    computed in ``compute``; the gradients are of the summed loss (empty without
    ``with_grad``; dL/dbias empty without a bias)."""
    total = torch.zeros((), dtype=compute, device=hidden.device)
    grads = Gradients([hidden], [0], [weight, bias], compute) if with_grad else None
    for start, length in tiles(hidden.size(0), chunk):
        rows = slice(start, start + length)
        total += _chunk(hidden[rows], weight, bias, labels[rows], ignore_index, pre_scale,
                        softcap, post_scale, compute, grads, start)
    if grads is None:
        return total, *(hidden.new_empty(_NOTHING) for _ in range(3))
    (d_hidden,), (d_weight, d_bias) = grads.result(cast=False)
    return total, d_hidden, d_weight, d_bias if d_bias is not None else hidden.new_empty(_NOTHING)


@lm_head_loss_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, chunk, pre_scale, softcap, post_scale, compute,
      with_grad):
    total = hidden.new_empty((), dtype=compute)
    if not with_grad:
        return total, *(hidden.new_empty(_NOTHING) for _ in range(3))
    accumulate = torch.promote_types(compute, weight.dtype)
    bias_grad = (bias.new_empty(bias.shape, dtype=accumulate) if bias is not None
                 else hidden.new_empty(_NOTHING))
    return (total, hidden.new_empty(hidden.shape),
            weight.new_empty(weight.shape, dtype=accumulate), bias_grad)


def _add_gradients(grads: Gradients, d_logits: Tensor, hidden: Tensor, weight: Tensor,
                   start: int) -> None:
    """Add one chunk's dL/dlogits ``(C, V)`` (compute dtype): into dL/dhidden's rows of the chunk
    (written in place), dL/dweight and dL/dbias (accumulated without a weight-sized temporary)."""
    rows = grads.rows(0, start, d_logits.size(0))
    narrow = d_logits.to(weight.dtype)   # a new buffer only for a narrower weight
    if rows.dtype == weight.dtype:
        torch.mm(narrow, weight, out=rows)
    else:
        rows.copy_(narrow @ weight)
    del narrow
    d_weight, d_bias = grads.params
    d_weight.addmm_(d_logits.t().to(d_weight.dtype), hidden.to(d_weight.dtype))
    if d_bias is not None:
        d_bias += d_logits.sum(0)


def _chunk(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ignore_index: int,
           pre_scale: float, softcap: bool, post_scale: float, compute: torch.dtype,
           grads: Gradients | None, start: int) -> Tensor:
    """One chunk's summed loss; its gradient into ``grads``.  Works in place on the chunk's
    logits: one ``(C, V)`` buffer in the compute dtype (two with softcapping)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).to(compute)
    if pre_scale != 1.0:
        logits.mul_(pre_scale)
    capped = None
    if softcap:
        capped = logits.tanh_()
        logits = capped * post_scale
    elif post_scale != 1.0:
        logits.mul_(post_scale)
    valid = labels != ignore_index
    index = torch.where(valid, labels, 0).unsqueeze(1)
    target = logits.gather(1, index).squeeze(1)
    peak = logits.amax(1, keepdim=True)
    exp = logits.sub_(peak).exp_()                       # the logits' buffer from here on
    sums = exp.sum(1, keepdim=True)
    lse = (sums.log() + peak).squeeze(1)
    loss = torch.where(valid, lse - target, 0).sum()
    if grads is not None:
        share = valid.unsqueeze(1) / sums                # ignored tokens: no gradient
        d_logits = exp.mul_(share)                       # softmax ...
        d_logits.scatter_add_(1, index, -valid.unsqueeze(1).to(compute))   # ... minus one-hot
        if capped is not None:                           # d(post * tanh(pre * z)) / dz
            d_logits.mul_(capped.square_().neg_().add_(1).mul_(pre_scale * post_scale))
        elif pre_scale * post_scale != 1.0:
            d_logits.mul_(pre_scale * post_scale)
        _add_gradients(grads, d_logits, hidden, weight, start)
    return loss


def _setup_context(ctx, inputs, output) -> None:
    _, d_hidden, d_weight, d_bias = output
    ctx.has_bias = inputs[2] is not None
    ctx.dtypes = [None if t is None else t.dtype for t in inputs[:3]]
    ctx.save_for_backward(d_hidden, d_weight, d_bias)
    ctx.mark_non_differentiable(d_hidden, d_weight, d_bias)


def _backward(ctx, grad_loss, *_unused):
    d_hidden, d_weight, d_bias = ctx.saved_tensors
    hidden, weight, bias = ctx.dtypes
    return (scaled(d_hidden, grad_loss, hidden), scaled(d_weight, grad_loss, weight),
            scaled(d_bias, grad_loss, bias) if ctx.has_bias else None, *[None] * 8)


lm_head_loss_op.register_autograd(_backward, setup_context=_setup_context)
