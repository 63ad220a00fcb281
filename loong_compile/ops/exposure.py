"""Exposed transfer and communication time, measured with CUDA events on the compute stream.

What the compute stream spends blocked is what overlap failed to hide: a ``loong.wait_tensor``
whose copy is still in flight.  Inside ``recording()``, each wait records a timing event on
the current CUDA stream before and after it blocks; ``per_layer`` turns the pairs into
milliseconds per layer and kind (a wait knows its layer from ``passes/offload.py``).  The
SeqAlltoAll's waits are Inductor's ``wait_tensor`` (ops/alltoall.py), outside this record:
a profiler trace shows them.

Nothing is recorded outside ``recording()`` or off CUDA (a CPU copy is synchronous: there is
no stream to block).  gpu-check's ``exposed_time`` check is the one user.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_records: list[tuple[int, str, Any, Any]] | None = None   # (layer, kind, start event, end event)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record every blocking wait on CUDA while inside; yields the records."""
    global _records
    previous, _records = _records, []
    try:
        yield _records
    finally:
        _records = previous


@contextlib.contextmanager
def blocking(kind: str, layer: int, device: torch.device) -> Iterator[None]:
    """Time what the body makes ``device``'s current stream wait for (when recording)."""
    if _records is None or device.type != "cuda":
        yield
        return
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    yield
    end.record(stream)
    _records.append((layer, kind, start, end))


def per_layer(records: list[tuple[int, str, Any, Any]]) -> dict[int, dict[str, float]]:
    """Milliseconds blocked per layer and kind (events synchronized first), with the count of
    waits: ``{layer: {kind: ms, kind + "_waits": n}}``."""
    out: dict[int, dict[str, float]] = {}
    for layer, kind, start, end in records:
        end.synchronize()
        row = out.setdefault(layer, {})
        row[kind] = row.get(kind, 0.0) + start.elapsed_time(end)
        row[f"{kind}_waits"] = row.get(f"{kind}_waits", 0) + 1
    return out
