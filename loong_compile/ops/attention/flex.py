"""Masked blocks on ``flex_attention``: one ``BlockMask`` per block and step, and the kernel.

On CUDA a block of masked 2D-Attention that holds some but not all allowed pairs runs torch's
``flex_attention`` with a ``BlockMask`` of that block (``mask_mod`` over the block's global
positions, the document ids, causality and the window): its 128 x 128 tiles that hold no
allowed pair are skipped, and no dense mask of the block's scores is built.  The step's
``StepMask`` (ops/masks/step.py) makes each block's mask once and every layer reads it,
forward and backward.  Elsewhere (CPU, float64) a block runs with a dense boolean mask of at
most one tile by one tile.

``flex_attention`` returns a block's ``(out_b, lse_b)``; the ring-style merge of the blocks
needs the backward *given the merged* ``out`` and ``lse``, which flex does not offer.  So the
backward runs the block's forward again under autograd and hands it the upstream gradients
of the merged output, the chain rule through the merge: with ``w = exp(lse_b - lse)`` the
block's share of each row, ``dout·w`` for ``out_b`` and ``w·(rowsum(dout·out_b) -
rowsum(dout·out))`` for ``lse_b``.

On CPU, flex has a forward but no backward in the torch versions we support: the tests run
this forward there with eager flex against the dense path, and the backward's contract with a
differentiable stand-in for flex; gpu-check runs both on a GPU.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from loong_compile._compat.kernels import (autograd_in_op_body, create_block_mask_fused,
                                           steady_dispatch)
from loong_compile.ops.masks.blocks import allowed

FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLEX_HEAD_DIM_MULTIPLE = 16   # flex's kernels take head dims of at least 16


def uses_flex(like: Tensor) -> bool:
    """Whether masked blocks of tensors like ``like`` run on flex (CUDA, half or single)."""
    return like.device.type == "cuda" and like.dtype in FLEX_DTYPES


def block_mask(q_positions: Tensor, k_positions: Tensor, document_ids: Tensor | None,
               is_causal: bool, window: int | None,
               mask_positions: Tensor | None = None) -> BlockMask:
    """The ``BlockMask`` of the block whose query rows hold global positions ``q_positions`` and
    whose key columns hold ``k_positions`` (device tensors; ``document_ids`` ``(B, S)`` or None
    for one document; ``mask_positions`` ``(B, S)``: the rule's positions of balanced
    documents, ops/masks/blocks.py, None where they are the global ones)."""

    def mask_mod(b, h, q_index, k_index):
        q_pos, k_pos = q_positions[q_index], k_positions[k_index]
        if document_ids is None:
            return allowed(q_pos, k_pos, None, None, is_causal, window)
        q_doc, k_doc = document_ids[b, q_pos], document_ids[b, k_pos]
        if mask_positions is not None:
            q_pos, k_pos = mask_positions[b, q_pos], mask_positions[b, k_pos]
        return allowed(q_pos, k_pos, q_doc, k_doc, is_causal, window)

    batch = None if document_ids is None else document_ids.size(0)
    return create_block_mask_fused(mask_mod, batch, q_positions.numel(), k_positions.numel(),
                                   q_positions.device)


@functools.cache
def _compiled_flex():
    # eager flex_attention materialises the scores; the compiled one is the fused kernel.
    # Blocks differ in shape: after the first new shape, Dynamo compiles one dynamic kernel
    return torch.compile(flex_attention)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scale: float):
    run = _compiled_flex() if q.device.type == "cuda" else flex_attention
    with steady_dispatch():   # the compiled kernel's guards see one state at every step
        return run(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.size(1) != k.size(1),
                   return_lse=True)


def flex_forward(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask,
                 scale: float) -> tuple[Tensor, Tensor]:
    """``(out_b, lse_b)`` of one block; a row with no allowed key gives 0 and ``-inf``."""
    out, lse = _flex(q, k, v, mask, scale)
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))


def flex_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  mask: BlockMask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block, given the merged ``out`` and ``lse`` of its rows."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with autograd_in_op_body():
        out_b, lse_b = _flex(*leaves, mask, scale)
    acc = lse.dtype
    share = torch.where(torch.isinf(lse_b), 0.0, torch.exp(lse_b.to(acc) - lse))
    dout_acc = dout.to(acc)
    grad_lse = share * ((dout_acc * out_b.to(acc)).sum(-1) - (dout_acc * out.to(acc)).sum(-1))
    grad_out = (share.unsqueeze(-1) * dout_acc).to(out_b.dtype)
    with autograd_in_op_body():
        return torch.autograd.grad((out_b, lse_b), leaves, (grad_out, grad_lse.to(lse_b.dtype)))
