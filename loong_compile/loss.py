"""The next-token loss, in the form the compiler chunks: compile it with the model.

The LM-head pass (``passes/tiling/lm_head.py``) turns the projection to the vocabulary and the
loss after it into one token-chunked op, but only when the loss is computed inside the compiled
graph and the logits are not returned.  ``NextTokenLoss(model)`` is that graph in one line::

    step = torch.compile(lc.NextTokenLoss(model), backend="loong", options={...})
    batch = lc.shard_batch(input_ids, input_ids, mesh)
    loss = step(batch.input_ids, batch.labels, batch.num_labels, position_ids=batch.position_ids)
    loss.backward()

Under ``hp * cp > 1`` each rank's loss is its share: the sum over its tokens divided by the
number of labels of the whole batch (``batch.num_labels``), so the ranks' losses and gradients
add up to one process's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from loong_compile.parallel.tokens import IGNORE_INDEX


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor,
                    num_labels: torch.Tensor | int) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(..., V)`` against already-shifted ``labels`` (``-100``:
    ignored), summed in float32 at least and divided by ``num_labels``, the count of labels
    that are not ignored in the whole batch (every rank of the sequence passes the same)."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.flatten(0, -2).to(wide), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum") / num_labels


class NextTokenLoss(torch.nn.Module):
    """``model`` followed by ``next_token_loss``: ``forward(inputs, labels, num_labels,
    **model_kwargs)`` returns the loss.  ``model`` returns logits or an object with
    ``.logits`` (transformers' causal LMs, whose final-logit softcapping or scaling is part of
    their forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, num_labels: torch.Tensor | int,
                **model_kwargs: Any) -> torch.Tensor:
        out = self.model(inputs, **model_kwargs)
        return next_token_loss(getattr(out, "logits", out), labels, num_labels)
