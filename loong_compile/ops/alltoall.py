"""SeqAlltoAll over the head-parallel group (LoongTrain §4.1, Ulysses).

``seq_all_to_all(xs, scatter_dim, gather_dim, ...)`` splits every tensor of
``xs`` into ``group_size`` pieces along ``scatter_dim``, sends piece ``p`` to
HP rank ``p`` and concatenates what arrives along ``gather_dim`` in HP-rank
order.  Scattering heads (dim 1) and gathering the sequence (dim 2) turns
``(B, H, S/sp, D)`` into ``(B, H/hp, S/cp, D)``; the opposite dims undo it,
which is also the backward.  Several tensors travel in one collective.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loong_compile._compat import cudagraph_unsafe_tags
from loong_compile.ops.comm import all_to_all


def _exchanged_shape(shape, scatter_dim: int, gather_dim: int, group_size: int) -> list:
    shape = list(shape)
    shape[scatter_dim] //= group_size
    shape[gather_dim] *= group_size
    return shape


@torch.library.custom_op("loong::seq_all_to_all", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def seq_all_to_all(xs: list[Tensor], scatter_dim: int, gather_dim: int, group_size: int,
                   group_name: str) -> list[Tensor]:
    pieces = [x.chunk(group_size, scatter_dim) for x in xs]
    # send buffer: for each destination, its piece of every tensor
    send = torch.cat([p[dest].reshape(-1) for dest in range(group_size) for p in pieces])
    received = all_to_all(send, group_name, group_size)
    sizes = [p[0].numel() for p in pieces]
    from_each_rank = [chunk.split(sizes) for chunk in received.split(sum(sizes))]
    return [torch.cat([parts[t].view(p[0].shape) for parts in from_each_rank], dim=gather_dim)
            for t, p in enumerate(pieces)]


@seq_all_to_all.register_fake
def _(xs, scatter_dim, gather_dim, group_size, group_name):
    return [x.new_empty(_exchanged_shape(x.shape, scatter_dim, gather_dim, group_size)) for x in xs]


def _setup_context(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_size, ctx.group_name = inputs


def _backward(ctx, grads):
    # the reverse exchange; autograd hands zeros (not None) for unused outputs
    grad_xs = seq_all_to_all(grads, ctx.gather_dim, ctx.scatter_dim, ctx.group_size, ctx.group_name)
    return grad_xs, None, None, None, None


seq_all_to_all.register_autograd(_backward, setup_context=_setup_context)
