"""What a rank's graph needs to know of the whole sequence, beyond its own tokens: the label of
the token after each of its tokens, the sequence's count of labels, and its tokens' positions.

A model handed only this rank's tokens computes three things from the local length that one
process computes from the whole sequence; the passes emit these ops in their place
(``passes/loss/sequence_loss.py``, ``passes/attention/made_positions.py``):

* ``next_token_labels``: transformers' loss shifts the labels by one token (``pad`` then a slice
  ``[..., 1:]``).  The label after a rank's last token of a layout chunk is on another rank; one
  all-gather of the sequence's labels (integers, ``S`` per row: far below what attention moves)
  puts them in global order with ``parallel/tokens.py``'s layout, the shift is taken there, and
  each rank keeps its tokens'.
* ``sequence_label_count``: a loss's ``reduction="mean"`` divides by the count of labels that are
  not ``ignore_index``; the mean of one process divides the sum by the sequence's count, one
  all-reduce of a 0-dim integer over the ranks of the sequence.
* ``layout_positions``: ``arange(T)`` numbers a rank's tokens from 0; its tokens' positions in
  the sequence are the layout's.  No communication: the rank's place in its HP and CP groups.

All three return integers and take no gradient.  The names are the ops' overloads
(``torch.ops.loong.<name>.default``): what the passes put in a graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from loong_compile.ops.comm import group
from loong_compile.parallel.tokens import local_token_indices


def _place(hp: int, cp: int, hp_group: str, cp_group: str) -> tuple[int, int]:
    """(cp rank, hp rank) of this rank, from its groups (ordered by CP / HP rank)."""
    return (group(cp_group).rank() if cp > 1 else 0, group(hp_group).rank() if hp > 1 else 0)


@torch.library.custom_op("loong::next_token_labels", mutates_args=())
def _next_token_labels(labels: Tensor, fill: int, hp: int, cp: int, sp_group: str,
                      hp_group: str, cp_group: str) -> Tensor:
    """``(..., T)`` labels of this rank's tokens -> the label of the token after each one in the
    sequence (``fill`` after the last): one process's ``pad(labels, (0, 1), value=fill)[...,
    1:]`` at this rank's tokens.  The group names are ``mesh.document_kwargs()``'s."""
    local = labels.size(-1)
    seq = local * hp * cp
    rows = labels.reshape(-1, local).to(torch.int64)
    index = local_token_indices(seq, cp, hp, *_place(hp, cp, hp_group, cp_group)).to(labels.device)
    payload = torch.cat([rows, index.unsqueeze(0)])
    if hp * cp > 1:
        parts = [torch.empty_like(payload) for _ in range(hp * cp)]
        dist.all_gather(parts, payload, group=group(sp_group))
        payload = torch.cat(parts, dim=1)
    full = torch.full((rows.size(0), seq + 1), fill, dtype=torch.int64, device=labels.device)
    full[:, payload[-1]] = payload[:-1]
    return full[:, index + 1].to(labels.dtype).reshape(labels.shape)


@_next_token_labels.register_fake
def _(labels, fill, hp, cp, sp_group, hp_group, cp_group):
    return torch.empty_like(labels, memory_format=torch.contiguous_format)


@torch.library.custom_op("loong::sequence_label_count", mutates_args=())
def _sequence_label_count(labels: Tensor, ignore_index: int, sp_group: str) -> Tensor:
    """How many labels of the whole sequence (the ranks of ``sp_group``) are not
    ``ignore_index``: a 0-dim int64, the same on every rank of the sequence."""
    count = (labels != ignore_index).sum().to(torch.int64)
    if dist.get_world_size(group(sp_group)) > 1:
        dist.all_reduce(count, group=group(sp_group))
    return count


@_sequence_label_count.register_fake
def _(labels, ignore_index, sp_group):
    return labels.new_empty((), dtype=torch.int64)


@torch.library.custom_op("loong::layout_positions", mutates_args=())
def _layout_positions(length: int, hp: int, cp: int, hp_group: str, cp_group: str,
                     device: torch.device) -> Tensor:
    """The positions in the sequence of this rank's ``length`` tokens, in local order (int64):
    what ``arange(length)`` is in one process holding the whole sequence, at these tokens."""
    return local_token_indices(length * hp * cp, cp, hp,
                               *_place(hp, cp, hp_group, cp_group)).to(device)


@_layout_positions.register_fake
def _(length, hp, cp, hp_group, cp_group, device):
    return torch.empty(length, dtype=torch.int64, device=device)


next_token_labels = torch.ops.loong.next_token_labels.default
sequence_label_count = torch.ops.loong.sequence_label_count.default
layout_positions = torch.ops.loong.layout_positions.default
