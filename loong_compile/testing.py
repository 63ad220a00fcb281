"""Run a function on N local ranks (gloo) with a hard timeout; optionally on ranks kept between calls.

Tests and benchmarks use this instead of ``torch.multiprocessing.spawn`` so that a hang in a
collective fails the call after ``timeout`` seconds instead of blocking CI.  ``run_each`` runs
several calls two at a time, for cells whose ranks leave cores idle (a rank waiting for another's
lowering, one process computing a reference).

Inside ``keep_ranks()`` (the test suite's whole session) one set of ranks per world size serves
every call: process start, ``import torch``/transformers and Inductor's first-compile imports
are paid once, not once per call.  Each call still starts as a new process would: a default
process group of its own (a new store, new subgroups), the library's per-process state reset,
the caller's environment.  Ranks that hang or die are killed when the call fails, so the next
call gets new ones and one failure never reaches another call.  Outside it (benchmarks timing a
first compile, gpu_check) each call spawns its ranks and ends them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

# ranks kept alive at once over all kept pools (each ~0.5 GB: torch, transformers, Inductor):
# a pool for each world size the suite runs (1 + 2 + 4 + 8), so that modules that alternate
# 4 and 8 ranks restart none (a 4-rank pool's start costs ~20 s of CI's two cores), and the
# second pool of 1 and of 4 ranks that run_each's second lane uses
MAX_KEPT_RANKS = 20
# after one rank raised, how long the others get to report before the call stops
FAILURE_GRACE_S = 10.0


class DistributedFailure(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (type name, message, traceback,
    exception), in the order the ranks reported: the first is most often the cause (the others
    fail in a collective it left)."""

    def __init__(self, errors: dict[int, tuple]):
        self.errors = errors
        lines = [f"rank {rank}: {name}: {msg}" for rank, (name, msg, _, _) in errors.items()]
        first = next(iter(errors))
        super().__init__(f"{len(errors)} rank(s) failed, first {lines[0]}\n"
                         + "".join(f"  then {line}\n" for line in lines[1:])
                         + f"rank {first}'s traceback:\n{errors[first][2]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reset_process_state() -> None:
    """The library's per-process state as a new process has it: no compiled code, no meshes,
    rank agreement rounds and graph numbers from zero (a new store starts them there)."""
    import torch

    from loong_compile import backend
    from loong_compile._compat.dynamo import drop_installed_globals
    from loong_compile.checks import ranks
    from loong_compile.ops import comm
    from loong_compile.ops.attention import kernels
    from loong_compile.ops.masks import step as step_mask
    from loong_compile.parallel import mesh

    torch.compiler.reset()
    drop_installed_globals()
    mesh._CACHE.clear()
    mesh._USER_MESHES.clear()
    ranks._rounds.clear()
    ranks._compiles = itertools.count()
    ranks._current_compile = None
    backend._graph_ids = itertools.count()
    comm._BYTES.update(dict.fromkeys(comm._BYTES, 0))
    step_mask._REBUILT[0] = 0
    kernels._flash_attn_usable.cache_clear()


def _rank_main(rank: int, world: int, backend: str, kept: bool, calls, results) -> None:
    """One rank: run each call sent to it until told to stop (None); ``kept`` ranks reset the
    library's state after each call (a rank that serves one call just ends)."""
    import torch
    import torch.distributed as dist

    own_env = dict(os.environ)
    if kept:
        reset_process_state()   # imports what every call's reset needs, before the first call's clock
    while (call := calls.get()) is not None:
        call_id, port, payload, env = call
        os.environ.clear()
        os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        torch.set_num_threads(1)
        try:
            fn, args = pickle.loads(payload)
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, rank=rank, world_size=world)
            results.put((call_id, rank, "ok", fn(rank, world, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            try:  # the exception object travels only if it pickles
                pickle.dumps(e)
                exc = e
            except Exception:  # noqa: BLE001
                exc = None
            results.put((call_id, rank, "error", (type(e).__name__, str(e), traceback.format_exc(), exc)))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(own_env)
            if kept:
                torch.set_default_dtype(torch.float32)
                torch.set_grad_enabled(True)
                reset_process_state()


class _Ranks:
    """``world`` processes, each running ``_rank_main``: started once, given calls one by one."""

    _call_ids = itertools.count()

    def __init__(self, world: int, backend: str, kept: bool):
        ctx = mp.get_context("spawn")
        self.world, self.results = world, ctx.Queue()
        self.calls = [ctx.SimpleQueue() for _ in range(world)]
        self.procs = [ctx.Process(target=_rank_main, args=(r, world, backend, kept, self.calls[r], self.results),
                                  daemon=True) for r in range(world)]
        # kept ranks compile with one thread: they already share the machine's cores (Inductor
        # would start a pool of compile processes in every rank); a benchmark's ranks as they were
        threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1" if kept else None)
        with _env(**({} if threads is None else {"TORCHINDUCTOR_COMPILE_THREADS": threads})):
            for p in self.procs:
                p.start()
        _log_pool("start", world)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, fn: Callable, args: tuple, timeout: float) -> dict[int, tuple[str, Any]]:
        """Each reporting rank's (status, payload); raises ``TimeoutError`` when a rank hung."""
        call_id = next(self._call_ids)
        message = (call_id, _free_port(), pickle.dumps((fn, args)), dict(os.environ))
        for calls in self.calls:
            calls.put(message)
        collected: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(collected) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if any(status == "error" for status, _ in collected.values()):
                    break
                missing = sorted(set(range(self.world)) - set(collected))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s (hang?)")
            try:
                got_id, rank, status, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not self.alive():
                    break
                continue
            if got_id == call_id:
                collected[rank] = (status, payload)
                if status == "error":  # the others may wait for it in a collective: a moment, then stop
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return collected

    def close(self) -> None:
        _log_pool("end", self.world)
        for calls, p in zip(self.calls, self.procs):
            if p.is_alive():
                calls.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _log_pool(event: str, world: int) -> None:
    """With ``RUN_DISTRIBUTED_LOG=<file>``, a line per pool started or ended and the test it was
    in: what the suite pays for process starts (docs/benchmarks.md, "Test suite time")."""
    if path := os.environ.get("RUN_DISTRIBUTED_LOG"):
        with open(path, "a") as log:
            log.write(f"{time.time():.1f} {event} {world} {os.environ.get('PYTEST_CURRENT_TEST', '-')}\n")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# (world, backend, lane, what the caller's sys.path puts before the session's) -> ranks kept by
# keep_ranks(), least recently used first: a call whose sys.path has entries in front (a
# test's stand-in modules) gets ranks of its own, as a spawn would
_kept: OrderedDict[tuple, _Ranks] | None = None
# the keys of the kept pools serving a call now (never ended to make room); guarded by _lock
_busy: set[tuple] = set()
_lock = threading.Lock()
# run_each's lane of the calling thread: calls at once never share a pool
_lane = threading.local()
# sys.path when keep_ranks() was entered
_home_path: tuple = ()


@contextlib.contextmanager
def keep_ranks(keep: bool = True) -> Iterator[None]:
    """Within this block ``run_distributed`` reuses its ranks between calls (see the module's
    docstring), or with ``keep=False`` spawns and ends them per call; ranks kept here are ended
    when the block exits, and the enclosing block's rule (and ranks) hold again."""
    global _kept, _home_path
    outer, _kept = _kept, OrderedDict() if keep else None
    outer_path, _home_path = _home_path, tuple(sys.path)
    try:
        yield
    finally:
        for ranks in (_kept or {}).values():
            ranks.close()
        _kept, _home_path = outer, outer_path


def _prepended() -> tuple[str, ...]:
    """The entries of sys.path in front of the session's: they would shadow what the ranks
    import.  Entries added behind it change nothing the ranks import (setuptools appends its
    vendored packages the first time a test imports it, and that must not restart every pool)."""
    first = _home_path[0] if _home_path else None
    return tuple(sys.path[:sys.path.index(first)]) if first in sys.path else tuple(sys.path)


def _ranks_for(world: int, backend: str) -> tuple[_Ranks, tuple | None]:
    """(ranks for this call, their key in ``_kept``, or None when they end with the call)."""
    if _kept is None:
        return _Ranks(world, backend, kept=False), None
    key = (world, backend, getattr(_lane, "index", 0), _prepended())
    with _lock:
        ranks = _kept.pop(key, None)
        if ranks is None or not ranks.alive():
            idle = [k for k in _kept if k not in _busy]
            while idle and sum(r.world for r in _kept.values()) + world > MAX_KEPT_RANKS:
                guests = [k for k in idle if k[3]]   # a few tests' stand-ins: ended first
                end = guests[0] if guests else idle[0]
                idle.remove(end)
                _kept.pop(end).close()
            ranks = _Ranks(world, backend, kept=True)
        _kept[key] = ranks
        _busy.add(key)
    return ranks, key


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300.0,
                    backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo; or nccl, rank r on GPU r);
    return the per-rank results.

    ``fn`` must be importable (a module-level function). Raises ``DistributedFailure``
    if any rank raised and ``TimeoutError`` if the ranks did not finish in time.
    """
    ranks, key = _ranks_for(world, backend)
    collected: dict[int, tuple[str, Any]] = {}
    try:
        collected = ranks.call(fn, args, timeout)
    finally:
        ended = key is None or len(collected) < world or not ranks.alive()
        if ended:
            ranks.close()
        if key is not None:
            with _lock:
                _busy.discard(key)
                if ended:
                    _kept.pop(key, None)
    errors = {r: payload for r, (status, payload) in collected.items() if status == "error"}
    if errors:
        raise DistributedFailure(errors)
    missing = sorted(set(range(world)) - set(collected))
    if missing:
        codes = {r: ranks.procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {missing} died without reporting (exit codes {codes})")
    return [collected[r][1] for r in range(world)]


def run_each(calls: list[tuple[Callable, int, tuple]], timeout: float = 300.0,
             at_once: int = 2) -> list[Any]:
    """``run_distributed(fn, world, *args)`` for each ``(fn, world, args)``, ``at_once`` calls at
    a time, each on its own ranks (a lane of kept pools per caller thread): each call's result,
    or the exception it raised (``DistributedFailure`` naming the ranks, ``TimeoutError``), in
    the calls' order.  One call's failure is its own: the others still run and report.

    Two at a time fill the cores one call leaves idle (its ranks waiting for one rank's
    lowering, the caller computing a reference): docs/benchmarks.md, "Test suite time"."""
    results: list[Any] = [None] * len(calls)
    pending = queue.SimpleQueue()
    for index in range(len(calls)):
        pending.put(index)

    def lane(number: int) -> None:
        _lane.index = number
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            fn, world, args = calls[index]
            try:
                results[index] = run_distributed(fn, world, *args, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the call's own result
                results[index] = exc

    lanes = [threading.Thread(target=lane, args=(n,), daemon=True) for n in range(at_once)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    return results
