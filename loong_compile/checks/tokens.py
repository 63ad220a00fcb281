"""The token inputs of a graph that numbers its tokens itself (one of the input checks,
``inputs.py``).

A graph the ``made_positions`` pass rewrote gives the rank's tokens the layout's positions
without the caller passing any: such a rank has no position ids that could tell a wrong batch.
So before each call the ranks of the sequence compare a checksum of their token inputs (a sum and
a weighted sum: equal tensors give equal checksums) and refuse a batch that every rank holds
whole (``shard_batch`` not called), and a batch ``shard_batch`` cut from packed documents (the
model would number each row as one sequence: its documents live in the position ids the call
left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loong_compile.checks.exchange import RankCheck
from loong_compile.errors import LoongShapeError
from loong_compile.parallel.tokens import PACKED, made_with

_CACHED_LENGTHS = 16


class MadePositionsCheck(RankCheck):
    """Refuses, on every rank of the sequence, a call whose token inputs (``indices``) are the
    same on all of them, or that some rank's ``shard_batch`` cut from packed documents."""

    rows = 3   # a sum and a weighted sum of the token inputs; cut from packed documents

    def __init__(self, mesh: Any, indices: list[int]):
        self.mesh = mesh
        self.indices = indices
        self._weights: dict[tuple, torch.Tensor] = {}

    def wanted(self, args: Sequence[Any]) -> bool:
        return any(isinstance(args[i], torch.Tensor) for i in self.indices)

    def local(self, args: Sequence[Any]) -> torch.Tensor:
        tensors = self._tensors(args)
        found = torch.zeros(3, dtype=torch.float64, device=tensors[0].device)
        for t in tensors:
            flat = t.detach().reshape(-1).to(torch.float64)
            found[:2] += torch.stack([flat.sum(), (flat * self._weights_for(flat)).sum()])
        found[2] = float(any(made_with(t, PACKED) for t in tensors))
        return found

    def judge(self, found: list[list[float]], args: Sequence[Any]) -> None:
        packed = [rank for rank, flag in zip(self.mesh.sp_ranks, found[2]) if flag]
        if packed:
            raise LoongShapeError(
                f"a batch shard_batch cut from packed documents (document_ids= or cu_seqlens=; "
                f"ranks {packed}), and the model is called without position_ids",
                "the model finds packed documents only in its position ids (restarting at 0 at "
                "each document); without them it numbers the row as one sequence, and every "
                "token would attend across the starts of its documents",
                "pass position_ids=batch.position_ids")
        sums = list(zip(found[0], found[1]))
        if all(pair == sums[0] for pair in sums[1:]):
            shape = tuple(self._tensors(args)[0].shape)
            raise LoongShapeError(
                f"every one of the {self.mesh.sp} ranks of the sequence holds the same tokens "
                f"({shape}), and the model is called without position_ids",
                "under hp*cp > 1 a rank holds its share of a longer sequence; the model numbers "
                "its tokens with the layout's positions, which is right only for a batch cut with "
                "shard_batch (a sequence whose shards are all equal is refused with it)",
                "cut each full (B, S) batch with loong_compile.shard_batch(input_ids, labels, "
                f"mesh) for mesh = init_mesh(hp={self.mesh.hp}, cp={self.mesh.cp}) and pass "
                "batch.input_ids (and position_ids=batch.position_ids)")

    def _tensors(self, args: Sequence[Any]) -> list[torch.Tensor]:
        return [args[i] for i in self.indices if isinstance(args[i], torch.Tensor)]

    def _weights_for(self, flat: torch.Tensor) -> torch.Tensor:
        """``sqrt(1..n)`` for ``n`` values on their device, made once per shape (every step)."""
        key = (flat.numel(), flat.device)
        if key not in self._weights:
            if len(self._weights) >= _CACHED_LENGTHS:
                self._weights.clear()
            self._weights[key] = torch.arange(1, flat.numel() + 1, device=flat.device,
                                              dtype=torch.float64).sqrt()
        return self._weights[key]
