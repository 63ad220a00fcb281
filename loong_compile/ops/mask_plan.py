"""The plan of masked 2D-Attention: which blocks of a CP group hold allowed (query, key) pairs.

Pure: no collectives, no process groups.  Every CP rank evaluates the same plan
from the global document ids, the window and the token layout of
``loong_compile.parallel.tokens``, so the ranks agree on who sends what to whom without
talking; the benchmark and the tests evaluate it the same way.

Query token ``i`` may see key ``j`` iff ``doc[i] == doc[j] >= 0``, ``j <= i``
when causal, and ``i - j < window`` when windowed.  For each query token the
keys it may see lie in one interval of global positions (``key_intervals``):
exactly when every document is one contiguous run of tokens (what
``sequence_document_ids`` produces), a superset otherwise (the kernel's mask
inside a block is always exact, so a superset costs work, never correctness).

The sequence is cut into the layout's ``2·cp`` chunks and each chunk into up
to ``TILES_PER_CHUNK`` tiles of at least ``MIN_TILE`` tokens (finer tiles crop
closer to a window's band or a short document, at one kernel call each).  A (query tile, key tile) pair is a *block*: it is
computed iff some query row of the tile sees some key of the other tile, and
then only on the rows and columns that hold allowed pairs (the crop, the union
over the batch).  A CP rank receives from each other rank only the key columns
its blocks read (at most one range per chunk of that rank), so blocks with no
allowed pair are neither computed nor sent.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loong_compile.parallel.tokens import shard_chunks

TILES_PER_CHUNK = 4
MIN_TILE = 8
Range = tuple[int, int]  # [start, stop)


class Block(NamedTuple):
    """One kernel call: this rank's local query rows × ``owner``'s local key columns."""

    owner: int
    rows: Range
    cols: Range


class RankPlan(NamedTuple):
    """What one CP rank computes (its own blocks first) and receives from each other rank."""

    blocks: tuple[Block, ...]
    needs: dict[int, tuple[Range, ...]]  # owner -> owner-local key column ranges, ascending


class MaskPlan(NamedTuple):
    ranks: tuple[RankPlan, ...]

    def serves(self, rank: int) -> dict[int, tuple[Range, ...]]:
        """Peer -> the column ranges of ``rank``'s shard that the peer receives."""
        return {peer: plan.needs[rank] for peer, plan in enumerate(self.ranks)
                if rank in plan.needs}


def key_intervals(document_ids: Tensor, is_causal: bool,
                  window: int | None) -> tuple[Tensor, Tensor]:
    """Per token, ``(lo, hi)``: the inclusive global key interval it may see, ``(B, S)`` int64.

    Empty (``lo > hi``) for padding (negative ids).  Exact for documents that are
    contiguous runs; otherwise the interval from a document's first to its last token.
    """
    ids = document_ids.detach().to("cpu", torch.int64)
    batch, seq = ids.shape
    pos = torch.arange(seq).expand(batch, seq)
    rows = torch.arange(batch).unsqueeze(1).expand(batch, seq)
    _, inverse = torch.unique(torch.stack([rows.flatten(), ids.flatten()]), dim=1,
                              return_inverse=True)
    groups = int(inverse.max()) + 1
    first = torch.full((groups,), seq).scatter_reduce(0, inverse, pos.flatten(), "amin")
    last = torch.full((groups,), -1).scatter_reduce(0, inverse, pos.flatten(), "amax")
    lo, hi = first[inverse].view(batch, seq), last[inverse].view(batch, seq)
    if is_causal:
        hi = torch.minimum(hi, pos)
    if window is not None:
        lo = torch.maximum(lo, pos - window + 1)
    padding = ids < 0
    return lo.masked_fill(padding, seq), hi.masked_fill(padding, -1)


def tile_edges(seq_len: int, cp: int, tiles_per_chunk: int | None = None) -> list[int]:
    """Global tile boundaries: each layout chunk cut into ``tiles_per_chunk`` near-equal tiles
    (default: ``TILES_PER_CHUNK``, fewer where tiles would be below ``MIN_TILE`` tokens)."""
    chunks = 2 * cp if cp > 1 else 1
    chunk = seq_len // chunks
    if tiles_per_chunk is None:
        tiles_per_chunk = max(1, min(TILES_PER_CHUNK, chunk // MIN_TILE))
    edges = {c * chunk + round(t * chunk / tiles_per_chunk)
             for c in range(chunks) for t in range(tiles_per_chunk + 1)}
    return sorted(edges)


def mask_plan(document_ids: Tensor, is_causal: bool, window: int | None, cp: int,
              tiles_per_chunk: int | None = None) -> MaskPlan:
    """The plan of every CP rank for ``document_ids`` ``(B, S)`` (global token order)."""
    lo, hi = key_intervals(document_ids, is_causal, window)
    seq = lo.size(1)
    edges = torch.tensor(tile_edges(seq, cp, tiles_per_chunk))
    starts, stops = edges[:-1], edges[1:]
    # per query token and key tile, the key columns it sees there (union over the batch)
    sees = torch.zeros(seq, starts.numel(), dtype=torch.bool)
    col_lo = torch.full(sees.shape, seq)
    col_hi = torch.full(sees.shape, -1)
    for row_lo, row_hi in zip(lo, hi):
        clipped_lo = torch.maximum(row_lo.unsqueeze(1), starts)
        clipped_hi = torch.minimum(row_hi.unsqueeze(1), stops - 1)
        ok = clipped_lo <= clipped_hi
        sees |= ok
        col_lo = torch.minimum(col_lo, clipped_lo.masked_fill(~ok, seq))
        col_hi = torch.maximum(col_hi, clipped_hi.masked_fill(~ok, -1))
    blocks: list[list[Block]] = [[] for _ in range(cp)]
    for q_start, q_stop in zip(edges[:-1].tolist(), edges[1:].tolist()):
        tile = sees[q_start:q_stop]
        index = torch.arange(q_start, q_stop).unsqueeze(1)
        first_row = index.expand_as(tile).masked_fill(~tile, seq).amin(0).tolist()
        last_row = index.expand_as(tile).masked_fill(~tile, -1).amax(0).tolist()
        first_col = col_lo[q_start:q_stop].amin(0).tolist()
        last_col = col_hi[q_start:q_stop].amax(0).tolist()
        for k, used in enumerate(tile.any(0).tolist()):
            if used:
                rank, row_start = _local(first_row[k], seq, cp)
                owner, col_start = _local(first_col[k], seq, cp)
                blocks[rank].append(Block(owner, (row_start, row_start + last_row[k] - first_row[k] + 1),
                                          (col_start, col_start + last_col[k] - first_col[k] + 1)))
    return MaskPlan(tuple(_rank_plan(rank, rank_blocks, seq, cp)
                          for rank, rank_blocks in enumerate(blocks)))


def _local(position: int, seq_len: int, cp: int) -> tuple[int, int]:
    """``(CP rank, local index)`` of a global position in the layout."""
    for rank in range(cp):
        offset = 0
        for start, length in shard_chunks(seq_len, cp, rank):
            if start <= position < start + length:
                return rank, offset + position - start
            offset += length
    raise ValueError(f"position {position} outside a sequence of {seq_len}")


def _rank_plan(rank: int, blocks: list[Block], seq_len: int, cp: int) -> RankPlan:
    # the own blocks first (computed while the others' columns travel), then by owner
    ordered = sorted(blocks, key=lambda b: ((b.owner - rank) % cp, b.rows, b.cols))
    chunk_len = shard_chunks(seq_len, cp, rank)[0][1]
    spans: dict[tuple[int, int], Range] = {}
    for block in ordered:
        if block.owner == rank:
            continue
        key = (block.owner, block.cols[0] // chunk_len)
        start, stop = spans.get(key, block.cols)
        spans[key] = (min(start, block.cols[0]), max(stop, block.cols[1]))
    needs: dict[int, tuple[Range, ...]] = {}
    for (owner, _), span in sorted(spans.items()):
        needs[owner] = needs.get(owner, ()) + (span,)
    return RankPlan(tuple(ordered), needs)


def buffer_columns(ranges: tuple[Range, ...], cols: Range) -> slice:
    """Where owner-local columns ``cols`` lie in the concatenation of the received ``ranges``."""
    offset = 0
    for start, stop in ranges:
        if start <= cols[0] and cols[1] <= stop:
            return slice(offset + cols[0] - start, offset + cols[1] - start)
        offset += stop - start
    raise ValueError(f"columns {cols} not inside the received ranges {ranges}")
