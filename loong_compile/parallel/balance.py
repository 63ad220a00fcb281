"""The balanced document order: every document dealt head/tail over the CP ranks.

With packed documents the zigzag of ``parallel/tokens.py`` balances the causal work of the
*sequence*, not of each document: a rank whose chunks hold the long documents' late tokens
does most of the work (max/mean 1.39 on the benchmark's mix).  ``shard_batch(...,
balance_documents=True)`` therefore reorders each row before the layout deals it out: every
document is padded to a multiple of ``2·cp`` tokens and cut into ``2·cp`` equal chunks, and
the row becomes [chunk 0 of every document, ..., chunk ``2·cp-1`` of every document].  The
layout's chunk ``k`` then holds chunk ``k`` of every document, so CP rank ``c`` holds chunks
``c`` and ``2·cp-1-c`` of each one: the head/tail split of PyTorch's per-document balancer
and TransformerEngine's THD layout, document by document.

The pads are tokens of their document, at its end (positions continuing it, labels -100):
under a causal mask no real token sees them, so the real tokens' outputs and losses are what
one process computes on the row without them.  The room for them comes from the row's right
padding (``attention_mask`` 0); what is left over becomes one more document of filler.
``sequence_document_ids`` recognises the order from the positions alone (ops/masks/documents.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from loong_compile.errors import LoongShapeError


class BalancedOrder(NamedTuple):
    """``(B, S)`` int64, per place of the balanced row: the original index of the token there
    (-1 for a pad or filler), and its position in its document."""

    source: torch.Tensor
    positions: torch.Tensor


def balanced_order(starts: torch.Tensor, real: torch.Tensor | None, cp: int) -> BalancedOrder:
    """The balanced order of rows whose documents start where ``starts`` (``(B, S)`` bool) is
    True, in the real prefix of each row (``real``: the attention mask, right padding only)."""
    batch, seq = starts.shape
    chunks = 2 * cp
    lengths = _real_lengths(real, batch, seq)
    source = np.empty((batch, seq), dtype=np.int64)
    positions = np.empty((batch, seq), dtype=np.int64)
    for row in range(batch):
        used = lengths[row]
        first = np.flatnonzero(starts[row, :used].cpu().numpy())
        sizes = np.diff(np.r_[first, used])
        per_chunk = -(-sizes // chunks)
        needed = int(per_chunk.sum()) * chunks
        if needed > seq:
            raise LoongShapeError(
                f"row {row}: {len(sizes)} documents in {used} tokens need {needed} once each "
                f"is padded to a multiple of 2*cp = {chunks}, and the row holds {seq}",
                "balance_documents pads every document to a multiple of 2*cp tokens inside "
                "the row's length", f"leave up to {chunks - 1} tokens of right padding "
                "(attention_mask 0) per document, or shard without balance_documents")
        filler = (seq - needed) // chunks
        if filler:
            first, sizes = np.r_[first, -1], np.r_[sizes, 0]
            per_chunk = np.r_[per_chunk, filler]
        # chunk k of the row: chunk k of every document, each at the same offset
        document = np.repeat(np.arange(len(sizes)), per_chunk)
        within = np.arange(seq // chunks) - np.r_[0, np.cumsum(per_chunk)[:-1]][document]
        offset = np.arange(chunks)[:, None] * per_chunk[document] + within  # (chunks, S/chunks)
        inside = offset < sizes[document]
        source[row] = np.where(inside, first[document] + offset, -1).ravel()
        positions[row] = offset.ravel()
    return BalancedOrder(torch.from_numpy(source), torch.from_numpy(positions))


def _real_lengths(real: torch.Tensor | None, batch: int, seq: int) -> list[int]:
    if real is None:
        return [seq] * batch
    real = real != 0
    lengths = real.sum(1)
    prefix = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(real.cpu(), prefix):
        raise LoongShapeError(
            "an attention_mask that is not right padding, with balance_documents",
            "the balanced order takes its room for padding from the end of each row",
            "pad on the right (tokenizer padding_side='right'), or shard without "
            "balance_documents")
    return lengths.tolist()


def take(values: torch.Tensor, order: BalancedOrder, fill: int) -> torch.Tensor:
    """``values`` ``(B, S)`` in the balanced order; ``fill`` at pads and filler."""
    source = order.source.to(values.device)
    return torch.where(source >= 0, values.gather(1, source.clamp(min=0)),
                       torch.full_like(values, fill))


def restore(full: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A whole ``(B, S, ...)`` sequence in the balanced order back in the original one (the
    places of the original row's padding are 0)."""
    out = torch.zeros_like(full)
    rows, places = (source >= 0).nonzero(as_tuple=True)
    out[rows, source[rows, places]] = full[rows, places]
    return out
