"""The one exchange of the token mixers that carry a state (ops/scans/causal_conv.py, ops/scans/gated_scan.py):
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
    return [token_runs(seq_len, cp, hp, c, h, merged=False) for c, h in places]


def same_run_lengths(runs: list[list[tuple[int, int]]]) -> bool:
    """Whether every rank holds runs of the same lengths in the same order (the layouts of
    ``parallel/tokens.py`` for a sequence that divides evenly): then a rank's computation
    differs from another's only in which runs' results it reads (``place_tensor``)."""
    return all([n for _, n in r] == [n for _, n in runs[0]] for r in runs)


def place_tensor(group_rank: int | None, group_name: str, group_size: int, device) -> Tensor:
    """This rank's place in the group as a 0-d int64 tensor: read when the graph runs, not when
    it is traced, so that every rank's graph is the same one (and the ranks' lowering is shared,
    ``loong_compile/shared_lowering.py``)."""
    if group_rank is not None:
        return torch.tensor(group_rank, device=device)
    return group_place(torch.empty(0, device=device), group_name, group_size)


@torch.library.custom_op("loong::group_place", mutates_args=())
def group_place(like: Tensor, group_name: str, group_size: int) -> Tensor:
    """This rank's place in the group, on ``like``'s device."""
    return torch.tensor(dist.get_rank(group(group_name)) if group_size > 1 else 0, device=like.device)


@group_place.register_fake
def _(like, group_name, group_size):
    return like.new_empty((), dtype=torch.int64)


def pick(values: Tensor, place: Tensor) -> Tensor:
    """``values[place]``: the row of this rank, ``place`` a 0-d tensor."""
    return values.index_select(0, place.reshape(1)).squeeze(0)


def my_place(group_rank: int | None, group_name: str, group_size: int) -> int:
    """This rank's place in the group: ``group_rank`` where the caller knows it (a function that
    Dynamo traces: it cannot look a group up), else read from the group (the passes leave it
    out, so that every rank's graph is the same one and the ranks' agreement check holds)."""
    if group_rank is not None:
        return group_rank
    return dist.get_rank(group(group_name)) if group_size > 1 else 0
