"""Token tiling: how many tokens one tile holds.  One place, torch-free, for the compiler and
the estimator.

A token-local region (an MLP of any family, the LM head and its loss) runs a tile of tokens at
a time (docs/architecture.md, "Token tiling"): only one tile's intermediates exist at once.
Fewer, larger tiles are faster (each tile pays a call and a pass over the weights; axolotl
measured 3.2x between ALST's default tiles and larger ones), so the rule takes the largest
tile the memory allows:

``tile_tokens(tokens, bytes_per_token, budget)``: the largest tile whose intermediates
(``bytes_per_token`` for each token) fit ``budget`` bytes, a multiple of ``TILE_ALIGN``
tokens (matmul tiles) when it is that large; all the tokens in one tile (no tiling) when they
fit.  ``balanced_tile`` spreads the tokens evenly over as many tiles: a compiled region runs
one tile shape and pads the last tile, so an even split pads fewer than ``TILE_ALIGN`` tokens
a tile (at most) where the largest tile could pad almost a whole one.

Readers: ``passes/tiling/regions.py`` (an MLP's tile, ``region_tile``, option ``tile_tokens``),
``estimate/lm_head.py::chunk_tokens`` (the LM head's, option ``lm_head_chunk``) and the
estimator's model of tiling.
"""

from __future__ import annotations

# ``auto``'s budget for one tile of a region's intermediates (every value the region computes
# between its input and its output, at once): small beside a GPU's memory and beside the layer's
# other working set at long sequence (attention's q, k, v and output over the local tokens),
# large enough that a tile's matmuls keep a device busy.  At Llama-3.1-8B's MLP (4 x 14,336
# bf16 values a token) it is 9,344 tokens a tile; a region whose intermediates fit it whole
# (the test suite's models, or 16,384 tokens of a Llama-3.2-1B-shaped model in float32 on CPU)
# is not tiled.
TILE_BYTES = 2 ** 30
TILE_ALIGN = 64


def tile_tokens(tokens: int, bytes_per_token: int, budget: int, align: int = TILE_ALIGN) -> int:
    """Tokens per tile: the largest multiple of ``align`` (any count below ``align``) whose
    ``bytes_per_token`` each fit ``budget``; at least 1, at most ``tokens`` (one tile:
    nothing to tile)."""
    tokens = int(tokens)
    fit = int(budget) // max(1, int(bytes_per_token))
    if fit >= tokens:
        return max(1, tokens)
    return fit - fit % align if fit >= align else max(1, fit)


def balanced_tile(tokens: int, tile: int, align: int = TILE_ALIGN) -> int:
    """As many tiles as ``tile`` needs, each as long: ``tokens`` spread evenly over them,
    rounded up to a multiple of ``align`` when ``tile`` is one; never more than ``tile``."""
    even = -(-int(tokens) // tile_count(tokens, tile))
    if tile >= align and tile % align == 0:
        even = -(-even // align) * align
    return max(1, min(int(tile), even))


def tile_count(tokens: int, tile: int) -> int:
    """How many tiles of ``tile`` tokens cover ``tokens`` (the last one padded to ``tile``)."""
    return -(-int(tokens) // max(1, int(tile)))


def region_tile(tokens: int, bytes_per_token: int, setting: int | str = "auto") -> int:
    """The tile of a token-local region under option ``tile_tokens``: ``"auto"`` (``tile_tokens``
    within ``TILE_BYTES``), a number of tokens, or 0 (off: all ``tokens`` in one tile); then
    ``balanced_tile``."""
    if setting == "auto":
        tile = tile_tokens(tokens, bytes_per_token, TILE_BYTES)
    else:
        tile = int(setting) or int(tokens)
    return balanced_tile(tokens, max(1, min(int(tokens), tile)))
