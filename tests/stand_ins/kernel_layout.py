"""How a CUDA attention kernel reads a tensor it is handed: a data pointer and the shape.

flash-attn's ``mha_bwd`` and PyTorch's CUDA flash backward index the log-sum-exp
as a contiguous ``(B, H, S_q)`` array from its data pointer, whatever the
tensor's strides.  ``kernel_reads(t)`` is that view of ``t``'s memory, so a CPU
stand-in fed through it computes what the CUDA kernel would.
"""

from __future__ import annotations

import math

import torch


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def kernel_reads(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape laid over its raw memory from its data pointer, row-major."""
    needed = t.storage_offset() + math.prod(t.shape)
    if needed > t.untyped_storage().nbytes() // t.element_size():
        raise IndexError(f"a kernel reading {tuple(t.shape)} contiguously from offset "
                         f"{t.storage_offset()} runs past the end of the storage")
    return torch.as_strided(t, t.shape, contiguous_strides(t.shape), t.storage_offset())
