"""The LM head and its loss, token-chunked: the chunk size and the bytes it costs.

One place, torch-free, for what the compiler's LM-head pass (``passes/tiling/lm_head.py``, which
calls ``chunk_tokens`` for the chunk it emits) and the estimator (the ``activations: LM head``
term of ``estimate/equations.py``, ``loong estimate`` / ``loong plan``) must agree on.

The chunked op (``loong_compile/ops/tiling/lm_head.py``) computes the loss and its gradients chunk by
chunk of ``C`` tokens during the forward (docs/architecture.md, "The LM head and the loss").
What it costs:

- kept from the forward to the backward (``kept_bytes``): the gradient of the hidden states
  (tokens x h) in their dtype, and of the head's weight (V x h) and bias (V, when there is one)
  as they were accumulated, in float32 at least (the backward scales them, then casts them to
  the parameters' dtype).  The hidden states themselves and the logits are not kept.
- while it runs (``working_bytes``): one chunk's logits in the compute dtype (float32; float64
  for a float64 model), the projection in the weights' dtype when that is narrower (bf16), and,
  for a softcapped head (Gemma), the tanh beside the logits.

The formulas take numbers or sympy symbols alike (the estimator evaluates them symbolically).
"""

from __future__ import annotations

from typing import Any

import sympy as sp

from loong_compile.estimate.tiling import tile_tokens

# ``auto`` sizes a chunk so that its logits in float32 fit this many bytes: about what one
# transformer layer's activations of a few thousand tokens take, small beside a GPU's memory,
# large enough that each chunk's matmul (C x h x V) keeps a GPU busy.
CHUNK_LOGITS_BYTES = 128 * 2 ** 20
CHUNK_ALIGN = 64           # auto chunks are a multiple of this many tokens (matmul tiles)
LOGIT_BYTES = 4            # the loss is computed in float32 at least


def chunk_tokens(tokens: int, vocab: int, setting: int | str = "auto") -> int:
    """Tokens per chunk ``C`` for ``tokens`` tokens over a ``vocab``-wide head.

    ``setting``: ``"auto"`` (the largest multiple of ``CHUNK_ALIGN`` whose float32 logits fit
    ``CHUNK_LOGITS_BYTES``, at least 1: ``estimate/tiling.py::tile_tokens``, the rule of every
    tiled region) or a number of tokens.  Never more than ``tokens``.
    """
    if setting == "auto":
        return tile_tokens(tokens, vocab * LOGIT_BYTES, CHUNK_LOGITS_BYTES, CHUNK_ALIGN)
    return max(1, min(int(tokens), int(setting)))


def compute_bytes(dtype_bytes: Any) -> Any:
    """Bytes per logit as the op computes it: float32, or the model's dtype when wider."""
    return sp.Max(LOGIT_BYTES, dtype_bytes)


def working_bytes(chunk: Any, vocab: Any, dtype_bytes: Any, softcap: bool = False) -> Any:
    """Bytes the op needs while it runs, beyond what it returns (``dtype_bytes``: the weights')."""
    compute = compute_bytes(dtype_bytes)
    narrow = sp.Piecewise((dtype_bytes, sp.StrictLessThan(dtype_bytes, LOGIT_BYTES)), (0, True))
    return chunk * vocab * (compute + narrow + (compute if softcap else 0))


def kept_bytes(tokens: Any, hidden: Any, vocab: Any, dtype_bytes: Any, bias: bool = False) -> Any:
    """Bytes the forward keeps for the backward: the gradients of the hidden states, the
    weight and the bias (computed in the forward, scaled by the loss's gradient after)."""
    return (dtype_bytes * tokens * hidden
            + compute_bytes(dtype_bytes) * vocab * (hidden + (1 if bias else 0)))
