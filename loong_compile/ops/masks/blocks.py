"""The plan of masked 2D-Attention: which blocks of a CP group hold allowed (query, key) pairs.

Pure host work (numpy, on one host copy of the ids): no collectives, no process groups, no
device reads beyond that copy.  Every CP rank evaluates the same plan
from the global document ids, the window and the token layout of
``loong_compile.parallel.tokens``, so the ranks agree on who sends what to whom without
talking; the benchmark and the tests evaluate it the same way.

Query token ``i`` may see key ``j`` iff ``doc[i] == doc[j] >= 0``, ``m[j] <= m[i]``
when causal, and ``m[i] - m[j] < window`` when windowed, where ``m`` is the token's place in
its document's order (``mask_positions``): its global position, except in a document of the
balanced order (ids at or above ``CHUNK_MAJOR``, what ``sequence_document_ids`` makes of
``shard_batch(..., balance_documents=True)``'s positions), where each of the ``2·cp`` layout
chunks holds the same share of the document at the same offsets and ``m`` counts the
document's tokens before it in global order (its position in the document).  Within each
layout chunk the keys a query token may see lie in one interval of global positions
(``key_intervals``): exactly when every document is one run of tokens per chunk (what
``sequence_document_ids`` produces), a superset otherwise (the kernel's mask inside a block is
always exact, so a superset costs work, never correctness).

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
# document ids from here up are documents in the balanced (chunk-major) order: far above any
# count of documents, so no numbering of contiguous documents reaches it
CHUNK_MAJOR = 1 << 40
# the id of every token of a row whose positions fit neither order (ops/masks/documents.py)
UNREADABLE = -2
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
    edges: tuple[int, ...] = ()  # the global tile boundaries the blocks were cut by

    def serves(self, rank: int) -> dict[int, tuple[Range, ...]]:
        """Peer -> the column ranges of ``rank``'s shard that the peer receives."""
        return {peer: plan.needs[rank] for peer, plan in enumerate(self.ranks)
                if rank in plan.needs}


def allowed(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None, k_doc: Tensor | None,
            is_causal: bool, window: int | None) -> Tensor:
    """The module's rule on broadcastable tensors: the query and key tokens' ``mask_positions``
    and, with documents, their ids (the block masks of ops/masks/step.py and ops/attention/flex.py)."""
    ok = (q_pos >= 0) & (k_pos >= 0) if q_doc is None else (q_doc == k_doc) & (q_doc >= 0)
    if is_causal:
        ok = ok & (k_pos <= q_pos)
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    return ok


def mask_positions(ids: np.ndarray) -> np.ndarray | None:
    """``(B, S)`` int64: each token's place in its document's order, the ``m`` of the rule;
    None when it is the global position for every token (no document in the balanced order)."""
    flagged = ids >= CHUNK_MAJOR
    if not flagged.any():
        return None
    batch, seq = ids.shape
    order, first_of_group = _grouped(ids, np.zeros_like(ids))
    rank = np.empty(ids.size, dtype=np.int64)
    rank[order] = np.arange(ids.size) - first_of_group
    index = np.broadcast_to(np.arange(seq), (batch, seq))
    return np.where(flagged, rank.reshape(batch, seq), index)


def _grouped(ids: np.ndarray, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sorted by (row, part, id) keeping global order inside each group, and for each
    token in that order the sorted index of its group's first token."""
    batch, seq = ids.shape
    rows = np.repeat(np.arange(batch), seq)
    order = np.lexsort((np.tile(np.arange(seq), batch), ids.ravel(), part.ravel(), rows))
    keys = (rows[order], part.ravel()[order], ids.ravel()[order])
    new = np.r_[True, np.any([k[1:] != k[:-1] for k in keys], axis=0)]
    first = np.maximum.accumulate(np.where(new, np.arange(ids.size), 0))
    return order, first


def host_document_ids(document_ids: Tensor | np.ndarray | None,
                      seq_len: int | None = None) -> np.ndarray:
    """``(B, S)`` int64 ids on the host: one copy of a tensor (the step's one device read), or one
    document of ``seq_len`` tokens when there are no ids (a window alone)."""
    if document_ids is None:
        return np.zeros((1, seq_len), dtype=np.int64)
    if isinstance(document_ids, Tensor):
        return document_ids.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(document_ids, dtype=np.int64)


def chunk_count(cp: int) -> int:
    """How many layout chunks the sequence is cut into."""
    return 2 * cp if cp > 1 else 1


def key_intervals(document_ids: Tensor | np.ndarray, is_causal: bool, window: int | None,
                  cp: int = 1) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per token and part of the sequence, ``(lo, hi)``: the inclusive global key interval it
    may see there, ``(B, S, parts)`` int64, and whether the intervals are exact (every
    document one run of consecutive ``mask_positions`` in each part).

    The parts are the whole sequence, or the ``2·cp`` layout chunks when a document is in the
    balanced order (its keys are then a run in each chunk).  Empty (``lo > hi``) for padding
    (negative ids) and where the document has no token.
    """
    ids = host_document_ids(document_ids)
    batch, seq = ids.shape
    mpos = mask_positions(ids)
    global_positions = mpos is None
    parts = 1 if global_positions else chunk_count(cp)
    index = np.broadcast_to(np.arange(seq), (batch, seq))
    if global_positions:
        mpos = index
    part = index // (seq // parts)
    order, first = _grouped(ids, part)
    # per group: first and last global position, size, and m at the first token
    starts = np.flatnonzero(first == np.arange(ids.size))
    sizes = np.diff(np.r_[starts, ids.size])
    group_first = order[starts] % seq
    group_last = order[starts + sizes - 1] % seq
    m_first, m_last = mpos.ravel()[order[starts]], mpos.ravel()[order[starts + sizes - 1]]
    group_row = order[starts] // seq
    group_part, group_id = part.ravel()[order[starts]], ids.ravel()[order[starts]]
    runs = (group_last - group_first + 1 == sizes) & (m_last - m_first + 1 == sizes)
    exact = bool(np.all(runs | (group_id < 0)))
    # the group of (row, part p, id) for every token and part: by binary search on the keys
    _, dense_ids = np.unique(np.r_[group_id, ids.ravel()], return_inverse=True)
    width = int(dense_ids.max()) + 1
    group_key = (group_row * parts + group_part) * width + dense_ids[:group_id.size]
    token_id = dense_ids[group_id.size:].reshape(batch, seq)
    m_lo = mpos - window + 1 if window is not None else np.full_like(mpos, -seq)
    m_hi = mpos if is_causal else np.full_like(mpos, 2 * seq)
    lo = np.full((batch, seq, parts), seq, dtype=np.int64)
    hi = np.full((batch, seq, parts), -1, dtype=np.int64)
    rows = np.arange(batch)[:, None]
    for p in range(parts):
        wanted = (rows * parts + p) * width + token_id
        g = np.minimum(np.searchsorted(group_key, wanted), group_key.size - 1)
        found = (group_key[g] == wanted) & (ids >= 0)
        exact_run = runs[g]
        g_lo = np.where(exact_run, group_first[g] + np.maximum(0, m_lo - m_first[g]),
                        group_first[g])
        g_hi = np.where(exact_run, group_first[g] + np.minimum(sizes[g] - 1, m_hi - m_first[g]),
                        group_last[g])
        if global_positions:  # m is the global position: a superset may still be cut by it
            g_lo, g_hi = np.maximum(g_lo, m_lo), np.minimum(g_hi, m_hi)
        lo[..., p] = np.where(found, g_lo, seq)
        hi[..., p] = np.where(found, g_hi, -1)
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
    ids = host_document_ids(document_ids, seq_len)
    lo, hi, exact = key_intervals(ids, is_causal, window, cp)
    seq = lo.shape[1]
    edges = tile_edges(seq, cp, tiles_per_chunk)
    if lo.shape[2] > 1:
        edges = _with_document_edges(edges, ids, seq // lo.shape[2])
    edges = np.array(edges)
    starts, stops = edges[:-1], edges[1:]
    # the part of key_intervals each key tile lies in (tiles never cross a layout chunk)
    part = starts // (seq // lo.shape[2])
    blocks: list[list[Block]] = [[] for _ in range(cp)]
    for q_start, q_stop in zip(starts.tolist(), stops.tolist()):
        # the key tiles inside the span of the tile's intervals (many tiles, few of them seen)
        span_lo = lo[:, q_start:q_stop].min(axis=(0, 1))[part]
        span_hi = hi[:, q_start:q_stop].max(axis=(0, 1))[part]
        near = np.flatnonzero((starts <= span_hi) & (stops - 1 >= span_lo))
        row_lo, row_hi = lo[:, q_start:q_stop, part[near]], hi[:, q_start:q_stop, part[near]]
        # per batch row, query row and key tile: the key columns it sees there
        clipped_lo = np.maximum(row_lo, starts[near])
        clipped_hi = np.minimum(row_hi, stops[near] - 1)
        ok = clipped_lo <= clipped_hi
        sees = ok.any(0)  # (rows, key tiles), the union over the batch
        for j in np.flatnonzero(sees.any(0)).tolist():
            k = near[j]
            seen = np.flatnonzero(sees[:, j])
            first_row, last_row = q_start + int(seen[0]), q_start + int(seen[-1])
            first_col = int(clipped_lo[..., j][ok[..., j]].min())
            last_col = int(clipped_hi[..., j][ok[..., j]].max())
            # every pair allowed, for every batch row: the kernel needs no mask
            full = exact and bool(
                (lo[:, first_row:last_row + 1, part[k]] <= first_col).all()
                and (hi[:, first_row:last_row + 1, part[k]] >= last_col).all())
            rank, row_start = _local(first_row, seq, cp)
            owner, col_start = _local(first_col, seq, cp)
            blocks[rank].append(Block(owner, (row_start, row_start + last_row - first_row + 1),
                                      (col_start, col_start + last_col - first_col + 1), full))
    return MaskPlan(tuple(_rank_plan(rank, rank_blocks, seq, cp)
                          for rank, rank_blocks in enumerate(blocks)), tuple(edges.tolist()))


def _with_document_edges(edges: list[int], ids: np.ndarray, chunk: int) -> list[int]:
    """``edges`` and where documents meet, but no tile under ``MIN_TILE`` tokens.

    In the balanced order every layout chunk holds a short run of every document, so a fixed
    tile spans many documents and its blocks would be cropped to all of them; cut at the
    documents' edges, a block of two chunks holds one document's pairs and the others are
    skipped."""
    meet = np.flatnonzero((ids[:, 1:] != ids[:, :-1]).any(0)) + 1
    kept: list[int] = []
    for edge in sorted(set(edges) | set(meet.tolist())):
        next_chunk = -(-edge // chunk) * chunk if edge % chunk else edge
        if edge % chunk == 0 or (edge - kept[-1] >= MIN_TILE and next_chunk - edge >= MIN_TILE):
            kept.append(edge)
    return kept


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
