"""The one exchange of the token mixers that carry a state (ops/causal_conv.py, ops/gated_scan.py):
each rank's small per-run summary, gathered to every rank of the group, as a functional
collective the compiler can schedule.

A rank holds its tokens as runs of consecutive positions (``parallel/tokens.py::token_runs``;
with the zigzag, two runs far apart).  What a run needs from the tokens before it is small and
fixed in size: a convolution's last ``k-1`` inputs, a recurrence's state transition.  So every
rank sends the summaries of all its runs to every other (LASP-2's all-gather, not a ring pass:
one collective, and each rank folds the runs before its own in sequence order itself).  Its
gradient is the reduce-scatter of the gathered gradient: rank ``r``'s summary went to every
rank, and each one's use of it comes back summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from loong_compile._compat.distributed import all_gather_start, collective_wait, reduce_scatter_start
from loong_compile.ops.comm import count_all_gather, group
from loong_compile.parallel.tokens import token_runs


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, payload: Tensor, group_size: int, group_name: str) -> Tensor:
        ctx.group_size, ctx.group_name = group_size, group_name
        count_all_gather(payload, group_size)
        return collective_wait(all_gather_start(payload.contiguous(), group_name, group_size))

    @staticmethod
    def backward(ctx, grad: Tensor):
        piece = grad.contiguous()
        count_all_gather(piece[:piece.size(0) // ctx.group_size], ctx.group_size)
        return collective_wait(reduce_scatter_start(piece, ctx.group_name, ctx.group_size)), None, None


def gather_summaries(payload: Tensor, group_size: int, group_name: str) -> Tensor:
    """``payload`` ``(R, ...)`` of every rank of the group -> ``(group_size, R, ...)`` in group-rank
    order (differentiable)."""
    if group_size == 1:
        return payload.unsqueeze(0)
    gathered = _Gather.apply(payload, group_size, group_name)
    return gathered.unflatten(0, (group_size, payload.size(0)))


def group_runs(seq_len: int, hp: int, cp: int, places: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The token runs of every rank of the group, in group-rank order: ``places[g]`` is group
    rank ``g``'s ``(cp_rank, hp_rank)`` (``LoongMesh.group_places``)."""
    if len(places) != hp * cp:
        raise ValueError(f"{len(places)} places for a group of hp*cp = {hp * cp} ranks")
    return [token_runs(seq_len, cp, hp, c, h) for c, h in places]


def my_place(group_rank: int | None, group_name: str, group_size: int) -> int:
    """This rank's place in the group: ``group_rank`` where the caller knows it (a function that
    Dynamo traces: it cannot look a group up), else read from the group (the passes leave it
    out, so that every rank's graph is the same one and the ranks' agreement check holds)."""
    if group_rank is not None:
        return group_rank
    return dist.get_rank(group(group_name)) if group_size > 1 else 0
