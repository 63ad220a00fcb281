"""Run a function on N local ranks (gloo) with a hard timeout.

Tests use this instead of ``torch.multiprocessing.spawn`` so that a hang in a
collective fails the test after ``timeout`` seconds instead of blocking CI.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results,
            backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:  # the exception object travels only if it pickles
            pickle.dumps(e)
            exc = e
        except Exception:  # noqa: BLE001
            exc = None
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc(), exc)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedFailure(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (type name, message, traceback, exception)."""

    def __init__(self, errors: dict[int, tuple]):
        self.errors = errors
        first = min(errors)
        name, msg, tb, _ = errors[first]
        super().__init__(f"{len(errors)} rank(s) failed; rank {first}: {name}: {msg}\n{tb}")


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300.0,
                    backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo; or nccl, rank r on GPU r);
    return the per-rank results.

    ``fn`` must be importable (a module-level function). Raises ``DistributedFailure``
    if any rank raised and ``TimeoutError`` if the ranks did not finish in time.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    collected: dict[int, tuple[str, Any]] = {}
    try:
        import time
        deadline = time.monotonic() + timeout
        while len(collected) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if any(status == "error" for status, _ in collected.values()):
                    break
                missing = sorted(set(range(world)) - set(collected))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s (hang?)")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and not any(
                        p.is_alive() for p in procs):
                    break
                continue
            collected[rank] = (status, payload)
            if status == "error":
                # one rank failed: give the others a moment to report, then stop
                deadline = min(deadline, time.monotonic() + 10)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: payload for r, (status, payload) in collected.items() if status == "error"}
    if errors:
        raise DistributedFailure(errors)
    missing = sorted(set(range(world)) - set(collected))
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {missing} died without reporting (exit codes {codes})")
    return [collected[r][1] for r in range(world)]
