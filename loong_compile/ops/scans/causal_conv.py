"""A causal depthwise convolution over the token axis, on a rank's tokens, exact: what the short
convolutions of hybrid models (Qwen3-Next's and Qwen3.5's gated DeltaNet, Mamba-2, LFM2)
compute with ``F.conv1d(x, w, b, padding=k-1, groups=channels)[..., :S]``.

The output at a token reads the ``k-1`` tokens before it.  For a rank's run of consecutive
tokens starting at position ``p``, the tokens ``p-k+1 .. p-1`` sit at the end of the runs before
it, on this rank or (with the zigzag) another one: the halo.  Every rank sends the last ``k-1``
inputs of each of its runs (``ops/scans/exchange.py``: ``runs x B x C x (k-1)`` values), each
builds its runs' halos from what arrived (zeros before the sequence's first token, as the
one-process padding), and convolves halo + run with no padding.  A kernel of one token has no
halo and exchanges nothing.  Backward is autograd's: the halo's gradient goes back to the rank
whose tokens it is through the exchange's reduce-scatter.

Packed documents: an output reads no token of an earlier document, as causal-conv1d's
``seq_idx=`` has it (``ops/scans/documents.py``): each of the ``k-1`` taps into the past is kept
only where the token it reads is of the output's document, which the documents' numbers of the
halo and the run say, the same on one rank or many.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loong_compile.ops.scans.documents import run_documents
from loong_compile.ops.scans.exchange import (gather_summaries, group_runs, my_place, pick, place_tensor,
                                              same_run_lengths)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, hp: int, cp: int,
                  places: list[tuple[int, int]], group_rank: int | None, scan_group: str,
                  documents: Tensor | None = None) -> Tensor:
    """``x`` ``(B, C, T)``: this rank's ``T`` tokens in local order, channels first; ``weight``
    ``(C, k)``; ``bias`` ``(C,)`` or None.  One process's causal depthwise convolution of the
    whole sequence, at this rank's tokens; with ``documents`` (``(B, S)``:
    ``ops/scans/documents.py::scan_documents`` of the whole sequence) within each document.
    ``hp``, ``cp``, ``places``, ``group_rank`` (or None: ``scan_exchange.my_place``),
    ``scan_group``: ``LoongMesh.scan_kwargs()``."""
    halo = weight.size(-1) - 1
    size = len(places)
    if halo == 0:
        return _convolve(x, weight, bias, None)
    runs = group_runs(x.size(-1) * size, hp, cp, places)
    # where the runs are alike, the halo rows of every rank's runs, this rank's picked at run time
    uniform = size > 1 and same_run_lengths(runs)
    me = None if uniform else my_place(group_rank, scan_group, size)
    place = place_tensor(group_rank, scan_group, size, x.device) if uniform else None
    numbers = [None] * len(runs[me or 0]) if documents is None else \
        run_documents(documents, runs, halo, place, me)
    if size == 1:
        return _convolve(F.pad(x, (halo, 0)), weight, bias, numbers[0])
    mine = runs[0 if uniform else me]
    per_rank = max(len(r) for r in runs)
    pieces, tails, offset = [], [], 0
    for _, length in mine:
        piece = x[..., offset:offset + length]
        tails.append(F.pad(piece[..., -halo:], (max(halo - length, 0), 0)))
        pieces.append(piece)
        offset += length
    tails += [torch.zeros_like(tails[0])] * (per_rank - len(mine))
    gathered = gather_summaries(torch.stack(tails), size, scan_group)   # (size, R, B, C, halo)
    # one row per gathered input token, and a row of zeros for the positions before the sequence
    rows = gathered.permute(0, 1, 4, 2, 3).flatten(0, 2)
    rows = torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])])
    out, zero_row = [], rows.size(0) - 1
    for j, piece in enumerate(pieces):
        if uniform:
            every = [_halo_rows(runs, per_rank, halo, r[j][0], zero_row) for r in runs]
            index = pick(torch.tensor(every, device=x.device), place)
        else:
            index = torch.tensor(_halo_rows(runs, per_rank, halo, runs[me][j][0], zero_row),
                                 device=x.device)
        before = rows.index_select(0, index).permute(1, 2, 0)           # (B, C, halo)
        out.append(_convolve(torch.cat([before, piece], -1), weight, bias, numbers[j]))
    return torch.cat(out, -1)


def _convolve(ext: Tensor, weight: Tensor, bias: Tensor | None, numbers: Tensor | None) -> Tensor:
    """``ext`` ``(B, C, k-1 + L)``: a run's halo and its ``L`` tokens -> the ``L`` outputs.  With
    ``numbers`` (``(B, k-1 + L)``: the documents of the same positions) each tap into the past is
    kept where it reads the output's own document: the taps as ``k`` products, each masked."""
    halo = weight.size(-1) - 1
    if numbers is None:
        return F.conv1d(ext, weight.unsqueeze(1), bias, groups=ext.size(1))
    length = ext.size(-1) - halo
    here = numbers[:, halo:]
    out = ext[..., halo:] * weight[:, halo:]
    for back in range(1, halo + 1):     # the tap reading the token ``back`` positions earlier
        same = (numbers[:, halo - back:halo - back + length] == here).unsqueeze(1)
        out = out + torch.where(same, ext[..., halo - back:halo - back + length], 0) \
            * weight[:, halo - back:halo - back + 1]
    return out if bias is None else out + bias[:, None]


def _halo_rows(runs: list[list[tuple[int, int]]], per_rank: int, halo: int, start: int,
               zero_row: int) -> list[int]:
    """For the run starting at ``start``: the gathered row of each position ``start-halo ..
    start-1`` (every one is in the last ``halo`` tokens of the run that holds it)."""
    row_of = {}
    for rank, rank_runs in enumerate(runs):
        for j, (first, length) in enumerate(rank_runs):
            end = first + length
            for t in range(halo):
                position = end - halo + t
                if position >= first:
                    row_of[position] = (rank * per_rank + j) * halo + t
    return [row_of.get(position, zero_row) for position in range(start - halo, start)]


def halo_bytes(batch: int, channels: int, kernel: int, runs_per_rank: int, element_size: int) -> int:
    """What one rank sends per call to each other rank of the group: its runs' last ``k-1``
    inputs (docs/attention.md, "Scans")."""
    return runs_per_rank * batch * channels * (kernel - 1) * element_size
