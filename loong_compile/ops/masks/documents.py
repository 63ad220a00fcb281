"""The global document ids of a packed/padded batch, from each rank's position ids.

``sequence_document_ids`` gathers the ``(B, S/sp)`` position ids (and the
key-padding mask) of the SP group with one small all-gather of integers, puts
them in global token order with the layout of ``loong_compile.parallel.tokens`` and
numbers the documents: a new one starts wherever ``position[t] !=
position[t-1] + 1`` (transformers' ``find_packed_sequence_indices`` rule), unless the row is in
the balanced order of ``shard_batch(..., balance_documents=True)`` (``number_documents``);
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
from loong_compile.ops.masks.blocks import CHUNK_MAJOR, UNREADABLE


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
    real = None if key_padding is None else full[batch:] != 0
    return number_documents(full[:batch], real, hp, cp)


def number_documents(positions: Tensor, real: Tensor | None, hp: int, cp: int) -> Tensor:
    """``(B, S)`` document ids from the positions of the whole sequence in global order.

    A row is read in the balanced order of ``shard_batch(..., balance_documents=True)`` when
    it fits it and holds two documents or more: the first layout chunk holds a share of every
    document, each starting at position 0, and chunk ``k`` holds positions ``k·c ... (k+1)·c-1``
    of a document of ``c`` tokens per chunk at the same offsets as the first.  Its ids are then
    numbered from ``CHUNK_MAJOR`` (ops/masks/blocks.py).  Any other row is read as contiguous
    documents, a new one wherever the position is not the previous one's plus one, and so is
    every row when key padding is given (``real``: True for a real token); padding gets -1.
    Without key padding, a row that fits neither reading (not shard_batch's positions) gets
    ``UNREADABLE`` throughout, which the step's mask refuses by name.
    """
    ids = _starts(positions).cumsum(1) - 1
    if cp > 1 and real is None:
        balanced, fits = _balanced_ids(positions, 2 * cp)
        # one document in the first chunk: both readings are one document, keep the plain one
        fits &= balanced.amax(1) > 0
        ids = torch.where(fits.unsqueeze(1), balanced + CHUNK_MAJOR, ids)
        # neither reading: the plan refuses the row (ops/masks/step.py), on the host, no sync here
        ids = ids.masked_fill((~fits & ~_packed(positions, hp, cp)).unsqueeze(1), UNREADABLE)
    return ids if real is None else ids.masked_fill(~real, -1)


def _packed(positions: Tensor, hp: int, cp: int) -> Tensor:
    """Per row, whether the positions are packed documents as ``checks/inputs.py`` accepts them
    on each rank: ``0 <= position <= global position``, and between tokens that are neighbours
    on one rank, one more than the previous or 0."""
    seq = positions.size(1)
    index = torch.arange(seq, device=positions.device)
    same_rank = ((index[1:] % (seq // (2 * cp)) != 0) & (index[1:] % (seq // (hp * cp)) != 0))
    steps = (positions[:, 1:] == positions[:, :-1] + 1) | (positions[:, 1:] == 0) | ~same_rank
    return ((positions >= 0) & (positions <= index)).all(1) & steps.all(1)


def _starts(positions: Tensor) -> Tensor:
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def _balanced_ids(positions: Tensor, chunks: int) -> tuple[Tensor, Tensor]:
    """The ids of each row read in the balanced order, and whether the row fits it."""
    batch, seq = positions.shape
    chunk = seq // chunks
    first = positions[:, :chunk]
    starts = _starts(first)
    ids = starts.cumsum(1) - 1
    offset = torch.arange(chunk, device=positions.device).expand(batch, chunk)
    run_start = torch.where(starts, offset, torch.zeros_like(offset)).cummax(1).values
    per_chunk = torch.zeros_like(first).scatter_add_(1, ids, torch.ones_like(first))
    length = per_chunk.gather(1, ids)
    k = torch.arange(chunks, device=positions.device).repeat_interleave(chunk)
    expected = k * length.repeat(1, chunks) + (offset - run_start).repeat(1, chunks)
    fits = (positions == expected).all(1) & ((first == 0) | ~starts).all(1)
    return ids.repeat(1, chunks), fits


def chunked_document_ids(document_ids: Tensor | None, *, chunk: int, batch: int, seq_len: int,
                         device: torch.device | str = "cpu") -> Tensor:
    """``(B, S)`` ids under which chunked attention is document attention: a query sees a key
    only in the same block of ``chunk`` tokens (Llama 4's ``attention_chunk_size``), counted
    from the sequence's start, or with ``document_ids`` (contiguous documents numbered by
    ``sequence_document_ids``) from its document's start, and only inside its document.  That is
    transformers' ``chunked_overlay`` over token indices, and over positions for packed
    documents, which the input check holds to restart at 0 at each document's start.  No
    communication: the same on every rank."""
    index = torch.arange(seq_len, device=device).expand(batch, -1)
    if document_ids is None:
        return (index // chunk).contiguous()
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    per_document = -(-seq_len // chunk)
    return torch.where(document_ids >= 0,
                       document_ids * per_document + (index - start) // chunk, document_ids)


@document_ids_op.register_fake
def _(position_ids, key_padding, hp, cp, *group_names):
    return position_ids.new_empty((position_ids.size(0), position_ids.size(1) * hp * cp),
                                  dtype=torch.int64)
