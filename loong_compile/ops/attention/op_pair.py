"""The fake kernels and autograd that every 2D-Attention op pair shares (ring, masked).

An attention op pair is a forward ``fwd(q, k, v, *tensors, *config, sinks=None) -> (out, lse)``
and a backward ``bwd(dout, q, k, v, out, lse, *tensors, *config) -> (dq, dk, dv)``: ``tensors``
are the forward's other tensor inputs (document ids, the step's mask handle), which the
backward needs but which get no gradient; ``config`` are constants; ``sinks`` (last, optional)
the rows' sink logits, whose gradient comes from the forward's outputs (ops/attention/sinks.py).  Outputs have one
layout whatever the inputs' strides: fake and real must agree, or a view that AOTAutograd planned
on the fake strides fails at run time.  ``out`` is ``(B, H, S, D_v)`` stored token-major (as
``(B, S, H, D_v)``): a model's ``out.transpose(1, 2).contiguous()`` before its output projection
is then a view, not a copy that the projection saves beside ``out`` for the backward.
"""

from __future__ import annotations

from torch import Tensor

from loong_compile.ops.attention.kernels import accumulation_dtype
from loong_compile.ops.attention.sinks import sinks_gradient


def attention_outputs_like(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Empty ``(out, lse)`` for queries ``q`` and values ``v`` (the fake kernels' outputs): out
    has V's head dim and is token-major, lse is contiguous."""
    batch, heads, tokens, _ = q.shape
    return (q.new_empty((batch, tokens, heads, v.size(-1))).transpose(1, 2),
            q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype)))


def register_attention_op_pair(forward, backward, tensors: int = 0) -> None:
    """Fake kernels of both ops and the forward's autograd through the backward op;
    ``tensors``: how many inputs after q, k, v are tensors."""

    @forward.register_fake
    def _(q, k, v, *args):
        return attention_outputs_like(q, v)

    @backward.register_fake
    def _(dout, q, k, v, out, lse, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v = inputs[:3]
        *ctx.config, sinks = inputs[3 + tensors:]   # the forward's last input: the sinks
        out, lse = output
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks, *inputs[3:3 + tensors])
        ctx.mark_non_differentiable(lse)

    def backward_of(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, sinks, *others = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # out and lse count the sink: the backward's probabilities are the sink-including ones
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, *others, *ctx.config)
        dsinks = sinks_gradient(grad_out, out, lse, sinks) if ctx.has_sinks else None
        return dq, dk, dv, *([None] * (tensors + len(ctx.config))), dsinks

    forward.register_autograd(backward_of, setup_context=setup_context)
