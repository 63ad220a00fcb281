"""Attention sinks: one learned logit per head that joins every query's softmax (gpt-oss).

A query's softmax runs over its scores and the sink ``s``; the sink's value is zero, so the
output is attention without the sink scaled by the share the keys keep::

    out = out_keys * exp(lse_keys - lse),   lse = logaddexp(lse_keys, s)

That needs only the row's ``(out, lse)`` after every KV block and rank was merged, so the
2D-Attention ops apply it once at the end of their forward: the sink is counted once per query
whatever the ring or the exchange did.  Their backward op is handed this ``out`` and ``lse``:
with them its probabilities are the sink-including ones, and ``D = rowsum(dout * out)`` is what
the sink's zero value leaves it, so dq, dk and dv are exact as they stand.  The sink's own
gradient is ``-exp(s - lse) * D`` per row (``sinks_gradient``), summed over rows by autograd.

The ops take the sinks per query row, ``(B, H, S_q)`` like the LSE, so that ``attention_2d``
moves them through the head all-to-all with the queries (``hp > 1``) without knowing which heads
a rank holds.  ``sdpa_with_sinks`` is the one-process definition, what
``passes/attention/eager_attention.py`` writes in place of gpt-oss's eager chain.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loong_compile.ops.attention.kernels import accumulation_dtype, token_major


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of attention over the keys turned into attention over the keys and the sink
    (``sinks``: ``lse``'s shape); a row that saw no key returns zeros, as one process does."""
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype))
    kept = torch.exp(lse - total).unsqueeze(-1)
    return token_major((out.to(lse.dtype) * kept).to(out.dtype)), total.contiguous()


def sinks_gradient(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sink per row, from the forward's final ``out`` and ``lse``."""
    acc = accumulation_dtype(out.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return (-torch.exp(sinks.to(acc) - lse.to(acc)) * delta).to(sinks.dtype)


def sdpa_with_sinks(query: Tensor, key: Tensor, value: Tensor, sinks: Tensor,
                    attn_mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """``F.scaled_dot_product_attention`` whose softmax also counts ``sinks`` (one logit per
    head, ``(H,)``), in one process: the definition 2D-Attention's ``sinks=`` computes."""
    scale = query.size(-1) ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, value)
