"""Head groups (issue 52; UPipe's idea in the 2D layout): which heads 2D-Attention runs together.

With ``head_groups = G``, each rank's ``H / hp`` query heads after the head all-to-all are cut
into ``G`` groups of ``h = H / (hp·G)``, and the all-to-all, the ring and the all-to-all back run
one group after the other.  A rank then holds one group's attention working set at a time (the
ring's K/V blocks, the gradients it accumulates, the backward's exchanged buffers) instead of
every head's: the backward's peak falls by about ``(G-1)/G`` of that working set, the saved
tensors stay as they are (every group's q/k/v/out, the same bytes as without groups).

Group ``g`` is heads ``p·H/hp + g·h + i`` (``i < h``) of every HP rank ``p``, so that the
all-to-all of a group's heads lands each rank's share of that group on it.  K/V follow the
query heads they serve: with ``K`` KV heads on a rank (after the replication of LoongTrain §4.2),
``G`` dividing ``K`` gives each group ``K / G`` of them; ``K`` dividing ``G`` shares each KV head
between ``G / K`` consecutive groups, exchanged once for all of them.  Any other ``G`` would split
a KV head's query heads across groups unevenly: refused by
``parallel/rules.py::head_group_violation``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def head_group_parts(q: Tensor, k: Tensor, v: Tensor, rows: Tensor | None, hp: int,
                     groups: int) -> list[tuple[Tensor, tuple[Tensor, ...], Tensor | None]]:
    """``(q part, its K/V parts or () when it shares the previous group's, its sink rows)`` for
    each head group, in the order they run (``k``, ``v``: after replication)."""
    if groups == 1:
        return [(q, (k, v), rows)]
    kv_count = min(groups, k.size(1) // hp)   # distinct K/V groups
    share = groups // kv_count                 # query groups per K/V group
    q_parts = split_heads(q, hp, groups)
    row_parts = (None,) * groups if rows is None else split_heads(rows, hp, groups)
    kv = list(zip(split_heads(k, hp, kv_count), split_heads(v, hp, kv_count)))
    return [(q_part, kv[g // share] if g % share == 0 else (), row_part)
            for g, (q_part, row_part) in enumerate(zip(q_parts, row_parts))]


def split_heads(x: Tensor, hp: int, groups: int) -> tuple[Tensor, ...]:
    """``x`` ``(B, H, S, D)`` as ``groups`` tensors ``(B, H / groups, S, D)``: group ``g`` holds
    heads ``p·H/hp + g·h + i`` of every HP rank ``p`` (``unbind``: its gradient is one stack)."""
    return tuple(part.flatten(1, 2) for part in x.unflatten(1, (hp, groups, -1)).unbind(2))


def join_heads(parts: list[Tensor], hp: int) -> Tensor:
    """The inverse of ``split_heads`` for attention's outputs ``(B, H / groups, S, ...)``;
    4-D outputs (``out``) come back token-major, as ``token_major`` lays them out, so that the
    output projection's transpose reads them without a copy."""
    if parts[0].dim() == 3:   # the LSE: (B, H/groups, S)
        return torch.stack([p.unflatten(1, (hp, -1)) for p in parts], dim=2).flatten(1, 3)
    # (B, S, hp, h, D) views, stacked to (B, S, hp, groups, h, D): one token-major buffer
    token_major = [p.transpose(1, 2).unflatten(2, (hp, -1)) for p in parts]
    return torch.stack(token_major, dim=3).flatten(2, 4).transpose(1, 2)
