"""The token layout of 2D-Attention: which global tokens each rank holds.

This module is the single source of truth for it; the attention ops, the
tests and ``gather_sequence`` all read it from here.

The sequence of ``S`` tokens is cut into ``2·cp`` chunks of ``S/(2·cp)``.
CP rank ``c`` holds chunks ``c`` and ``2·cp-1-c`` (zigzag: with a causal mask
every CP rank then does the same work).  That CP shard of ``S/cp`` tokens is
cut into ``hp`` contiguous pieces of ``S/sp``, one per HP rank, so the
head-parallel all-to-all (which concatenates the HP group's pieces in HP-rank
order) hands each rank exactly its CP shard.  With ``cp = 1`` there is no
zigzag and the sequence is simply cut into ``hp`` pieces.

::

    S = 16, cp = 2, hp = 2 (chunks of 4 tokens: A B C D)
    tokens    0-3 4-7 8-11 12-15
    chunk      A   B   C    D
    CP rank 0: A + D   -> hp 0: A (0-3)   hp 1: D (12-15)
    CP rank 1: B + C   -> hp 0: B (4-7)   hp 1: C (8-11)
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from loong_compile.errors import LoongShapeError
from loong_compile.parallel.balance import balanced_order, restore, take
from loong_compile.parallel.rules import sequence_divisor, sequence_violation  # noqa: F401 (re-exported)

IGNORE_INDEX = -100

# What shard_batch made, for the checks of what a compiled graph receives (loong_compile/checks):
# the facts a tensor's values do not show, told by the tensor itself (or a view of it), never by
# reading its values.  Each fact is what makes some call silently wrong:
# - PACKED: input ids of rows holding documents that start inside them (document_ids= or
#   cu_seqlens=): their documents live in the position ids only;
# - PADDED: input ids of rows with padding (attention_mask with zeros);
# - SHIFTED: labels shifted by one token over the whole sequence, which labels= must not get
#   (transformers shifts labels= itself).
PACKED, PADDED, SHIFTED = "packed documents", "padding", "shifted labels"
# id -> (weak reference, facts) of every tensor with a fact that is still alive
_MADE: dict[int, tuple[weakref.ref, frozenset[str]]] = {}


def check_sequence_length(seq_len: int, cp: int, hp: int) -> None:
    """Raise ``LoongShapeError`` unless the layout can split ``seq_len`` tokens
    (``parallel.rules.sequence_divisor``)."""
    violation = sequence_violation(seq_len, cp, hp)
    if violation:
        raise LoongShapeError(*violation)


def local_token_indices(seq_len: int, cp: int, hp: int, cp_rank: int, hp_rank: int) -> torch.Tensor:
    """Global positions (int64, in local order) of the tokens held at ``(cp_rank, hp_rank)``."""
    check_sequence_length(seq_len, cp, hp)
    shard = torch.cat([torch.arange(start, start + length)
                       for start, length in shard_chunks(seq_len, cp, cp_rank)])
    piece = seq_len // (cp * hp)
    return shard[hp_rank * piece:(hp_rank + 1) * piece]


def shard_chunks(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """The CP shard of ``cp_rank`` as ``(first global position, length)`` pieces in local order:
    chunks ``cp_rank`` and ``2·cp-1-cp_rank`` (the whole sequence when ``cp = 1``)."""
    if cp == 1:
        return [(0, seq_len)]
    chunk = seq_len // (2 * cp)
    return [(cp_rank * chunk, chunk), ((2 * cp - 1 - cp_rank) * chunk, chunk)]


def token_runs(seq_len: int, cp: int, hp: int, cp_rank: int, hp_rank: int,
               merged: bool = True) -> list[tuple[int, int]]:
    """``local_token_indices`` as ``(first global position, length)`` runs of consecutive
    positions, in local order: what a token mixer with a state (a scan, a causal convolution)
    needs to know of where its tokens sit in the sequence.  ``merged=False`` keeps the middle
    CP rank's two adjacent chunks apart, so that every rank holds runs of the same lengths."""
    check_sequence_length(seq_len, cp, hp)
    piece = seq_len // (cp * hp)
    skip, runs = hp_rank * piece, []
    for start, length in shard_chunks(seq_len, cp, cp_rank):
        take_from = min(skip, length)
        skip -= take_from
        length_here = min(length - take_from, piece - sum(n for _, n in runs))
        if length_here > 0 and merged and runs and sum(runs[-1]) == start + take_from:  # the middle CP rank
            runs[-1] = (runs[-1][0], runs[-1][1] + length_here)
        elif length_here > 0:
            runs.append((start + take_from, length_here))
    return runs


def mesh_token_indices(seq_len: int, mesh, rank: int | None = None) -> torch.Tensor:
    """``local_token_indices`` for ``rank`` of ``mesh`` (default: this rank)."""
    _, cp_rank, hp_rank = mesh.coords(rank)
    return local_token_indices(seq_len, mesh.cp, mesh.hp, cp_rank, hp_rank)


def layout_positions(local_len: int, mesh, rank: int | None = None) -> torch.Tensor:
    """The global positions ``rank`` of ``mesh`` holds when it holds ``local_len`` tokens:
    what its ``position_ids`` must be (``loong_compile.checks.inputs`` compares them)."""
    return mesh_token_indices(local_len * mesh.sp, mesh, rank)


class ShardedBatch(NamedTuple):
    """This rank's tokens: ``(B, S/sp)`` input ids, position ids, shifted labels and, when one
    was given, the key-padding ``attention_mask``; ``num_labels``: how many of the whole
    batch's shifted labels are not ``-100`` (a 0-dim int64 tensor, the same on every rank of
    the sequence: what a rank's summed loss is divided by, ``loong_compile.next_token_loss``).
    ``token_order``: with ``balance_documents``, the ``(B, S)`` original index of each token of
    the reordered rows (-1: a pad), which ``gather_sequence`` takes to undo the order."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    attention_mask: torch.Tensor | None = None
    num_labels: torch.Tensor | None = None
    token_order: torch.Tensor | None = None


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None, mesh, *,
                document_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, balance_documents: bool = False,
                pad_token_id: int = 0) -> ShardedBatch:
    """Select this rank's tokens of a full ``(B, S)`` batch (identical on all ranks of an SP group).

    ``labels`` (e.g. a copy of ``input_ids``) are shifted on the full sequence
    before sharding: local label ``t`` is the full label at position ``p+1``
    where ``p`` is the token's global position, and ``-100`` at ``p = S-1``.
    A model must therefore not shift them again; the per-token losses summed
    over the SP group equal the one-process loss.  For ``dp > 1`` pass each
    data-parallel replica its own batch.  Every output is a new contiguous tensor, so all
    ranks pass Dynamo inputs of one layout (and compile one graph).

    Packed documents, given by one of
    ``document_ids``: ``(B, S)`` integers, a document being a run of equal ids; or
    ``cu_seqlens``: 1-D cumulative document lengths ``[0, l1, l1+l2, ..., end]``
    (flash-attn's varlen convention) with ``end = S`` (the same documents in every
    row) or ``end = B·S`` (the rows flattened, each row end a boundary);
    make the position ids restart at 0 per document (transformers' packed
    convention, from which ``sequence_document_ids`` recovers the documents).
    Labels are shifted as without documents: put ``-100`` where documents meet
    (as ``DataCollatorWithFlattening`` does) to not predict across them.
    ``attention_mask``: ``(B, S)``, nonzero = real token, sharded like the input ids.

    ``balance_documents`` (with documents and ``cp > 1``): deal every document head/tail over
    the CP ranks (``parallel/balance.py``), padding each to a multiple of ``2·cp`` tokens of
    ``pad_token_id`` in the room the right padding of ``attention_mask`` leaves; no
    attention mask is returned (every token then belongs to a document), and the model must
    be causal with its documents read from the position ids (the backend refuses other masks).
    """
    if input_ids.dim() != 2:
        raise LoongShapeError(f"input_ids of shape {tuple(input_ids.shape)}",
                              "input_ids is a (batch, sequence) tensor", "pass a 2-D tensor")
    _check_same_shape("labels", labels, input_ids, "pass unshifted labels of the full sequence "
                      "(shard_batch shifts them)")
    _check_same_shape("attention_mask", attention_mask, input_ids,
                      "pass the tokenizer's (batch, sequence) attention_mask")
    index = mesh_token_indices(input_ids.size(1), mesh).to(input_ids.device)
    starts = document_starts(input_ids, document_ids, cu_seqlens)
    if balance_documents and starts is not None and mesh.cp > 1:
        sharded = _balanced(input_ids, labels, starts, attention_mask, index, mesh.cp,
                            pad_token_id)
    else:
        sharded = _in_layout(input_ids, labels, starts, attention_mask, index)
    packed = starts is not None and bool(starts[:, 1:].any())
    padded = sharded.attention_mask is not None and not bool(attention_mask.bool().all())
    _remember(sharded.input_ids, *([PACKED] if packed else []), *([PADDED] if padded else []))
    _remember(sharded.labels, SHIFTED)
    return sharded


def _in_layout(input_ids: torch.Tensor, labels: torch.Tensor | None, starts: torch.Tensor | None,
               attention_mask: torch.Tensor | None, index: torch.Tensor) -> ShardedBatch:
    batch = input_ids.size(0)
    if starts is None:
        # a new tensor, never a view of ``index`` (at an offset that differs by rank: Dynamo
        # would then specialise on it, and the ranks would compile different graphs)
        position_ids = index.repeat(batch, 1)
    else:
        position_ids = packed_positions(starts)[:, index]
    shifted = num_labels = None
    if labels is not None:
        full = _shifted(labels)
        shifted, num_labels = full[:, index], (full != IGNORE_INDEX).sum()
    mask = None if attention_mask is None else attention_mask[:, index]
    return ShardedBatch(input_ids[:, index], position_ids, shifted, mask, num_labels)


def _remember(tensor: torch.Tensor | None, *facts: str) -> None:
    if tensor is None or not facts:
        return
    key = id(tensor)

    def forget(ref: weakref.ref) -> None:
        if _MADE.get(key, (None,))[0] is ref:   # not a newer tensor at the same id
            del _MADE[key]

    _MADE[key] = (weakref.ref(tensor, forget), frozenset(facts))


def made_with(tensor: torch.Tensor, fact: str) -> bool:
    """Whether ``tensor`` is, or is a view of, a tensor ``shard_batch`` made with ``fact``
    (``PACKED``, ``PADDED``, ``SHIFTED``).  A copy is not followed (``.clone()``, ``.to()``
    another device): telling it would mean reading its values."""
    for candidate in (tensor, getattr(tensor, "_base", None)):
        entry = _MADE.get(id(candidate)) if candidate is not None else None
        if entry is not None and entry[0]() is candidate and fact in entry[1]:
            return True
    return False


def alive_with(fact: str) -> bool:
    """Whether some tensor ``shard_batch`` made with ``fact`` is still alive in this process."""
    return any(fact in facts and ref() is not None for ref, facts in list(_MADE.values()))


def _balanced(input_ids: torch.Tensor, labels: torch.Tensor | None, starts: torch.Tensor,
              attention_mask: torch.Tensor | None, index: torch.Tensor, cp: int,
              pad_token_id: int) -> ShardedBatch:
    order = balanced_order(starts, attention_mask, cp)
    positions = order.positions.to(input_ids.device)
    shifted = num_labels = None
    if labels is not None:  # the room's tokens are dropped, and their labels with them
        full = take(_shifted(labels), order, IGNORE_INDEX)
        shifted, num_labels = full[:, index], (full != IGNORE_INDEX).sum()
    return ShardedBatch(take(input_ids, order, pad_token_id)[:, index], positions[:, index],
                        shifted, None, num_labels, order.source.to(input_ids.device))


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Label ``t`` is the token at ``t+1``; ``-100`` at the last."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), IGNORE_INDEX)], dim=1)


def _check_same_shape(name: str, tensor: torch.Tensor | None, input_ids: torch.Tensor,
                      fix: str) -> None:
    if tensor is not None and tensor.shape != input_ids.shape:
        raise LoongShapeError(f"{name} of shape {tuple(tensor.shape)} for input_ids of shape "
                              f"{tuple(input_ids.shape)}",
                              f"{name} and input_ids have the same shape", fix)


def document_starts(input_ids: torch.Tensor, document_ids: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """``(B, S)`` bool, True where a document starts; None without documents."""
    if document_ids is not None and cu_seqlens is not None:
        raise LoongShapeError("both document_ids and cu_seqlens", "documents are given one way",
                              "pass document_ids or cu_seqlens, not both")
    batch, seq_len = input_ids.shape
    if document_ids is not None:
        _check_same_shape("document_ids", document_ids, input_ids,
                          "pass (batch, sequence) document ids of the full sequence")
        if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
            raise LoongShapeError(f"document_ids of dtype {document_ids.dtype}",
                                  "document ids are integers", "pass an integer tensor")
        starts = torch.ones(batch, seq_len, dtype=torch.bool, device=input_ids.device)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        return starts
    if cu_seqlens is None:
        return None
    bounds = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    rows_flat = bounds is not None and bounds[-1:] == [batch * seq_len]
    if (bounds is None or cu_seqlens.dtype.is_floating_point or bounds[:1] != [0]
            or bounds[-1] not in (seq_len, batch * seq_len)
            or any(a >= b for a, b in zip(bounds, bounds[1:]))
            or (rows_flat and not {r * seq_len for r in range(batch + 1)} <= set(bounds))):
        raise LoongShapeError(f"cu_seqlens={bounds if bounds is not None else tuple(cu_seqlens.shape)}",
                              f"cu_seqlens is 1-D, integer, strictly increasing from 0 to S = "
                              f"{seq_len} (every row) or to B*S = {batch * seq_len} (rows "
                              "flattened, with every row end k*S among the boundaries)",
                              "pass torch.tensor([0, len1, len1+len2, ...]) as flash-attn's "
                              "varlen functions take it")
    starts = torch.zeros(batch * seq_len if rows_flat else seq_len, dtype=torch.bool)
    starts[bounds[:-1]] = True
    return starts.view(-1, seq_len).expand(batch, seq_len).to(input_ids.device)


def packed_positions(starts: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 at every document start, ``(B, S)`` int64."""
    seq_len = starts.size(1)
    pos = torch.arange(seq_len, device=starts.device).expand_as(starts)
    last_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(1).values
    return pos - last_start


def gather_sequence(x: torch.Tensor, mesh, dim: int = 1,
                    token_order: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``shard_batch`` along ``dim``: the full sequence, on every rank of the SP group.

    ``token_order``: the batch's ``ShardedBatch.token_order`` (``balance_documents``; ``dim``
    is then 1, after the batch): the result is in the original order, 0 where the original
    row was padding.  Eager only (no autograd): for inspecting outputs and tests.
    """
    if token_order is not None:
        return restore(gather_sequence(x, mesh, dim), token_order.to(x.device))
    if mesh.sp == 1:
        return x
    from loong_compile._compat.distributed import resolve_process_group

    group = resolve_process_group(mesh.group_names["sp"])
    dim = dim % x.dim()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(mesh.sp)]
    dist.all_gather(parts, x, group=group)
    seq_len = x.size(dim) * mesh.sp
    index = torch.cat([mesh_token_indices(seq_len, mesh, r)
                       for r in dist.get_process_group_ranks(group)]).to(x.device)
    full = torch.empty(*x.shape[:dim], seq_len, *x.shape[dim + 1:], dtype=x.dtype, device=x.device)
    return full.index_copy_(dim, index, torch.cat(parts, dim=dim))
