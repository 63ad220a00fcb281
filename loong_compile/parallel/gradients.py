"""Gradients the way a trainer reduces them: summed over the ranks that share a sequence and
averaged over data-parallel replicas.

Each of the ``hp·cp`` ranks of a sequence holds its tokens' share of the loss (local sum over
the global token count), so its gradient is a share too: the sequence's gradient is their
**sum**.  Replicas see different sequences: their gradients are **averaged**.  Both at once are
one all-reduce over the ``dp·hp·cp`` ranks (the world the mesh spans) divided by ``dp``.

* ``reduce_gradients(model, mesh)``, after ``backward()``, when parameters are replicated:
  the gradients are flattened per dtype and device into buckets of ``bucket_bytes`` (one
  all-reduce per bucket instead of one per parameter); the buckets' all-reduces are launched
  asynchronously, a few in flight, so one bucket's copies overlap the others' transfers and the
  extra memory stays a few buckets.  It does not hook the backward: a model compiled whole has
  one backward node, so every gradient lands when the backward ends and there is nothing to
  overlap with (blocks compiled one by one are FSDP2's case, which overlaps its own).
* ``set_fsdp_gradient_divide_factor(model, mesh)``, once after ``fully_shard``: FSDP2's
  reduce-scatter over all ranks divides by ``dp`` instead of the world size, so the loss needs
  no scaling by ``sp``.

Both reduce only what trains: ``reduce_gradients`` the parameters with ``requires_grad``, FSDP2
the gradients its backward produced (a frozen parameter has none).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist

from loong_compile.errors import LoongConfigError, LoongRankMismatchError

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20     # DistributedDataParallel's bucket_cap_mb default
IN_FLIGHT = 4                           # buckets launched and not yet written back


def reduce_gradients(parameters: torch.nn.Module | Iterable[torch.nn.Parameter], mesh, *,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_ranks: bool = True) -> None:
    """Sum every gradient over the ranks of its sequence and average it over the ``dp``
    replicas of ``mesh`` (an ``init_mesh`` mesh), in place, in coalesced buckets.

    Equal to ``dist.all_reduce(p.grad); p.grad /= mesh.dp`` for each parameter that trains
    (``requires_grad``).  A frozen parameter (a PEFT model's base weights) is left as it is: a
    gradient it kept from before it was frozen is no new one to sum, and summing it again at
    every step would multiply it by the ranks.  Parameters without a gradient are left without
    one; ``check_ranks`` first checks, with one small all-reduce, that every rank has gradients
    for the same parameters (else ``LoongRankMismatchError`` on every rank, instead of a hang).
    """
    params = [p for p in (parameters.parameters() if isinstance(parameters, torch.nn.Module)
                          else parameters) if p.requires_grad]
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise LoongConfigError(f"bucket_bytes={bucket_bytes!r}", "the bucket size is a positive byte count",
                               f"pass e.g. bucket_bytes={DEFAULT_BUCKET_BYTES}")
    _check_replicated(params)
    if mesh.world == 1:
        return
    if check_ranks:
        _check_same_gradients(params, mesh)
    pending: deque = deque()
    for bucket in _buckets([p.grad for p in params if p.grad is not None], bucket_bytes):
        flat = bucket[0] if len(bucket) == 1 and bucket[0].is_contiguous() else \
            torch.cat([g.reshape(-1) for g in bucket])
        pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        if len(pending) > IN_FLIGHT:
            _write_back(*pending.popleft(), mesh.dp)
    while pending:
        _write_back(*pending.popleft(), mesh.dp)


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Gradients of one dtype and device in order, up to ``bucket_bytes`` a bucket (a larger
    gradient is a bucket of its own)."""
    filling: dict[tuple, list[torch.Tensor]] = {}
    sizes: dict[tuple, int] = {}
    full = []
    for g in grads:
        key, nbytes = (g.dtype, g.device), g.numel() * g.element_size()
        if key in filling and sizes[key] + nbytes > bucket_bytes:
            full.append(filling.pop(key))
        if key not in filling:
            filling[key], sizes[key] = [], 0
        filling[key].append(g)
        sizes[key] += nbytes
    return full + list(filling.values())


def _write_back(work, flat: torch.Tensor, bucket: list[torch.Tensor], dp: int) -> None:
    work.wait()
    if dp > 1:
        flat.div_(dp)
    if len(bucket) == 1 and flat is bucket[0]:
        return
    offset = 0
    for g in bucket:
        g.copy_(flat[offset:offset + g.numel()].view(g.shape))
        offset += g.numel()


def _check_replicated(params: list[torch.nn.Parameter]) -> None:
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(params):
        if isinstance(p, DTensor) or isinstance(p.grad, DTensor):
            raise LoongConfigError(
                f"parameter {i} ({tuple(p.shape)}) is a DTensor (sharded, e.g. by fully_shard)",
                "reduce_gradients all-reduces replicated parameters; FSDP2 reduces its own gradients",
                "call loong_compile.set_fsdp_gradient_divide_factor(model, mesh) once after fully_shard "
                "instead, and no reduce_gradients")
        if p.grad is not None and p.grad.is_sparse:
            raise LoongConfigError(f"parameter {i} ({tuple(p.shape)}) has a sparse gradient",
                                   "reduce_gradients coalesces dense gradients",
                                   "use dense gradients (e.g. nn.Embedding(sparse=False))")


def _check_same_gradients(params: list[torch.nn.Parameter], mesh) -> None:
    """Every rank must have gradients for the same parameters: one buffer per rank, summed."""
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(has)
    mixed = [i for i, n in enumerate(has.tolist()) if 0 < n < mesh.world]
    if mixed:
        raise LoongRankMismatchError(
            f"parameters {mixed[:8]}{' ...' if len(mixed) > 8 else ''} have a gradient on some ranks only",
            "every rank reduces the same gradients (their buckets are collectives)",
            "run the same forward and backward on every rank (the same graph, no rank-dependent "
            "branches), or zero the gradients of unused parameters on every rank")


def set_fsdp_gradient_divide_factor(model: torch.nn.Module, mesh) -> None:
    """Make FSDP2 reduce gradients as ``reduce_gradients`` does: summed over the sequence's
    ranks, averaged over the ``dp`` replicas.  Call once, after ``fully_shard``.

    Every ``fully_shard`` module of ``model`` (and ``model`` itself if it is one) must shard
    over all ``mesh.world`` ranks; its reduce-scatter then sums (``set_force_sum_reduction_for_comms``:
    gloo has no pre-scaled sum, and a sum then a division is what ``reduce_gradients`` does) and
    divides by ``mesh.dp`` instead of the world size.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise LoongConfigError(f"{type(model).__name__} has no fully_shard module",
                               "the divide factor is FSDP2's", "call fully_shard(...) first, or use "
                               "reduce_gradients(model, mesh) after backward for replicated parameters")
    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.size() != mesh.world:
            raise LoongConfigError(
                f"a parameter sharded over {p.device_mesh.size()} ranks with mesh.world={mesh.world}",
                "the reduce-scatter must span every rank of every sequence and replica (dp*hp*cp)",
                "fully_shard over a mesh of the whole world, e.g. init_device_mesh(device, (world,))")
    for module in sharded:
        module.set_gradient_divide_factor(float(mesh.dp))
        module.set_force_sum_reduction_for_comms(True)
