"""What MEMO's LP for alpha needs from the machine, measured at compile time: device -> host
copy bandwidth, the matmul rate a layer's GEMMs reach, this rank's share of host memory; and
the minimum over ranks (``agree_min``) so every rank solves the same LP and builds the same
graph.  Used by ``classify`` where the options say ``auto``; the LP itself is
``loong_compile.estimate.alpha`` (torch-free).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

# Share of the available host memory the offloaded activations may take: the rest is
# for the optimizer, data loading and everything else the host runs.
HOST_MEMORY_MARGIN = 0.8


@functools.cache
def measure_host_bandwidth(device: torch.device, nbytes: int = 64 * 2**20) -> float:
    """Device -> host copy bandwidth (bytes/s), best of a few copies (pinned host on CUDA)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = math.inf
    for _ in range(4):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


@functools.cache
def measure_matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in ``dtype`` on ``device`` (the rate a layer's GEMMs reach)."""
    n = 2048 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(4):
        _sync(device)
        t0 = time.perf_counter()
        a @ a
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def available_host_memory(local_ranks: int | None = None) -> float:
    """This rank's share of the host memory available now, with a margin."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return available * HOST_MEMORY_MARGIN / max(ranks, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree_min(values: Sequence[float]) -> list[float]:
    """The element-wise minimum over all ranks (identity in a single process), so that
    every rank solves the same LP and builds the same graph."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()
