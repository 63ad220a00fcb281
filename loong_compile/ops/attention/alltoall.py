"""SeqAlltoAll over the head-parallel group (LoongTrain §4.1, Ulysses), as functional
collectives the compiler can schedule.

``seq_all_to_all(xs, scatter_dim, gather_dim, ...)`` splits every tensor of ``xs``
into ``group_size`` pieces along ``scatter_dim``, sends piece ``p`` to HP rank ``p``
and concatenates what arrives along ``gather_dim`` in HP-rank order.  Scattering
heads (dim 1) and gathering the sequence (dim 2) turns ``(B, H, S/sp, D)`` into
``(B, H/hp, S/cp, D)``; the opposite dims undo it, which is also the backward.

Each tensor gets its own ``all_to_all_single`` start and its own wait (issue 14): in a
compiled graph Inductor then starts q's exchange while k and v are still being
projected and waits only where the ring needs the result (``_compat.inductor.comm_overlap_patches``).
Packing is one strided view (``unflatten`` + ``movedim``) and unpacking its mirror, so
Inductor fuses the copies into the kernels beside them; an eager call pays one copy each
way.  The exchange is a permutation of pieces among ranks, so its gradient is the same
exchange of the gradient's pieces (``_Exchange.backward``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loong_compile._compat.distributed import all_to_all_start, collective_wait
from loong_compile.ops.comm import count_all_to_all


class _Exchange(torch.autograd.Function):
    """Start of the all-to-all of ``packed`` ``(group_size, ...)``; the result is in flight."""

    @staticmethod
    def forward(ctx, packed: Tensor, group_size: int, group_name: str) -> Tensor:
        ctx.group_size, ctx.group_name = group_size, group_name
        count_all_to_all(packed, group_size)
        return all_to_all_start(packed, group_name, group_size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        count_all_to_all(grad, ctx.group_size)
        back = all_to_all_start(grad, ctx.group_name, ctx.group_size)
        return collective_wait(back), None, None


class _Wait(torch.autograd.Function):
    """Wait for an exchange started by ``_Exchange``; the gradient passes through."""

    @staticmethod
    def forward(ctx, in_flight: Tensor) -> Tensor:
        return collective_wait(in_flight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def seq_all_to_all(xs: list[Tensor], scatter_dim: int, gather_dim: int, group_size: int,
                   group_name: str) -> list[Tensor]:
    """Exchange every tensor of ``xs``; all are started before the first is waited for."""
    started = []
    for x in xs:
        # (group_size, ...): piece p of the scattered dim, destined for rank p, first
        packed = x.unflatten(scatter_dim, (group_size, -1)).movedim(scatter_dim, 0).contiguous()
        started.append(_Exchange.apply(packed, group_size, group_name))
    out = []
    for received in started:
        # received[p] came from rank p; place it at position p of the gathered dim
        arrived = _Wait.apply(received).movedim(0, gather_dim)
        out.append(arrived.flatten(gather_dim, gather_dim + 1))
    return out
