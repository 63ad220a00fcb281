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

from typing import NamedTuple

import torch
import torch.distributed as dist

from loong_compile.errors import LoongShapeError

IGNORE_INDEX = -100


def sequence_divisor(cp: int, hp: int) -> int:
    """What the full sequence length must divide by: ``2·cp·hp`` (``hp`` when ``cp = 1``)."""
    return 2 * cp * hp if cp > 1 else hp


def check_sequence_length(seq_len: int, cp: int, hp: int) -> None:
    """Raise ``LoongShapeError`` unless the layout can split ``seq_len`` tokens."""
    divisor = sequence_divisor(cp, hp)
    if seq_len % divisor:
        rule = (f"the sequence length must be a multiple of 2*cp*hp = {divisor} (zigzag over "
                f"2*cp chunks, each CP shard split over hp ranks)" if cp > 1 else
                f"the sequence length must be a multiple of hp = {divisor}")
        raise LoongShapeError(f"sequence length {seq_len} with cp={cp}, hp={hp}", rule,
                              f"pad or trim the sequence to a multiple of {divisor}, e.g. "
                              f"{-(-seq_len // divisor) * divisor}")


def local_token_indices(seq_len: int, cp: int, hp: int, cp_rank: int, hp_rank: int) -> torch.Tensor:
    """Global positions (int64, in local order) of the tokens held at ``(cp_rank, hp_rank)``."""
    check_sequence_length(seq_len, cp, hp)
    if cp > 1:
        chunk = seq_len // (2 * cp)
        first, second = cp_rank, 2 * cp - 1 - cp_rank
        shard = torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                           torch.arange(second * chunk, (second + 1) * chunk)])
    else:
        shard = torch.arange(seq_len)
    piece = seq_len // (cp * hp)
    return shard[hp_rank * piece:(hp_rank + 1) * piece]


def mesh_token_indices(seq_len: int, mesh, rank: int | None = None) -> torch.Tensor:
    """``local_token_indices`` for ``rank`` of ``mesh`` (default: this rank)."""
    _, cp_rank, hp_rank = mesh.coords(rank)
    return local_token_indices(seq_len, mesh.cp, mesh.hp, cp_rank, hp_rank)


def layout_positions(local_len: int, mesh, rank: int | None = None) -> torch.Tensor:
    """The global positions ``rank`` of ``mesh`` holds when it holds ``local_len`` tokens:
    what its ``position_ids`` must be (``loong_compile.input_checks`` compares them)."""
    return mesh_token_indices(local_len * mesh.sp, mesh, rank)


class ShardedBatch(NamedTuple):
    """This rank's tokens: ``(B, S/sp)`` input ids, global position ids and shifted labels."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None, mesh) -> ShardedBatch:
    """Select this rank's tokens of a full ``(B, S)`` batch (identical on all ranks of an SP group).

    ``labels`` (e.g. a copy of ``input_ids``) are shifted on the full sequence
    before sharding: local label ``t`` is the full label at position ``p+1``
    where ``p`` is the token's global position, and ``-100`` at ``p = S-1``.
    A model must therefore not shift them again; the per-token losses summed
    over the SP group equal the one-process loss.  For ``dp > 1`` pass each
    data-parallel replica its own batch.  Every output is a new contiguous tensor, so all
    ranks pass Dynamo inputs of one layout (and compile one graph).
    """
    if input_ids.dim() != 2:
        raise LoongShapeError(f"input_ids of shape {tuple(input_ids.shape)}",
                              "input_ids is a (batch, sequence) tensor", "pass a 2-D tensor")
    if labels is not None and labels.shape != input_ids.shape:
        raise LoongShapeError(f"labels of shape {tuple(labels.shape)} for input_ids of shape "
                              f"{tuple(input_ids.shape)}",
                              "labels and input_ids have the same shape",
                              "pass unshifted labels of the full sequence "
                              "(shard_batch shifts them)")
    batch, seq_len = input_ids.shape
    index = mesh_token_indices(seq_len, mesh).to(input_ids.device)
    # a new tensor, never a view of ``index`` (at an offset that differs by rank: Dynamo
    # would then specialise on it, and the ranks would compile different graphs)
    position_ids = index.repeat(batch, 1)
    shifted = None
    if labels is not None:
        pad = labels.new_full((batch, 1), IGNORE_INDEX)
        shifted = torch.cat([labels[:, 1:], pad], dim=1)[:, index]
    return ShardedBatch(input_ids[:, index], position_ids, shifted)


def gather_sequence(x: torch.Tensor, mesh, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_batch`` along ``dim``: the full sequence, on every rank of the SP group.

    Eager only (no autograd): for inspecting outputs and tests.
    """
    if mesh.sp == 1:
        return x
    from loong_compile._compat import resolve_process_group

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
