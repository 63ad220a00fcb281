"""The tile loop both tiling strategies run, and the gradients they gather tile by tile.

``tiles(size, tile)``: the ``(start, length)`` of each tile along a token axis, the last one
shorter when ``tile`` does not divide ``size``.  ``Gradients``: the gradient of each token
input, written one tile's slice at a time into one buffer (a tile's tokens are its own), and of
each parameter, summed over the tiles in a wide dtype (float32 at least: a bf16 sum of partial
gradients would round at every tile where one matmul over all tokens rounds once), cast to the
parameter's dtype at the end, or scaled first (``scaled``: the gradient-in-forward strategy,
whose backward only multiplies by the loss's incoming gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def tiles(size: int, tile: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each tile of ``tile`` along an axis of ``size``."""
    tile = max(1, int(tile))
    return [(start, min(tile, size - start)) for start in range(0, size, tile)]


def wide_dtype(dtype: torch.dtype, compute: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a parameter's gradient is summed over tiles in: the wider of ``dtype`` and
    ``compute``."""
    return torch.promote_types(compute, dtype)


class Gradients:
    """Gradients gathered over the tiles: ``tokens[i]`` the shape of token input i, cut along
    its token axis ``axes[i]``; ``params[j]`` a parameter (None: no gradient), summed in
    ``wide_dtype(param, compute)``."""

    def __init__(self, tokens: Sequence[Tensor], axes: Sequence[int],
                 params: Sequence[Tensor | None], compute: torch.dtype = torch.float32):
        self.axes = list(axes)
        self.dtypes = [None if p is None else p.dtype for p in params]
        self.tokens = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tokens]
        self.params = [None if p is None else torch.zeros(p.shape, dtype=wide_dtype(p.dtype, compute),
                                                          device=p.device) for p in params]

    def rows(self, i: int, start: int, length: int) -> Tensor:
        """The slice of token input i's gradient that a tile of ``length`` at ``start`` writes."""
        return self.tokens[i].narrow(self.axes[i], start, length)

    def add(self, j: int, grad: Tensor) -> None:
        """Add one tile's gradient of parameter j."""
        self.params[j] += grad

    def result(self, cast: bool = True) -> tuple[list[Tensor], list[Tensor | None]]:
        """The token inputs' gradients and the parameters' (in their own dtype with ``cast``,
        else as summed)."""
        params = [g if g is None or not cast else g.to(dtype)
                  for g, dtype in zip(self.params, self.dtypes)]
        return self.tokens, params


def scaled(grad: Tensor, by: Tensor, dtype: torch.dtype) -> Tensor:
    """``grad * by`` in ``dtype``, the product in the wider dtype of the two: a gradient
    computed in the forward, scaled by the incoming gradient of the scalar it belongs to."""
    wide = torch.promote_types(grad.dtype, by.dtype)
    return (grad.to(wide) * by.to(wide)).to(dtype)
