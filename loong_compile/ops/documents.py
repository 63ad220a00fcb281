"""The global document ids of a packed/padded batch, from each rank's position ids.

``sequence_document_ids`` gathers the ``(B, S/sp)`` position ids (and the
key-padding mask) of the SP group with one small all-gather of integers, puts
them in global token order with the layout of ``loong_compile.parallel.tokens`` and
numbers the documents: a new one starts wherever ``position[t] !=
position[t-1] + 1`` (transformers' ``find_packed_sequence_indices`` rule);
padded tokens get ``-1``.  The result, identical on every rank, is what
``attention_2d(..., document_ids=)`` takes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from loong_compile.parallel.tokens import local_token_indices
from loong_compile.errors import LoongShapeError
from loong_compile.ops.comm import group


def sequence_document_ids(position_ids: Tensor, key_padding: Tensor | None = None, *, hp: int,
                          cp: int, sp_group: str = "", hp_group: str = "",
                          cp_group: str = "") -> Tensor:
    """Global ``(B, S)`` int64 document ids from this rank's ``(B, S/sp)`` position ids.

    ``key_padding``: this rank's ``(B, S/sp)`` tokenizer attention mask (nonzero =
    real token).  The group names are the mesh's (``**mesh.document_kwargs()``):
    ``sp_group`` to gather on, ``hp_group`` and ``cp_group`` (any group spanning
    the CP group in CP-rank order, e.g. ``dkv_outer``) to find this rank's place.
    """
    if position_ids.dim() != 2 or position_ids.dtype.is_floating_point:
        raise LoongShapeError(f"position_ids of shape {tuple(position_ids.shape)} and dtype "
                              f"{position_ids.dtype}", "position ids are integers (B, S/sp)",
                              "pass this rank's position ids as shard_batch returns them")
    if key_padding is not None and tuple(key_padding.shape) != tuple(position_ids.shape):
        raise LoongShapeError(f"key_padding of shape {tuple(key_padding.shape)} for position "
                              f"ids of shape {tuple(position_ids.shape)}",
                              "the key-padding mask has the position ids' shape",
                              "pass this rank's attention_mask as shard_batch returns it")
    return document_ids_op(position_ids, key_padding, hp, cp, sp_group, hp_group, cp_group)


@torch.library.custom_op("loong::sequence_document_ids", mutates_args=())
def document_ids_op(position_ids: Tensor, key_padding: Optional[Tensor], hp: int, cp: int,
                    sp_group: str, hp_group: str, cp_group: str) -> Tensor:
    batch, local = position_ids.shape
    seq = local * hp * cp
    cp_rank = group(cp_group).rank() if cp > 1 else 0
    hp_rank = group(hp_group).rank() if hp > 1 else 0
    real = torch.ones_like(position_ids) if key_padding is None else (key_padding != 0)
    index = local_token_indices(seq, cp, hp, cp_rank, hp_rank).to(position_ids.device)
    payload = torch.cat([position_ids.to(torch.int64), real.to(torch.int64), index.unsqueeze(0)])
    if hp * cp > 1:
        parts = [torch.empty_like(payload) for _ in range(hp * cp)]
        dist.all_gather(parts, payload, group=group(sp_group))
        payload = torch.cat(parts, dim=1)
    full = torch.empty(2 * batch, seq, dtype=torch.int64, device=position_ids.device)
    full[:, payload[-1]] = payload[:-1]
    positions, real = full[:batch], full[batch:] != 0
    starts = torch.ones_like(real)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return (starts.cumsum(1) - 1).masked_fill(~real, -1)


@document_ids_op.register_fake
def _(position_ids, key_padding, hp, cp, *group_names):
    return position_ids.new_empty((position_ids.size(0), position_ids.size(1) * hp * cp),
                                  dtype=torch.int64)
