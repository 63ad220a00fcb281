"""Host offload ops: a saved activation goes to host memory in the forward and comes back
for the backward (MEMO §4.1; emitted by ``passes/activations/offload.py``).

``torch.ops.loong.offload(x) -> h``                  start copying ``x`` to host memory
``torch.ops.loong.reload(h, device, after) -> y``    start copying ``h`` back to ``device``
``torch.ops.loong.wait_tensor(t, keepalive, after, layer)``  wait until the copy that
                                        produced ``t`` is done; returns ``t`` itself (an alias)

``after`` (optional, never read) is a data dependency on the compute the op must follow:
the wait of an offload comes after the next layer's last matmul, a prefetch after the
backward of the layer above the one before it.  No scheduler reorders an op before its
inputs, so Inductor's ``reorder_for_peak_memory`` cannot pull a wait up next to its copy
(it did: every forward wait sat right after its offload) nor a prefetch up to the start
of the backward.  ``layer`` (the swapped layer whose tensor it is) only labels the time the
wait blocks the compute stream, recorded inside ``ops.exposure.recording()``.

On CUDA the copies run on one side stream per device into pinned host buffers, and the
compute stream waits on the copy's event in ``wait_tensor``: the forward computes on while
activations drain to the host, the backward while they come back.  Elsewhere (CPU) a copy
is a plain synchronous copy and ``wait_tensor`` has nothing to wait for.

These are PyTorch's ``torch.ops.ao.offload / reload / wait_tensor`` semantics, with two
differences that are why we don't use those ops: (1) they need an accelerator (on a CPU
build they raise "Accelerator expected"), and (2) ``ao.wait_tensor`` frees its keepalive's
storage with ``resize_(0)``, which must never happen to a tensor that is a view into a
planned memory pool (the memory plan's arena: freeing it would free the whole pool).  Here
``keepalive`` only extends the source's lifetime in the graph to the wait, so neither Inductor
nor the caching allocator reuses memory an in-flight copy still reads; the source is freed
by ordinary liveness right after the wait.
"""

from __future__ import annotations

import torch
from torch.fx import has_side_effect

from loong_compile._compat.kernels import cudagraph_unsafe_tags
from loong_compile.ops.exposure import blocking

# One side stream per CUDA device, and the event of every copy in flight with the CUDA device
# it ran on, keyed by the data pointer of the copy's destination (what ``wait_tensor``
# receives: a host tensor for an offload, whose device says nothing of the stream to order).
_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_in_flight: dict[int, tuple[torch.cuda.Event, torch.device]] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def _copy(src: torch.Tensor, dst: torch.Tensor, cuda_device: torch.device | None) -> torch.Tensor:
    """Copy ``src`` into ``dst``: on ``cuda_device``'s side stream with an event, else at once."""
    if cuda_device is None:
        return dst.copy_(src)
    stream = _side_stream(cuda_device)
    stream.wait_stream(torch.cuda.current_stream(cuda_device))  # src is complete
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    _in_flight[dst.data_ptr()] = (event, cuda_device)
    return dst


@torch.library.custom_op("loong::offload", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def offload(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x`` (pinned on CUDA), with ``x``'s strides when ``x`` is dense."""
    if x.device.type == "cuda":
        return _copy(x, torch.empty_like(x, device="cpu", pin_memory=True), x.device)
    return _copy(x, torch.empty_like(x, device="cpu"), None)


@offload.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device="cpu")


@torch.library.custom_op("loong::reload", mutates_args=(),
                         tags=cudagraph_unsafe_tags())
def reload(h: torch.Tensor, device: torch.device, after: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of host tensor ``h`` on ``device``, started after ``after`` exists.  It is
    allocated on the compute stream (the caching allocator's owner) and written by the side
    stream."""
    out = torch.empty_like(h, device=device)
    return _copy(h, out, out.device if out.device.type == "cuda" else None)


@reload.register_fake
def _(h: torch.Tensor, device: torch.device, after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(h, device=device)


# wait_tensor returns its input (an alias), which custom_op forbids: define it with an
# aliasing schema instead.  CompositeExplicitAutograd: one kernel for the mixed-device
# arguments (a host tensor and its CUDA keepalive).
_lib = torch.library.Library("loong", "FRAGMENT")
_lib.define("wait_tensor(Tensor(a) tensor, Tensor? keepalive=None, Tensor? after=None, int layer=-1) "
            "-> Tensor(a)")


@torch.library.impl(_lib, "wait_tensor", "CompositeExplicitAutograd")
def _wait_tensor(tensor: torch.Tensor, keepalive: torch.Tensor | None = None,
                 after: torch.Tensor | None = None, layer: int = -1) -> torch.Tensor:
    in_flight = _in_flight.pop(tensor.data_ptr(), None)
    if in_flight is not None:
        event, device = in_flight
        kind = "offload" if tensor.device.type == "cpu" else "reload"
        with blocking(kind, layer, device):
            torch.cuda.current_stream(device).wait_event(event)
    return tensor


@torch.library.register_fake("loong::wait_tensor", lib=_lib)
def _wait_tensor_fake(tensor: torch.Tensor, keepalive: torch.Tensor | None = None,
                      after: torch.Tensor | None = None, layer: int = -1) -> torch.Tensor:
    return tensor


# The wait orders the compute stream after the copy: never dead-code-eliminate or merge it.
has_side_effect(torch.ops.loong.wait_tensor.default)

OFFLOAD = torch.ops.loong.offload.default
RELOAD = torch.ops.loong.reload.default
WAIT = torch.ops.loong.wait_tensor.default
