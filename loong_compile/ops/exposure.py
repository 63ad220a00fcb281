"""Exposed transfer and communication time: what a wait blocks, per layer, measured with events.

What the compute stream spends blocked is what overlap failed to hide: a ``loong.wait_tensor``
whose copy is still in flight, or a functional collective's ``wait_tensor`` (the SeqAlltoAll,
ops/attention/alltoall.py) whose exchange is.  Inside ``recording()``, each such wait records a timing
event on the current CUDA stream before and after it blocks; ``per_layer`` turns the pairs
into milliseconds per layer and kind.  An offload or reload wait knows its layer from
``passes/activations/offload.py``.  A collective's wait does not: Inductor's code calls torch's op, which
``recording`` times through ``_compat.distributed.timed_collective_waits``, and the layer is counted: one
attention call per layer exchanges ``exchanges_per_layer`` tensors, in layer order in the
forward and in reverse in the backward.  Off CUDA the events are host timestamps (a gloo
exchange blocks the host thread, not a stream): that is how the tests exercise the record.

Nothing is recorded outside ``recording()``.  gpu-check's ``exposed_time`` check is the one user.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from loong_compile._compat.aot import in_backward
from loong_compile._compat.distributed import timed_collective_waits

_records: list[tuple[int, str, Any, Any]] | None = None   # (layer, kind, start event, end event)


class _HostEvent:
    """The two methods of ``torch.cuda.Event`` that ``per_layer`` uses, timed on the host."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1e3


@contextlib.contextmanager
def recording(layers: int | None = None, exchanges_per_layer: int = 4) -> Iterator[list]:
    """Record every blocking wait while inside; yields the records.  ``layers``: the model's
    attention layers, to attribute collective waits (without it they count as layer -1)."""
    global _records
    previous, _records = _records, []
    counted = {False: 0, True: 0}        # collective waits seen, forward and backward

    def timed_wait(wait, tensor):
        backward = in_backward()
        index, counted[backward] = counted[backward], counted[backward] + 1
        layer = index // exchanges_per_layer
        if layers is None:
            layer = -1
        elif backward:
            layer = layers - 1 - layer
        with blocking("collective", layer, tensor.device):
            return wait(tensor)

    try:
        with timed_collective_waits(timed_wait):
            yield _records
    finally:
        _records = previous


@contextlib.contextmanager
def blocking(kind: str, layer: int, device: torch.device) -> Iterator[None]:
    """Time what the body makes ``device``'s current stream (or, off CUDA, the host) wait for,
    when recording."""
    if _records is None:
        yield
        return
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
    else:
        start = _HostEvent()
        yield
        end = _HostEvent()
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
