"""Where the scans' state resets: the document starts of a step, and each run's share of them.

Packed documents (position ids restarting at 0 per document) are separate sequences to the
kernels users run: flash-linear-attention's ``chunk_gated_delta_rule(cu_seqlens=)``,
mamba-ssm's ``mamba_chunk_scan_combined(seq_idx=)`` and causal-conv1d's ``seq_idx`` start each
document from a zero state and never read a token of the previous one.  The scans do the same,
from the step's global document ids (``ops/masks/documents.py::sequence_document_ids``: one
all-gather of the position ids, the same ids on every rank, read by the rule attention reads
its documents by).  ``scan_documents`` turns them into numbers that change exactly where a
document starts, once per step, and refuses the rows where no reset can be placed;
``run_documents`` gives each of a rank's runs its tokens' numbers (and those of the tokens
just before the run, which a convolution's halo or a recurrence's start state came from).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from loong_compile.errors import LoongShapeError, LoongUnsupportedError
from loong_compile.ops.masks.blocks import CHUNK_MAJOR, UNREADABLE
from loong_compile.ops.scans.exchange import pick


@torch.library.custom_op("loong::scan_documents", mutates_args=())
def scan_documents(document_ids: Tensor) -> Tensor:
    """``(B, S)`` global document ids (``sequence_document_ids``'s, without key padding) ->
    ``(B, S)`` int64 numbers that change exactly at each document start (from 0 at each row's
    first token).  Refuses, on every rank alike (the ids are the same on all of them), a row in
    ``shard_batch(..., balance_documents=True)``'s order (a document's tokens are then dealt over
    the layout's chunks: its state would have to pass from chunk to chunk around the others) and
    a row whose positions are neither packed documents nor that order.  One host read per step."""
    ids = document_ids.to(torch.int64)
    if bool(((ids >= CHUNK_MAJOR) | (ids == UNREADABLE)).any()):
        host = ids.cpu().numpy()
        balanced = sorted(int(r) for r in np.flatnonzero((host >= CHUNK_MAJOR).any(1)))
        if balanced:
            raise LoongUnsupportedError(
                f"batch rows {balanced} hold packed documents in shard_batch(..., "
                "balance_documents=True)'s order, and the graph has a scan (a short convolution "
                "or a gated recurrence) that starts each document from a zero state",
                "a scan carries a document's state from token to token in the document's order; "
                "the balanced order deals each document over the layout's chunks, between the "
                "other documents' tokens, so no run of a rank holds a document whole or in order",
                "cut the batch without balance_documents (shard_batch(..., document_ids=...))")
        unreadable = sorted(int(r) for r in np.flatnonzero((host == UNREADABLE).any(1)))
        raise LoongShapeError(
            f"position ids of batch rows {unreadable} that are neither packed documents nor "
            "documents in the balanced order, in a graph with a scan that resets at each "
            "document start", "each position counts from its document's start, with the "
            "documents contiguous (transformers' packed convention)",
            "cut the batch with loong_compile.shard_batch and pass its position_ids")
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts.cumsum(1) - 1


@scan_documents.register_fake
def _(document_ids):
    return document_ids.new_empty(document_ids.shape, dtype=torch.int64)


def run_documents(numbers: Tensor, runs: list[list[tuple[int, int]]], before: int,
                  place: Tensor | None, me: int | None) -> list[Tensor]:
    """For each of this rank's runs (``runs``: every group rank's, ``exchange.group_runs``), the
    ``(B, before + length)`` document numbers of positions ``first - before .. first + length - 1``
    (those before the sequence's start read as its first token's).  ``place``: this rank's place
    as a tensor, read at run time where every rank's runs are alike (``exchange.same_run_lengths``),
    else ``me``, its place."""
    def positions(first: int, length: int) -> Tensor:
        return torch.arange(first - before, first + length, device=numbers.device).clamp_min(0)

    out = []
    for j in range(len(runs[0] if place is not None else runs[me])):
        if place is not None:
            index = pick(torch.stack([positions(*rank_runs[j]) for rank_runs in runs]), place)
        else:
            index = positions(*runs[me][j])
        out.append(numbers.index_select(1, index))
    return out


def document_starts(run_numbers: Tensor) -> Tensor:
    """``(B, length)`` bool: which of a run's tokens start a document, from ``run_documents``'s
    numbers with one position before the run."""
    return run_numbers[:, 1:] != run_numbers[:, :-1]
