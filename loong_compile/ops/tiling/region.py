"""The recompute strategy of token tiling: a token-local region run a tile of tokens at a time.

``torch.ops.loong.tiled_region(key, tile, entry, others)`` equals ``region(entry, *others)``
in value and gradient, where ``region`` is the graph the tiling pass cut out of the model
(``passes/tiling/regions.py``) and registered here under ``key``: ``entry`` is its one input
with tokens (cut along ``Region.axis``), ``others`` its weights and constants, the same for
every tile.  The forward runs each tile under ``no_grad`` and writes its slice of each output:
only one tile's intermediates exist at once, and autograd keeps only the op's inputs.  The
backward (``loong::tiled_region_backward``) runs each tile again with autograd (turned back on
inside the op's body, ``_compat.kernels.autograd_in_op_body``), takes the gradients of the tile's
slice of the outputs, writes the tile's slice of dL/dentry and sums the weights' gradients over
the tiles (``loop.Gradients``).

Compiled once, called in a loop: under ``lowering="inductor"`` the region is ``torch.compile``d
once (Inductor fuses a tile's pointwise work) for one tile shape, whatever the tile count: one
graph without gradients for the forward, one with them (its forward and backward) for the
backward; the last, shorter tile is padded to that shape with copies of
its last token (a token-local region computes each token alone, so the copies change no real
token, and their output gradients are zero, so they add nothing to a weight's).  Under the
other lowerings the region runs as a graph module, eagerly.

A tile of the entry's tokens lands in an output along that output's token axis: for an entry
``(B, T, D)`` cut along T, an output ``(B, T, D)`` takes the tile along T, an output ``(B*T,
D)`` (the rows flattened) takes it in each of the B groups of T rows (``Layout.groups``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
from collections.abc import Callable
import torch
import torch.fx
from torch import Tensor

from loong_compile._compat.kernels import autograd_in_op_body, steady_dispatch
from loong_compile.ops.tiling.loop import Gradients, tiles

_NOTHING = (0,)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One output of a region at full length: its shape and dtype, its token axis, and how many
    groups of the entry's tokens that axis holds (the entry's axes before its own, flattened
    into it: 1 when the output keeps them)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    axis: int
    groups: int = 1


@dataclasses.dataclass(eq=False)
class Region:
    """A token-local region: ``module(entry, *others)`` returns a tuple of outputs for an entry
    of any length along ``axis``; ``outputs`` their layouts at full length."""

    module: torch.fx.GraphModule
    axis: int
    outputs: tuple[Layout, ...]
    lowering: str = "eager"          # "inductor": each function compiled once, by Inductor
    options: tuple = ()              # Inductor's options, as (name, value) pairs
    _compiled: Callable | None = None

    def forward(self, entry: Tensor, others: list[Tensor]) -> tuple[Tensor, ...]:
        with steady_dispatch():   # one compiled forward whichever step calls it
            return self._function()(entry, *others)

    def gradients(self, entry: Tensor, others: list[Tensor], grads: list[Tensor],
                  needs: list[bool]) -> list[Tensor | None]:
        """The gradients of ``[entry, *others]`` that ``needs`` marks (None elsewhere), given
        the outputs' ``grads``: the region run again with autograd, then its backward."""
        with autograd_in_op_body():
            inputs = [t.detach().requires_grad_(need) for t, need in zip([entry, *others], needs)]
            outputs = self._function()(*inputs)
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True) if pairs else [None] * len(wanted))
        return [next(found) if need else None for need in needs]

    def _function(self) -> Callable:
        """The region as one function, compiled once (per tile shape and grad mode: Dynamo's
        guards) under ``lowering="inductor"``."""
        if self._compiled is None:
            function = _call(self.module, f"tiled_region_{id(self):x}")
            if self.lowering == "inductor":
                function = torch.compile(function, backend="inductor", fullgraph=True,
                                         dynamic=False, options=dict(self.options) or None)
            self._compiled = function
        return self._compiled


_REGIONS: dict[str, Region] = {}


def register_region(region: Region) -> str:
    """Keep ``region`` for the op to run; its key is its content (the same on every rank that
    cut the same region, and for every layer whose region is the same code)."""
    digest = hashlib.sha256(region.module.code.encode())
    digest.update(repr((region.axis, region.outputs, region.lowering, region.options)).encode())
    key = digest.hexdigest()[:24]
    _REGIONS.setdefault(key, region)
    return key


def _call(module: torch.fx.GraphModule, name: str) -> Callable:
    """The module as a function of its own code object, named ``name`` (``torch.compile`` of a
    module compiles its ``__call__``, which Dynamo does not enter under the custom op's
    ``disable``; Dynamo keeps its compiled code per code object, so each region gets one: a
    shared one would recompile for each region and stop compiling at Dynamo's recompile limit)."""
    def region(*args: Tensor) -> tuple[Tensor, ...]:
        return module(*args)

    code = region.__code__.replace(co_name=name)
    return types.FunctionType(code, region.__globals__, name, None, region.__closure__)


# -- cutting tiles ---------------------------------------------------------------------------------

def _entry_tile(entry: Tensor, axis: int, start: int, length: int, tile: int) -> Tensor:
    """The entry's tokens [start, start + length) along ``axis``, padded to ``tile`` with copies
    of the last one, contiguous (the region's views expect it)."""
    part = entry.narrow(axis, start, length)
    if length < tile:
        shape = list(part.shape)
        shape[axis] = tile - length
        part = torch.cat([part, part.narrow(axis, length - 1, 1).expand(shape)], axis)
    return part.contiguous()


def _grouped(value: Tensor, layout: Layout, tokens: int) -> Tensor:
    """``value`` viewed with its token axis as (groups, tokens, rest)."""
    shape = list(value.shape)
    size = shape[layout.axis]
    rest = size // (layout.groups * tokens)
    return value.view(shape[:layout.axis] + [layout.groups, tokens, rest] + shape[layout.axis + 1:])


def _output_slice(out: Tensor, layout: Layout, size: int, start: int, length: int) -> Tensor:
    """The part of a full-length output that the tile [start, start + length) computes."""
    return _grouped(out, layout, size).narrow(layout.axis + 1, start, length)


def _tile_part(part: Tensor, layout: Layout, tile: int, length: int) -> Tensor:
    """A tile's output without its padding, shaped as ``_output_slice``."""
    return _grouped(part, layout, tile).narrow(layout.axis + 1, 0, length)


def _grad_tile(grad: Tensor, layout: Layout, size: int, start: int, length: int,
               tile: int) -> Tensor:
    """An output gradient's slice for one tile, zero-padded to ``tile``, in the tile's shape."""
    part = _output_slice(grad, layout, size, start, length)
    if length < tile:
        shape = list(part.shape)
        shape[layout.axis + 1] = tile - length
        part = torch.cat([part, part.new_zeros(shape)], layout.axis + 1)
    shape = list(grad.shape)
    shape[layout.axis] = shape[layout.axis] // size * tile
    return part.reshape(shape)


# -- the ops ---------------------------------------------------------------------------------------

def _full(entry: Tensor, layout: Layout) -> Tensor:
    return entry.new_empty(layout.shape, dtype=layout.dtype)


@torch.library.custom_op("loong::tiled_region", mutates_args=())
def tiled_region(key: str, tile: int, entry: Tensor, others: list[Tensor]) -> list[Tensor]:
    """The region's outputs, computed ``tile`` tokens of ``entry`` at a time."""
    region = _REGIONS[key]
    size = entry.size(region.axis)
    outs = [_full(entry, layout) for layout in region.outputs]
    with torch.no_grad():
        for start, length in tiles(size, tile):
            parts = region.forward(_entry_tile(entry, region.axis, start, length, tile), others)
            for out, part, layout in zip(outs, parts, region.outputs):
                _output_slice(out, layout, size, start, length).copy_(
                    _tile_part(part, layout, tile, length))
    return outs


@tiled_region.register_fake
def _(key, tile, entry, others):
    return [_full(entry, layout) for layout in _REGIONS[key].outputs]


@torch.library.custom_op("loong::tiled_region_backward", mutates_args=())
def tiled_region_backward(key: str, tile: int, entry: Tensor, others: list[Tensor],
                          grads: list[Tensor], needs: list[bool]) -> list[Tensor]:
    """``[dL/dentry, *dL/dothers]`` (empty where ``needs`` is False), each tile recomputed."""
    region = _REGIONS[key]
    size = entry.size(region.axis)
    sums = Gradients([entry] if needs[0] else [], [region.axis],
                     [o if need else None for o, need in zip(others, needs[1:])])
    for start, length in tiles(size, tile):
        found = region.gradients(
            _entry_tile(entry, region.axis, start, length, tile), others,
            [_grad_tile(g, layout, size, start, length, tile) for g, layout in zip(grads, region.outputs)],
            needs)
        if needs[0]:   # an entry the outputs do not depend on has a zero gradient
            rows = sums.rows(0, start, length)
            if found[0] is None:
                rows.zero_()
            else:
                rows.copy_(found[0].narrow(region.axis, 0, length))
        for j, grad in enumerate(found[1:]):
            if needs[j + 1] and grad is not None:
                sums.add(j, grad)
    tokens, params = sums.result()
    # a new empty tensor for each gradient not wanted (a frozen weight, as LoRA's base): an op's
    # returns may not alias one another
    return [tokens[0] if needs[0] else entry.new_empty(_NOTHING),
            *(entry.new_empty(_NOTHING) if p is None else p for p in params)]


@tiled_region_backward.register_fake
def _(key, tile, entry, others, grads, needs):
    empty = entry.new_empty(_NOTHING)
    return [torch.empty_like(entry, memory_format=torch.contiguous_format) if needs[0] else empty,
            *(torch.empty_like(o, memory_format=torch.contiguous_format) if need else empty
              for o, need in zip(others, needs[1:]))]


def _setup_context(ctx, inputs, output) -> None:
    key, tile, entry, others = inputs
    ctx.key, ctx.tile, ctx.count = key, tile, len(others)
    ctx.save_for_backward(entry, *others)


def _backward(ctx, grads):
    entry, *others = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    of_others = wanted[3] if isinstance(wanted[3], (list, tuple)) else [wanted[3]] * ctx.count
    needs = [bool(wanted[2]) and entry.is_floating_point(),
             *(bool(w) and o.is_floating_point() for w, o in zip(of_others, others))]
    region = _REGIONS[ctx.key]
    grads = [torch.zeros(layout.shape, dtype=layout.dtype, device=entry.device) if g is None else g
             for g, layout in zip(grads, region.outputs)]
    result = torch.ops.loong.tiled_region_backward(ctx.key, ctx.tile, entry, others, grads, needs)
    d_entry = result[0] if needs[0] else None
    return None, None, d_entry, [g if need else None for g, need in zip(result[1:], needs[1:])]


tiled_region.register_autograd(_backward, setup_context=_setup_context)
