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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loong_compile.ops.scans.exchange import (gather_summaries, group_runs, my_place, pick, place_tensor,
                                              same_run_lengths)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, hp: int, cp: int,
                  places: list[tuple[int, int]], group_rank: int | None, scan_group: str) -> Tensor:
    """``x`` ``(B, C, T)``: this rank's ``T`` tokens in local order, channels first; ``weight``
    ``(C, k)``; ``bias`` ``(C,)`` or None.  One process's causal depthwise convolution of the
    whole sequence, at this rank's tokens.  ``hp``, ``cp``, ``places``, ``group_rank``
    (or None: ``scan_exchange.my_place``), ``scan_group``: ``LoongMesh.scan_kwargs()``."""
    halo = weight.size(-1) - 1
    kernel = weight.unsqueeze(1)
    size = len(places)
    if halo == 0 or size == 1:
        return F.conv1d(F.pad(x, (halo, 0)), kernel, bias, groups=x.size(1))
    runs = group_runs(x.size(-1) * size, hp, cp, places)
    # where the runs are alike, the halo rows of every rank's runs, this rank's picked at run time
    uniform = same_run_lengths(runs)
    me = None if uniform else my_place(group_rank, scan_group, size)
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
    place = place_tensor(group_rank, scan_group, size, x.device) if uniform else None
    for j, piece in enumerate(pieces):
        if uniform:
            every = [_halo_rows(runs, per_rank, halo, r[j][0], zero_row) for r in runs]
            index = pick(torch.tensor(every, device=x.device), place)
        else:
            index = torch.tensor(_halo_rows(runs, per_rank, halo, runs[me][j][0], zero_row),
                                 device=x.device)
        before = rows.index_select(0, index).permute(1, 2, 0)           # (B, C, halo)
        out.append(F.conv1d(torch.cat([before, piece], -1), kernel, bias, groups=x.size(1)))
    return torch.cat(out, -1)


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
