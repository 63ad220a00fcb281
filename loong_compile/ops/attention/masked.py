"""Masked attention over one CP group (packed documents, padding, sliding windows), fwd and bwd.

Inputs are in CP layout like ops/attention/ring.py: ``(B, H', S/cp, D)``, this CP rank's
zigzag shard (V with its own head dim, K and V in one ``kv_buffer``).
``document_ids`` is ``(B, S)`` in global order, the same on every rank (None: one
document).  Every rank evaluates the same ``mask_plan`` (ops/masks/blocks.py) without
communicating, once per step (ops/masks/step.py: each call is handed the step's handle), then,
instead of the Double-Ring, a direct exchange on the ``dkv_outer`` group
(which spans the CP group in CP-rank order):

* forward: in steps ``d = 1 .. cp-1`` each rank ``r`` sends rank ``r - d`` the
  key/value columns it reads of ``r`` and receives those it reads of ``r + d``
  (each pair of ranks meets at one step), each step posted one step ahead: it
  computes its own blocks while step 1 travels, then each step's blocks while
  the next travels, so at most two received KV buffers are alive, as in the
  ring.  A block with no allowed pair is neither computed nor sent; the inner
  ring size ``w`` plays no part (there is no ring).
* backward: the same KV steps again; after a step's blocks, the dK/dV of the
  columns it received (accumulation dtype) go straight back to their owner,
  which adds them to its own (at most two returns in flight).

Each block runs the kernel adapter with the exact boolean mask of (its query
rows × its key columns), or none when every pair of the block is allowed; a row that sees no key anywhere returns ``out = 0``
with ``lse = -inf`` and zero gradients.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from loong_compile._compat.kernels import cudagraph_unsafe_tags
from loong_compile.ops.attention.op_pair import register_attention_op_pair
from loong_compile.ops.comm import DirectExchange
from loong_compile.ops.attention.kernels import (
    accumulation_dtype, attention_backward, attention_forward, token_major,
)
from loong_compile.ops.masks.blocks import Block, buffer_columns
from loong_compile.ops.masks.step import StepMask, step_mask_of
from loong_compile.ops.attention.ring import kv_buffer, kv_gradients, kv_parts, merge_partial
from loong_compile.ops.attention.sinks import with_sinks

KV_TAG, DKV_TAG = 1, 2


def step_peers(masked: StepMask, step: int) -> tuple[int, int, tuple | None, tuple | None]:
    """Step ``d`` pairs rank ``r`` with ``peer = r - d``, which reads ``serves`` of our columns,
    and ``owner = r + d``, of whose columns we read ``needs`` (None: nothing); every pair of
    ranks meets at one step, in one direction."""
    peer, owner = (masked.rank - step) % masked.cp, (masked.rank + step) % masked.cp
    return peer, owner, masked.plan.ranks[peer].needs.get(masked.rank), masked.mine.needs.get(owner)


def post_step(masked: StepMask, step: int, kv: Tensor) -> DirectExchange | None:
    """Step ``d`` of the KV exchange: to the peer the columns it reads, from the owner ours."""
    peer, owner, serves, needs = step_peers(masked, step)
    sends = {} if serves is None else {peer: _columns(kv, serves).contiguous()}
    receives = {} if needs is None else {owner: kv.new_empty(_received_shape(kv, needs))}
    return DirectExchange(masked.group_name, sends, receives, KV_TAG) if sends or receives else None


def return_step(masked: StepMask, step: int, dkv_read: Tensor | None,
                like: Tensor) -> DirectExchange | None:
    """Step ``d`` of the dK/dV return: the gradients of the owner's columns we read go back to
    it; the peer returns those of ours it read."""
    peer, owner, serves, _ = step_peers(masked, step)
    sends = {} if dkv_read is None else {owner: dkv_read}
    receives = {} if serves is None else {peer: like.new_empty(_received_shape(like, serves))}
    return DirectExchange(masked.group_name, sends, receives, DKV_TAG) if sends or receives else None


class KVSteps:
    """The KV exchange of one call, step by step in the order of the plan's blocks (our own
    first), each step posted one step ahead: while step ``d``'s blocks are computed only step
    ``d + 1`` travels, so at most two received KV buffers are alive, as in the ring."""

    def __init__(self, masked: StepMask, kv: Tensor):
        self.masked, self.kv = masked, kv
        self.ahead = post_step(masked, 1, kv) if masked.cp > 1 else None
        self.blocks: dict[int, list[Block]] = {}
        for block in masked.mine.blocks:
            self.blocks.setdefault(block.owner, []).append(block)

    def owner(self, step: int) -> int:
        return (self.masked.rank + step) % self.masked.cp

    def source(self, step: int) -> Tensor | None:
        """The columns of ``owner(step)`` we read (call in step order, after dropping the last
        step's): our shard at step 0, else what step ``step`` received."""
        if step == 0:
            return self.kv
        current = self.ahead
        self.ahead = (post_step(self.masked, step + 1, self.kv)
                      if step + 1 < self.masked.cp else None)
        return None if current is None else current.wait().get(self.owner(step))


def block_columns(masked: StepMask, block: Block) -> slice:
    """Where the block's key/value columns lie in its owner's buffer (our shard, or what we
    received of the owner's)."""
    if block.owner == masked.rank:
        return slice(*block.cols)
    return buffer_columns(masked.mine.needs[block.owner], block.cols)


def _columns(kv: Tensor, ranges) -> Tensor:
    return torch.cat([kv[:, :, start:stop] for start, stop in ranges], dim=2)


def _received_shape(kv: Tensor, ranges) -> tuple[int, ...]:
    return (*kv.shape[:2], sum(stop - start for start, stop in ranges), *kv.shape[3:])


def masked_forward(q: Tensor, k: Tensor, v: Tensor, masked: StepMask,
                   scale: float) -> tuple[Tensor, Tensor]:
    if masked.whole:
        out, lse = attention_forward(q, k, v, is_causal=masked.is_causal, scale=scale)
        return token_major(out), lse.contiguous()
    acc = accumulation_dtype(q.dtype)
    kv = kv_buffer(k, v)
    out = torch.zeros((*q.shape[:3], v.size(-1)), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
    steps = KVSteps(masked, kv)
    for step in range(masked.cp):
        source = None  # the last step's buffer goes before the next one is posted
        source = steps.source(step)
        for block in steps.blocks.get(steps.owner(step), []):
            _forward_block(q, k.size(-1), source, block, masked, scale, out, lse)
    return token_major(out.to(q.dtype)), lse.contiguous()


def _forward_block(q: Tensor, head_dim: int, source: Tensor, block: Block, masked: StepMask,
                   scale: float, out: Tensor, lse: Tensor) -> None:
    """Merge one block into ``out``/``lse`` (a function: no view of ``source`` outlives it)."""
    rows = slice(*block.rows)
    block_out, block_lse = attention_forward(
        q[:, :, rows], *kv_parts(source[:, :, block_columns(masked, block)], head_dim),
        is_causal=False, scale=scale, mask=masked.block_mask(block, source))
    out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)


def masked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    masked: StepMask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    if masked.whole:
        return tuple(g.contiguous() for g in attention_backward(
            dout, q, k, v, out, lse, is_causal=masked.is_causal, scale=scale))
    acc = accumulation_dtype(q.dtype)
    kv = kv_buffer(k, v)
    dq = torch.zeros_like(q, dtype=acc)
    dkv = torch.zeros_like(kv, dtype=acc)
    returning: list[tuple[int, DirectExchange]] = []
    steps = KVSteps(masked, kv)
    for step in range(masked.cp):
        source = None  # the last step's buffer goes before the next one is posted
        source = steps.source(step)
        target = dkv if step == 0 else (None if source is None
                                        else torch.zeros_like(source, dtype=acc))
        for block in steps.blocks.get(steps.owner(step), []):
            rows, cols = slice(*block.rows), block_columns(masked, block)
            dq_block, dk_block, dv_block = attention_backward(
                dout[:, :, rows], q[:, :, rows], *kv_parts(source[:, :, cols], k.size(-1)),
                out[:, :, rows], lse[:, :, rows], is_causal=False, scale=scale,
                mask=masked.block_mask(block, kv))
            dq[:, :, rows] += dq_block
            dk, dv = kv_parts(target[:, :, cols], k.size(-1))
            dk += dk_block
            dv += dv_block
            del dq_block, dk_block, dv_block   # one block's gradients live at a time
        if step > 0:
            returned = return_step(masked, step, target, dkv)
            if returned is not None:
                returning.append((step, returned))
            while len(returning) > 1:  # at most two returns in flight
                _add_returned(masked, dkv, *returning.pop(0))
    for step, returned in returning:
        _add_returned(masked, dkv, step, returned)
    return dq.to(q.dtype).contiguous(), *kv_gradients(dkv, k, v)


def _add_returned(masked: StepMask, dkv: Tensor, step: int, returned: DirectExchange) -> None:
    """Add what rank ``r - step`` returns of the gradients of our columns it read."""
    peer, _, serves, _ = step_peers(masked, step)
    grads = returned.wait().get(peer)
    if grads is None:
        return
    offset = 0
    for start, stop in serves:
        dkv[:, :, start:stop] += grads[:, :, offset:offset + stop - start]
        offset += stop - start


# --- custom ops ----------------------------------------------------------------

@torch.library.custom_op("loong::masked_attention_fwd", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def masked_attention_fwd(q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor],
                         mask: Tensor, is_causal: bool, window: int, scale: float, cp: int,
                         dkv_outer_group: str, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Masked attention forward over the CP group: ``(out, lse)``.  ``mask``: the step's
    handle from ``masked_attention_plan`` of these ids, ``is_causal`` and ``window``;
    ``sinks`` as for the ring (ops/attention/sinks.py)."""
    masked = step_mask_of(mask, document_ids, q.size(2) * cp, is_causal, window, cp,
                          dkv_outer_group)
    return with_sinks(*masked_forward(q, k, v, masked, scale), sinks)


@torch.library.custom_op("loong::masked_attention_bwd", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def masked_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         document_ids: Optional[Tensor], mask: Tensor, is_causal: bool,
                         window: int, scale: float, cp: int,
                         dkv_outer_group: str) -> tuple[Tensor, Tensor, Tensor]:
    """Masked attention backward: ``(dq, dk, dv)``, dK/dV returned straight to their owners."""
    masked = step_mask_of(mask, document_ids, q.size(2) * cp, is_causal, window, cp,
                          dkv_outer_group)
    return masked_backward(dout, q, k, v, out, lse, masked, scale)


register_attention_op_pair(masked_attention_fwd, masked_attention_bwd, tensors=2)
