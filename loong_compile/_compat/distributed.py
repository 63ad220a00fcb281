"""torch.distributed shims: process groups by name and in ring order, functional
collectives, the default store (ops/, parallel/mesh.py, checks/ranks.py)."""

from __future__ import annotations

import contextlib
import functools

import torch

from loong_compile._compat import has


def resolve_process_group(group_name: str):
    """The ProcessGroup registered under ``group_name`` (``ProcessGroup.group_name``).

    Custom-op schemas can only carry primitives, so the 2D-Attention ops take
    group names as strings and resolve them here at run time, the same way
    torch's functional collectives do.  Checked against torch 2.13.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def register_group_alias(alias: str, group_name: str) -> str:
    """Register the process group named ``group_name`` under ``alias`` too, in this process;
    return ``alias``.  torch names groups by creation count, so rank 0's HP group and rank 2's
    have different names; an alias that is the same on every rank makes the ranks' graphs
    equal, and Inductor's FX graph cache then serves one rank's compile to the others.  An
    alias left from a destroyed world is replaced (``destroy_process_group`` of the default
    group unregisters every name).  Checked against torch 2.11-2.15."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    group = resolve_process_group(group_name)
    try:
        if resolve_process_group(alias) is group:
            return alias
        _unregister_process_group(alias)
    except (RuntimeError, ValueError):
        pass                                # not registered yet
    _register_process_group(alias, group)
    return alias


def all_to_all_start(x, group_name: str, group_size: int):
    """``_c10d_functional.all_to_all_single`` of equal splits along dim 0: the exchange in
    flight, to be finished by ``collective_wait``.  In a compiled graph Inductor sees the
    start and the wait as two nodes it can schedule apart.  Checked against torch 2.11-2.15."""
    splits = [x.size(0) // group_size] * group_size
    return torch.ops._c10d_functional.all_to_all_single(x, splits, splits, group_name)


def all_gather_start(x, group_name: str, group_size: int):
    """``_c10d_functional.all_gather_into_tensor``: every rank's ``x`` concatenated along dim 0
    in group-rank order, in flight until ``collective_wait``.  Checked against torch 2.11-2.15."""
    return torch.ops._c10d_functional.all_gather_into_tensor(x, group_size, group_name)


def reduce_scatter_start(x, group_name: str, group_size: int):
    """``_c10d_functional.reduce_scatter_tensor`` (sum): piece ``r`` of dim 0 summed over the
    group, to rank ``r``; in flight until ``collective_wait``.  Checked against torch 2.11-2.15."""
    return torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", group_size, group_name)


def collective_wait(x):
    """``_c10d_functional.wait_tensor``: the finished result of a functional collective."""
    return torch.ops._c10d_functional.wait_tensor.default(x)


@contextlib.contextmanager
def timed_collective_waits(wrap):
    """Inside, every ``_c10d_functional.wait_tensor`` that generated code (or
    ``collective_wait``) calls runs as ``wrap(wait, tensor)``: Inductor's wrapper looks the op up
    as ``torch.ops._c10d_functional.wait_tensor.default`` at each call, so replacing that
    attribute of the op packet reaches compiled graphs.  Restored on exit.  Checked against
    torch 2.11-2.15."""
    packet = torch.ops._c10d_functional.wait_tensor
    wait = packet.default
    packet.default = functools.partial(wrap, wait)
    try:
        yield
    finally:
        packet.default = wait


def is_tracing() -> bool:
    """Whether ops run under a tracer (Dynamo, AOTAutograd's fake or proxy modes) rather than
    on real tensors: the functional collectives' own test, so byte counters count only real
    traffic.  Checked against torch 2.13."""
    from torch.distributed._functional_collectives import _are_we_tracing

    return _are_we_tracing()


def new_group_in_order(ranks: list[int], desc: str):
    """A process group of ``ranks`` that keeps their order, or one in sorted order where torch
    cannot keep it (``unsorted_process_groups``); the caller checks the order it got."""
    import torch.distributed as dist

    if has("unsorted_process_groups"):
        return dist.new_group(ranks, sort_ranks=False, group_desc=desc)
    return dist.new_group(sorted(ranks), group_desc=desc)


def default_store():
    """The key-value store of the default process group (torch 2.13: ``_get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def store_wait(store, keys: list[str], timeout_s: float) -> None:
    """Wait until every key is set; raise (a store error) after ``timeout_s`` seconds."""
    from datetime import timedelta

    store.wait(keys, timedelta(seconds=timeout_s))
