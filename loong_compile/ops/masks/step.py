"""The mask of one step of masked 2D-Attention: made once, read by every masked call.

``masked_attention_plan`` (the custom op ``loong::masked_attention_plan``) evaluates
``mask_plan`` on the host, from one host copy of the document ids (the step's one read of
device data; none for a window alone), and returns a *handle*: a one-element host tensor
standing for the ``StepMask``.  Every masked attention call of the step, forward and
backward, is handed the handle and finds the mask by it; none reads device data.  The
backend's attention pass emits one plan node per graph and kind of mask, beside the
document ids; a direct caller of ``attention_2d`` makes one per step and passes it as
``mask_plan=``.

A handle is a real tensor that the graph passes from op to op and saves for the backward like
any other, so its mask lives exactly as long as some call may still need it (the table is
keyed weakly by the handle).  A handle this table does not know (a runtime that copied it)
makes the mask again from the ids: exact, one device read more, and counted in
``rebuilt_step_masks`` for the tests.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from loong_compile.ops.comm import group
from loong_compile.ops.attention.flex import BlockMask, uses_flex
from loong_compile.ops.attention.flex import block_mask as flex_block_mask
from loong_compile.errors import LoongShapeError
from loong_compile.ops.masks.blocks import (UNREADABLE, Block, MaskPlan, allowed,
                                         host_document_ids, mask_plan, mask_positions)
from loong_compile.parallel.tokens import local_token_indices


class StepMask:
    """The plan of a CP group for one step and what a rank needs to apply it: its CP rank, the
    global positions of every rank's shard and the device ids the block masks are made from."""

    def __init__(self, document_ids: Tensor | None, seq_len: int, is_causal: bool,
                 window: int | None, cp: int, group_name: str):
        self.cp, self.group_name = cp, group_name
        self.rank = group(group_name).rank() if cp > 1 else 0
        self.document_ids = None if document_ids is None else document_ids.to(torch.int64)
        self.is_causal, self.window = is_causal, window
        host_ids = None if document_ids is None else host_document_ids(document_ids)
        if host_ids is not None and (host_ids == UNREADABLE).any():
            rows = sorted({int(r) for r in np.flatnonzero((host_ids == UNREADABLE).any(1))})
            raise LoongShapeError(
                f"position ids of batch rows {rows} that are neither packed documents nor "
                "documents in the balanced order", "each position counts from its document's "
                "start, with the documents contiguous (transformers' packed convention) or in "
                "shard_batch(..., balance_documents=True)'s order",
                "cut the batch with loong_compile.shard_batch and pass its position_ids")
        self.plan: MaskPlan = mask_plan(host_ids, is_causal, window, cp, seq_len=seq_len)
        # the rule's positions where they are not the global ones (balanced documents)
        found = None if host_ids is None else mask_positions(host_ids)
        self.mask_positions = None if found is None else \
            torch.from_numpy(found).to(document_ids.device)
        self.mine = self.plan.ranks[self.rank]
        # one rank and every row one document (no padding, no window): the blocks tile plain
        # attention over the whole row, which masked_forward computes in one kernel call
        self.whole = (cp == 1 and window is None and self.mask_positions is None
                      and host_ids is not None and bool((host_ids >= 0).all())
                      and bool((host_ids == host_ids[:, :1]).all()))
        self._positions = [local_token_indices(seq_len, cp, 1, r, 0) for r in range(cp)]
        self._on_device: dict[torch.device, list[Tensor]] = {}
        self._flex_masks: dict[Block, BlockMask] = {}

    def positions(self, rank: int, device: torch.device) -> Tensor:
        """Global positions of ``rank``'s shard, on ``device`` (copied there once)."""
        if device not in self._on_device:
            self._on_device[device] = [p.to(device) for p in self._positions]
        return self._on_device[device][rank]

    def block_mask(self, block: Block, like: Tensor) -> Tensor | BlockMask | None:
        """None for a full block; for tensors ``like`` on flex (ops/attention/flex.py) the block's
        ``BlockMask``, made once; else its ``(B or 1, 1, rows, cols)`` allowed pairs."""
        if block.full:
            return None
        q_pos = self.positions(self.rank, like.device)[slice(*block.rows)]
        k_pos = self.positions(block.owner, like.device)[slice(*block.cols)]
        if uses_flex(like):
            if block not in self._flex_masks:
                self._flex_masks[block] = flex_block_mask(q_pos, k_pos, self.document_ids,
                                                          self.is_causal, self.window,
                                                          self.mask_positions)
            return self._flex_masks[block]
        q_doc = k_doc = None
        if self.document_ids is not None:
            q_doc = self.document_ids[:, q_pos].unsqueeze(-1)
            k_doc = self.document_ids[:, k_pos].unsqueeze(-2)
        if self.mask_positions is not None:
            q_pos, k_pos = self.mask_positions[:, q_pos], self.mask_positions[:, k_pos]
        mask = allowed(q_pos.unsqueeze(-1), k_pos.unsqueeze(-2), q_doc, k_doc, self.is_causal,
                       self.window)
        if mask.dim() == 2:  # one document: the same for every batch row
            mask = mask.unsqueeze(0)
        return mask.unsqueeze(1)


_STEP_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_REBUILT = [0]


def rebuilt_step_masks() -> int:
    """How many masked calls so far got a handle this table did not know."""
    return _REBUILT[0]


@torch.library.custom_op("loong::masked_attention_plan", mutates_args=())
def masked_attention_plan(document_ids: Optional[Tensor], seq_len: int, is_causal: bool,
                          window: int, cp: int, dkv_outer_group: str) -> Tensor:
    """The handle of this step's mask (``window <= 0``: none; ``document_ids`` None: one
    document of ``seq_len`` tokens)."""
    handle = torch.zeros(1, dtype=torch.int64)
    _STEP_MASKS[handle] = StepMask(document_ids, seq_len, is_causal,
                                   window if window > 0 else None, cp, dkv_outer_group)
    return handle


@masked_attention_plan.register_fake
def _(document_ids, *args):
    return torch.empty(1, dtype=torch.int64, device="cpu")


def step_mask_of(handle: Tensor, document_ids: Tensor | None, seq_len: int, is_causal: bool,
              window: int, cp: int, group_name: str) -> StepMask:
    """The mask ``handle`` stands for (made again from the ids if the handle is unknown)."""
    found = _STEP_MASKS.get(handle)
    if found is None:
        _REBUILT[0] += 1
        found = StepMask(document_ids, seq_len, is_causal, window if window > 0 else None, cp,
                         group_name)
        _STEP_MASKS[handle] = found
    return found
