"""Double-Ring attention over one CP group (LoongTrain §4.3, Algorithm 2), forward and backward.

Inputs are in CP layout: ``(B, H', S/cp, D)``, the rows of this CP rank's
zigzag shard (chunks ``r`` and ``2·cp-1-r``, see loong_compile/parallel/tokens.py);
V may have its own head dim (MLA), and the output has V's.  K and V travel as
one buffer, concatenated along the head dim (``kv_buffer``).

The CP group of ``cp`` ranks is cut into ``n = cp / w`` inner rings of ``w``;
CP rank ``r = i·w + j`` is position ``j`` of inner ring ``i``.  Forward, at
outer step ``o`` every rank first sends the KV block it starts with to the
next outer ring (``(i+1, j)``, overlapping the whole inner round), then runs
``w`` micro-steps, each computing one block while the next KV block arrives
from the inner ring.  So at outer step ``o``, micro-step ``s`` rank
``(i, j)`` holds the KV of CP rank ``(i-o, j-s)``; every rank sends ``cp-1``
KV blocks in all.

Backward re-runs the same KV schedule and sends, every micro-step, the dK/dV
accumulated so far for the block it holds to the rank that holds that block
next: ``(i, j+1)`` inside the inner ring, and ``(i+1, j+1)`` after the last
micro-step, which is the first holder at the next outer step or, after the
last, the block's owner.  That is ``cp`` dK/dV blocks sent per rank.

Causal masks with the zigzag layout (``c`` = half a shard): the own block is
causal; a block of a lower CP rank is seen completely by all rows but only
its first half (its second chunk lies after both of ours); a block of a
higher CP rank is seen completely but only by our second half.  Every rank
thus computes the same amount, and no row is ever fully masked.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from loong_compile._compat.kernels import cudagraph_unsafe_tags
from loong_compile.ops.attention.op_pair import register_attention_op_pair
from loong_compile.parallel.rules import ring_position
from loong_compile.ops.comm import Exchange, group
from loong_compile.ops.attention.kernels import (
    accumulation_dtype, attention_backward, attention_forward, token_major,
)
from loong_compile.ops.attention.sinks import with_sinks

ALL = slice(None)


def merge_partial(out: Tensor, lse: Tensor, block_out: Tensor,
                  block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets.

    ``lse = max + log1p(exp(min - max))`` never forms ``log(1 + exp(d))`` of a
    large ``d``; rows where both sides are empty (``-inf``) stay ``-inf`` with
    a zero output instead of NaN.  Works in the dtype of ``out``/``lse``.
    """
    block_lse = block_lse.to(lse.dtype)
    high, low = torch.maximum(lse, block_lse), torch.minimum(lse, block_lse)
    high_finite = torch.where(torch.isinf(high), torch.zeros_like(high), high)
    new_lse = high + torch.log1p(torch.exp(low - high_finite))
    new_finite = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    weight_old = torch.exp(lse - new_finite).unsqueeze(-1)
    weight_new = torch.exp(block_lse - new_finite).unsqueeze(-1)
    return out * weight_old + block_out.to(out.dtype) * weight_new, new_lse


def kv_buffer(k: Tensor, v: Tensor) -> Tensor:
    """K and V as one ``(B, H, S, D_k + D_v)`` buffer: one send per hop whatever their head
    dims (MLA's V is narrower than its Q/K).  Its rows are the sequence, as in k and v."""
    return torch.cat([k, v], dim=-1)


def kv_parts(kv: Tensor, k_head_dim: int) -> tuple[Tensor, Tensor]:
    """The K and V views of a ``kv_buffer`` (or of its gradient, to accumulate into)."""
    return kv[..., :k_head_dim], kv[..., k_head_dim:]


def kv_gradients(dkv: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """dK and dV out of their ``kv_buffer``-shaped accumulator, in k's and v's dtypes; contiguous
    like the fake kernels, and copied out: views of one buffer may not be returned."""
    return tuple(part.to(t.dtype, memory_format=torch.contiguous_format, copy=True)
                 for part, t in zip(kv_parts(dkv, k.size(-1)), (k, v)))


def ring_schedule(cp_rank: int, cp: int, inner_ring: int) -> list[tuple[int, int, int]]:
    """``(outer step, micro-step, CP rank whose KV block is held)`` in schedule order."""
    w, n_outer = inner_ring, cp // inner_ring
    i, j = ring_position(cp_rank, w)
    return [(o, s, ((i - o) % n_outer) * w + (j - s) % w) for o in range(n_outer) for s in range(w)]


class DoubleRing:
    """This rank's place in the Double-Ring and its four ring groups (names from LoongMesh)."""

    def __init__(self, cp: int, inner_ring: int, kv_inner: str, kv_outer: str, dkv_inner: str,
                 dkv_outer: str):
        self.cp, self.w, self.n_outer = cp, inner_ring, cp // inner_ring
        self.kv_inner, self.kv_outer = kv_inner, kv_outer
        self.dkv_inner, self.dkv_outer = dkv_inner, dkv_outer
        # dkv_outer spans the CP group in CP-rank order, so its rank is the CP rank
        self.rank = group(dkv_outer).rank() if cp > 1 else 0
        self.i, self.j = ring_position(self.rank, self.w)

    def send_kv(self, kv: Tensor, *, outer: bool) -> Exchange:
        size, pos = (self.n_outer, self.i) if outer else (self.w, self.j)
        name = self.kv_outer if outer else self.kv_inner
        return Exchange(kv, name, (pos + 1) % size, (pos - 1) % size)

    def send_dkv(self, dkv: Tensor, *, last_micro_step: bool) -> Exchange:
        if not last_micro_step:
            return Exchange(dkv, self.dkv_inner, (self.j + 1) % self.w, (self.j - 1) % self.w)
        n, w = self.n_outer, self.w
        next_rank = ((self.i + 1) % n) * w + (self.j + 1) % w
        prev_rank = ((self.i - 1) % n) * w + (self.j - 1) % w
        return Exchange(dkv, self.dkv_outer, next_rank, prev_rank)

    def kv_schedule(self, kv: Tensor):
        """Yield ``(o, s, owner, kv block)`` while prefetching the next block (Algorithm 2)."""
        outer = inner = None
        for o, s, owner in ring_schedule(self.rank, self.cp, self.w):
            if s == 0 and o < self.n_outer - 1:
                outer = self.send_kv(kv, outer=True)
            if s < self.w - 1:
                inner = self.send_kv(kv, outer=False)
            yield o, s, owner, kv
            if s < self.w - 1:
                kv = inner.wait()
            elif o < self.n_outer - 1:
                kv = outer.wait()


def block_plan(is_causal: bool, rank: int, owner: int, half: int) -> tuple[slice, slice, bool]:
    """Query rows, key columns and causality of the block (rank's queries, owner's keys)."""
    if not is_causal:
        return ALL, ALL, False
    if owner == rank:
        return ALL, ALL, True
    if owner < rank:
        return ALL, slice(0, half), False
    return slice(half, None), ALL, False


def ring_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                 ring: DoubleRing) -> tuple[Tensor, Tensor]:
    acc = accumulation_dtype(q.dtype)
    half = q.size(2) // 2
    out = lse = None
    for _, _, owner, kv in ring.kv_schedule(kv_buffer(k, v)):
        rows, cols, causal = block_plan(is_causal, ring.rank, owner, half)
        block_k, block_v = kv_parts(kv[:, :, cols], k.size(-1))
        block_out, block_lse = attention_forward(q[:, :, rows], block_k, block_v,
                                                 is_causal=causal, scale=scale)
        if out is None:  # the first block is the own one: every row
            out, lse = block_out.to(acc), block_lse.to(acc)
        else:
            out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows],
                                                             block_out, block_lse)
    return token_major(out.to(q.dtype)), lse.contiguous()


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  is_causal: bool, scale: float, ring: DoubleRing) -> tuple[Tensor, Tensor, Tensor]:
    if ring.cp == 1:   # one block, the own: the kernel's gradients are the answer
        grads = attention_backward(dout, q, k, v, out, lse, is_causal=is_causal, scale=scale)
        return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))
    acc = accumulation_dtype(q.dtype)
    half = q.size(2) // 2
    dq = None
    incoming = None  # dK/dV of the held block, accumulated by its earlier holders
    for _, s, owner, kv in ring.kv_schedule(kv_buffer(k, v)):
        rows, cols, causal = block_plan(is_causal, ring.rank, owner, half)
        # The held block's dK/dV is waited for before this block's kernel, which frees the one
        # this rank sent: two dK/dV blocks never live beside the kernel's gradients (issue 52:
        # the peak of a layer's backward; the hop's transfer no longer hides behind the kernel)
        dkv = None if incoming is None else incoming.wait()
        dq_block, dk_block, dv_block = attention_backward(
            dout[:, :, rows], q[:, :, rows], *kv_parts(kv[:, :, cols], k.size(-1)),
            out[:, :, rows], lse[:, :, rows], is_causal=causal, scale=scale)
        # The first block is the own one (every row and column): its gradients start the
        # accumulators instead of zeros, and each block's are dropped before the next block's
        # kernel, so that one block's gradients are live at a time.
        if dq is None:
            dq = dq_block.to(acc)
        else:
            dq[:, :, rows] += dq_block
        if dkv is None:
            dkv = kv_buffer(dk_block.to(acc), dv_block.to(acc))
        else:
            dk, dv = kv_parts(dkv[:, :, cols], k.size(-1))
            dk += dk_block
            dv += dv_block
        del dq_block, dk_block, dv_block
        if ring.cp > 1:
            incoming = ring.send_dkv(dkv, last_micro_step=s == ring.w - 1)
    if incoming is not None:  # the own block's gradient, back from its last holder
        dkv = incoming.wait()
    return dq.to(q.dtype).contiguous(), *kv_gradients(dkv, k, v)


# --- custom ops ----------------------------------------------------------------

@torch.library.custom_op("loong::ring_attention_fwd", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def ring_attention_fwd(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, cp: int,
                       inner_ring: int, kv_inner_group: str, kv_outer_group: str,
                       dkv_inner_group: str, dkv_outer_group: str,
                       sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Double-Ring attention forward: ``(out, lse)`` of this rank's query rows (CP layout);
    ``sinks`` (``lse``'s shape): each row's sink logit joins its softmax (ops/attention/sinks.py)."""
    ring = DoubleRing(cp, inner_ring, kv_inner_group, kv_outer_group, dkv_inner_group,
                      dkv_outer_group)
    return with_sinks(*ring_forward(q, k, v, is_causal, scale, ring), sinks)


@torch.library.custom_op("loong::ring_attention_bwd", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def ring_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       is_causal: bool, scale: float, cp: int, inner_ring: int,
                       kv_inner_group: str, kv_outer_group: str, dkv_inner_group: str,
                       dkv_outer_group: str) -> tuple[Tensor, Tensor, Tensor]:
    """Double-Ring attention backward: ``(dq, dk, dv)``, dK/dV returned to their owners."""
    ring = DoubleRing(cp, inner_ring, kv_inner_group, kv_outer_group, dkv_inner_group,
                      dkv_outer_group)
    return ring_backward(dout, q, k, v, out, lse, is_causal, scale, ring)


register_attention_op_pair(ring_attention_fwd, ring_attention_bwd)
