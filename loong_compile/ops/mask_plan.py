"""The plan of masked 2D-Attention: which blocks of a CP group hold allowed (query, key) pairs.

Pure host work (numpy, on one host copy of the ids): no collectives, no process groups, no
device reads beyond that copy.  Every CP rank evaluates the same plan
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
over the batch); a block whose every pair is allowed in every batch row is *full* and runs
without a mask.  A CP rank receives from each other rank only the key columns
its blocks read (at most one range per chunk of that rank), so blocks with no
allowed pair are neither computed nor sent.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
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
    full: bool = False  # every (row, column) pair allowed in every batch row: no mask needed


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


def allowed(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None, k_doc: Tensor | None,
            is_causal: bool, window: int | None) -> Tensor:
    """The module's rule on broadcastable tensors: global positions and, with documents, the
    ids of the query and key tokens (the block masks of ops/step_mask.py and ops/flex.py)."""
    ok = (q_pos >= 0) & (k_pos >= 0) if q_doc is None else (q_doc == k_doc) & (q_doc >= 0)
    if is_causal:
        ok = ok & (k_pos <= q_pos)
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    return ok


def host_document_ids(document_ids: Tensor | np.ndarray | None,
                      seq_len: int | None = None) -> np.ndarray:
    """``(B, S)`` int64 ids on the host: one copy of a tensor (the step's one device read), or one
    document of ``seq_len`` tokens when there are no ids (a window alone)."""
    if document_ids is None:
        return np.zeros((1, seq_len), dtype=np.int64)
    if isinstance(document_ids, Tensor):
        return document_ids.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(document_ids, dtype=np.int64)


def key_intervals(document_ids: Tensor | np.ndarray, is_causal: bool,
                  window: int | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per token, ``(lo, hi)``: the inclusive global key interval it may see, ``(B, S)`` int64,
    and whether the intervals are exact (every document one contiguous run of tokens).

    Empty (``lo > hi``) for padding (negative ids).  Otherwise the interval from a document's
    first to its last token.
    """
    ids = host_document_ids(document_ids)
    batch, seq = ids.shape
    pos = np.tile(np.arange(seq), batch)
    # group the tokens by (row, id): a stable sort keeps each group's positions ascending
    key = np.repeat(np.arange(batch), seq) * (int(ids.max()) - int(ids.min()) + 1) + \
        (ids.ravel() - ids.min())
    order = np.argsort(key, kind="stable")
    starts = np.r_[True, key[order][1:] != key[order][:-1]]
    ends = np.r_[starts[1:], True]
    group = np.empty(key.size, dtype=np.int64)
    group[order] = np.cumsum(starts) - 1
    first, last = pos[order][starts], pos[order][ends]
    sizes = np.diff(np.r_[np.flatnonzero(starts), key.size])
    padding = ids.ravel()[order][starts] < 0
    exact = bool(np.all((last - first + 1 == sizes) | padding))
    lo, hi = first[group].reshape(batch, seq), last[group].reshape(batch, seq)
    token = np.arange(seq)
    if is_causal:
        hi = np.minimum(hi, token)
    if window is not None:
        lo = np.maximum(lo, token - window + 1)
    lo[ids < 0], hi[ids < 0] = seq, -1
    return lo, hi, exact


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


def mask_plan(document_ids: Tensor | np.ndarray | None, is_causal: bool, window: int | None,
              cp: int, tiles_per_chunk: int | None = None,
              seq_len: int | None = None) -> MaskPlan:
    """The plan of every CP rank for ``document_ids`` ``(B, S)`` (global token order; None: one
    document of ``seq_len`` tokens).  Host work on one host copy of the ids."""
    lo, hi, exact = key_intervals(host_document_ids(document_ids, seq_len), is_causal, window)
    seq = lo.shape[1]
    edges = np.array(tile_edges(seq, cp, tiles_per_chunk))
    starts, stops = edges[:-1], edges[1:]
    blocks: list[list[Block]] = [[] for _ in range(cp)]
    for q_start, q_stop in zip(starts.tolist(), stops.tolist()):
        row_lo, row_hi = lo[:, q_start:q_stop, None], hi[:, q_start:q_stop, None]
        # per batch row, query row and key tile: the key columns it sees there
        clipped_lo, clipped_hi = np.maximum(row_lo, starts), np.minimum(row_hi, stops - 1)
        ok = clipped_lo <= clipped_hi
        sees = ok.any(0)  # (rows, key tiles), the union over the batch
        for k in np.flatnonzero(sees.any(0)).tolist():
            seen = np.flatnonzero(sees[:, k])
            first_row, last_row = q_start + int(seen[0]), q_start + int(seen[-1])
            first_col = int(clipped_lo[..., k][ok[..., k]].min())
            last_col = int(clipped_hi[..., k][ok[..., k]].max())
            # every pair allowed, for every batch row: the kernel needs no mask
            full = exact and bool(
                (lo[:, first_row:last_row + 1] <= first_col).all()
                and (hi[:, first_row:last_row + 1] >= last_col).all())
            rank, row_start = _local(first_row, seq, cp)
            owner, col_start = _local(first_col, seq, cp)
            blocks[rank].append(Block(owner, (row_start, row_start + last_row - first_row + 1),
                                      (col_start, col_start + last_col - first_col + 1), full))
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
