"""Closed forms of masked attention for the estimator: documents and sliding windows.

Torch-free.  Documents are taken all of one length ``L`` (the mean: packed
rows of equal documents), windows of ``w`` tokens (transformers' convention)
on the layers the model marks local.  Query-key pairs per sequence (the
FLOPs) and, for the masked direct exchange of ``ops/attention/masked.py``, the KV chunks
the busiest CP rank serves, over the ``2·(cp-1)`` chunks the Double-Ring sends.
``tests/estimate/test_estimate_masking.py`` checks both against the runtime's plan
(``ops/masks/blocks.py``) on synthetic layouts.
"""

from __future__ import annotations

import math


def causal_pairs(seq: int, window: int | None, doc_length: int | None) -> float:
    """Allowed causal (query, key) pairs of one sequence, counted as s^2/2 per document:
    ``m^2/2 + (L - m)·m`` per document of ``L`` tokens with ``m = min(window, L)``."""
    length = min(doc_length or seq, seq)
    reach = min(window or length, length)
    return seq / length * (reach * reach / 2 + (length - reach) * reach)


def kv_chunk_fraction(seq: int, cp: int, window: int | None, doc_length: int | None) -> float:
    """KV chunks the busiest CP rank sends under the direct exchange, over the ring's 2(cp-1).

    A query chunk of ``c = S/(2cp)`` tokens reads the ``ceil((r-1)/c)`` chunks before it,
    ``r = min(window, L)`` being the furthest a token looks back (documents start anywhere)."""
    if cp == 1:
        return 0.0
    chunks, chunk = 2 * cp, seq / (2 * cp)
    reach = min(window or seq, doc_length or seq, seq)
    back = math.ceil((reach - 1) / chunk) if reach > 1 else 0
    owner = [min(k, chunks - 1 - k) for k in range(chunks)]
    sends = {(owner[query], key) for query in range(chunks)
             for key in range(max(0, query - back), query) if owner[key] != owner[query]}
    served = [sum(owner[key] == rank for _, key in sends) for rank in range(cp)]
    return max(served) / (2 * (cp - 1))


def describe(window: int | None, doc_length: int | None, seq: int, cp: int | None) -> str:
    """What the estimate assumed, in words, with the factors it applied (``cp=None``: the
    bytes factor differs per configuration)."""
    parts = []
    if doc_length:
        parts.append(f"documents of {doc_length} tokens (the mean, all taken equal)")
    if window:
        parts.append(f"a sliding window of {window} tokens on every layer")
    if not parts:
        return "one causal document per sequence, no window"
    flops = causal_pairs(seq, window, doc_length) / causal_pairs(seq, None, None)
    bytes_factor = ("scaled per configuration" if cp is None else
                    f"x{kv_chunk_fraction(seq, cp, window, doc_length):.3f}")
    return (f"assumed {' and '.join(parts)}: attention FLOPs x{flops:.3f}, CP P2P bytes "
            f"{bytes_factor} (masked direct exchange)")
