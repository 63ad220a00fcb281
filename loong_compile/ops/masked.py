"""Masked attention over one CP group (packed documents, padding, sliding windows), fwd and bwd.

Inputs are in CP layout like ops/ring.py: ``(B, H', S/cp, D)``, this CP rank's
zigzag shard (V with its own head dim, K and V in one ``kv_buffer``).
``document_ids`` is ``(B, S)`` in global order, the same on every rank.  Every
rank evaluates the same ``mask_plan`` (ops/mask_plan.py) without communicating,
then, instead of the Double-Ring, a direct exchange on the ``dkv_outer`` group
(which spans the CP group in CP-rank order):

* forward: each rank posts, at once, the sends of the key/value columns every
  other rank needs from it and the receives of the columns it needs, computes
  its own blocks while they travel, then the received owners' blocks.  A block
  with no allowed pair is neither computed nor sent; the inner ring size ``w``
  plays no part (there is no ring).
* backward: the same KV exchange again, then each rank sends the dK/dV of the
  columns it received (accumulation dtype) straight back to their owner, which
  adds them to its own.

Each block runs the kernel adapter with the exact boolean mask of (its query
rows × its key columns); a row that sees no key anywhere returns ``out = 0``
with ``lse = -inf`` and zero gradients.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import torch
from torch import Tensor

from loong_compile._compat.kernels import cudagraph_unsafe_tags
from loong_compile.parallel.tokens import local_token_indices
from loong_compile.ops.comm import DirectExchange, group
from loong_compile.ops.kernels import accumulation_dtype, attention_backward, attention_forward
from loong_compile.ops.mask_plan import Block, MaskPlan, buffer_columns, mask_plan
from loong_compile.ops.ring import (attention_outputs_like, kv_buffer, kv_gradients, kv_parts,
                                    merge_partial)

KV_TAG, DKV_TAG = 1, 2


class MaskedGroup:
    """This rank's CP rank, the plan of its CP group and the global positions of every shard."""

    def __init__(self, document_ids: Tensor, is_causal: bool, window: int | None, cp: int,
                 group_name: str):
        self.cp, self.group_name = cp, group_name
        self.rank = group(group_name).rank() if cp > 1 else 0
        self.document_ids = document_ids.to(torch.int64)
        self.is_causal, self.window = is_causal, window
        self.plan: MaskPlan = _plan_of(self.document_ids, is_causal, window, cp)
        self.mine = self.plan.ranks[self.rank]
        seq = document_ids.size(1)
        self.positions = [local_token_indices(seq, cp, 1, r, 0).to(document_ids.device)
                          for r in range(cp)]

    def exchange_kv(self, kv: Tensor) -> DirectExchange:
        """Post the sends of our columns to every peer that needs them and our receives."""
        sends = {peer: _columns(kv, ranges).contiguous()
                 for peer, ranges in self.plan.serves(self.rank).items()}
        receives = {owner: kv.new_empty(_received_shape(kv, ranges))
                    for owner, ranges in self.mine.needs.items()}
        return DirectExchange(self.group_name, sends, receives, KV_TAG)

    def block_inputs(self, block: Block, kv: Tensor, received: dict[int, Tensor]):
        """The block's key/value columns (from our shard or a received buffer) and its mask."""
        if block.owner == self.rank:
            cols = slice(*block.cols)
            source = kv
        else:
            cols = buffer_columns(self.mine.needs[block.owner], block.cols)
            source = received[block.owner]
        return source[:, :, cols], cols, self.block_mask(block)

    def block_mask(self, block: Block) -> Tensor | None:
        """``(B, 1, rows, cols)`` allowed pairs, or None when every pair is allowed."""
        q_pos = self.positions[self.rank][slice(*block.rows)]
        k_pos = self.positions[block.owner][slice(*block.cols)]
        q_doc = self.document_ids[:, q_pos].unsqueeze(-1)
        k_doc = self.document_ids[:, k_pos].unsqueeze(-2)
        mask = (q_doc == k_doc) & (q_doc >= 0)
        offset = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
        if self.is_causal:
            mask &= offset >= 0
        if self.window is not None:
            mask &= offset < self.window
        return None if bool(mask.all()) else mask.unsqueeze(1)


# Every layer of a step (forward and backward) sees the same document ids: the plan is built
# once per (ids, causal, window), not once per call.  Keyed by the ids' contents, never by their
# storage, which a later step may reuse for other ids.
_PLANS: OrderedDict[tuple, MaskPlan] = OrderedDict()
_PLANS_KEPT = 8


def _plan_of(document_ids: Tensor, is_causal: bool, window: int | None, cp: int) -> MaskPlan:
    ids = document_ids.detach().cpu().contiguous()
    key = (hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest(), tuple(ids.shape),
           is_causal, window, cp)
    if key not in _PLANS:
        _PLANS[key] = mask_plan(ids, is_causal, window, cp)
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    return _PLANS[key]


def _columns(kv: Tensor, ranges) -> Tensor:
    return torch.cat([kv[:, :, start:stop] for start, stop in ranges], dim=2)


def _received_shape(kv: Tensor, ranges) -> tuple[int, ...]:
    return (*kv.shape[:2], sum(stop - start for start, stop in ranges), *kv.shape[3:])


def masked_forward(q: Tensor, k: Tensor, v: Tensor, masked: MaskedGroup,
                   scale: float) -> tuple[Tensor, Tensor]:
    acc = accumulation_dtype(q.dtype)
    kv = kv_buffer(k, v)
    exchange = masked.exchange_kv(kv) if masked.cp > 1 else None
    out = torch.zeros((*q.shape[:3], v.size(-1)), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
    received: dict[int, Tensor] = {}
    for block in masked.mine.blocks:
        if block.owner != masked.rank and not received:
            received = exchange.wait()
        block_kv, _, mask = masked.block_inputs(block, kv, received)
        rows = slice(*block.rows)
        block_out, block_lse = attention_forward(q[:, :, rows], *kv_parts(block_kv, k.size(-1)),
                                                 is_causal=False, scale=scale, mask=mask)
        out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows],
                                                         block_out, block_lse)
    if exchange is not None:
        exchange.wait()  # our sends complete before their buffers may be freed
    return out.to(q.dtype).contiguous(), lse.contiguous()


def masked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    masked: MaskedGroup, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    acc = accumulation_dtype(q.dtype)
    kv = kv_buffer(k, v)
    exchange = masked.exchange_kv(kv) if masked.cp > 1 else None
    dq = torch.zeros_like(q, dtype=acc)
    dkv = torch.zeros_like(kv, dtype=acc)
    received: dict[int, Tensor] = {}
    dkv_received: dict[int, Tensor] = {}
    for block in masked.mine.blocks:
        if block.owner != masked.rank and not received:
            received = exchange.wait()
            dkv_received = {owner: torch.zeros_like(buffer, dtype=acc)
                            for owner, buffer in received.items()}
        block_kv, cols, mask = masked.block_inputs(block, kv, received)
        rows = slice(*block.rows)
        dq_block, dk_block, dv_block = attention_backward(
            dout[:, :, rows], q[:, :, rows], *kv_parts(block_kv, k.size(-1)), out[:, :, rows],
            lse[:, :, rows], is_causal=False, scale=scale, mask=mask)
        dq[:, :, rows] += dq_block
        target = dkv if block.owner == masked.rank else dkv_received[block.owner]
        dk, dv = kv_parts(target[:, :, cols], k.size(-1))
        dk += dk_block
        dv += dv_block
    if exchange is not None:
        exchange.wait()
        serves = masked.plan.serves(masked.rank)
        returned = DirectExchange(
            masked.group_name, dkv_received,
            {peer: dkv.new_empty(_received_shape(dkv, ranges)) for peer, ranges in serves.items()},
            DKV_TAG).wait()
        for peer, grads in returned.items():
            offset = 0
            for start, stop in serves[peer]:
                dkv[:, :, start:stop] += grads[:, :, offset:offset + stop - start]
                offset += stop - start
    return dq.to(q.dtype).contiguous(), *kv_gradients(dkv, k, v)


# --- custom ops ----------------------------------------------------------------

@torch.library.custom_op("loong::masked_attention_fwd", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def masked_attention_fwd(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, is_causal: bool,
                         window: int, scale: float, cp: int,
                         dkv_outer_group: str) -> tuple[Tensor, Tensor]:
    """Masked attention forward over the CP group: ``(out, lse)`` (``window <= 0``: none)."""
    masked = MaskedGroup(document_ids, is_causal, window if window > 0 else None, cp,
                         dkv_outer_group)
    return masked_forward(q, k, v, masked, scale)


@masked_attention_fwd.register_fake
def _(q, k, v, document_ids, *args):
    return attention_outputs_like(q, v)


@torch.library.custom_op("loong::masked_attention_bwd", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def masked_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         document_ids: Tensor, is_causal: bool, window: int, scale: float,
                         cp: int, dkv_outer_group: str) -> tuple[Tensor, Tensor, Tensor]:
    """Masked attention backward: ``(dq, dk, dv)``, dK/dV returned straight to their owners."""
    masked = MaskedGroup(document_ids, is_causal, window if window > 0 else None, cp,
                         dkv_outer_group)
    return masked_backward(dout, q, k, v, out, lse, masked, scale)


@masked_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, document_ids, *ctx.config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, document_ids)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, document_ids = ctx.saved_tensors
    dq, dk, dv = masked_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, document_ids,
                                      *ctx.config)
    return dq, dk, dv, None, *([None] * len(ctx.config))


masked_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
