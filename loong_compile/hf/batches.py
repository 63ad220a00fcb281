"""One collated batch of a Hugging Face collator, cut into this rank's share of its tokens.

The collators a ``transformers.Trainer`` or ``trl.SFTTrainer`` uses give full ``(B, S)`` rows
in one of three layouts, told apart by their keys:

* **padded rows** (``DataCollatorForLanguageModeling``, TRL's default collator, a tokenizer's
  ``padding``): ``input_ids``, ``labels`` and the 0/1 ``attention_mask`` (right or left
  padding; padded labels ``-100``);
* **packed rows** (``DataCollatorWithFlattening``, TRL's ``padding_free`` and BFD packing):
  ``input_ids``, ``labels`` and ``position_ids`` restarting at 0 at every document, no
  attention mask; flash-attn's ``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` are the same
  documents again and are read from the positions instead;
* **plain rows** (every row full): ``input_ids`` and ``labels``.

``cut_batch`` pads the rows to the multiple of ``2·cp·hp`` tokens the layout needs (and of the
user's ``pad_to_multiple_of``: masked and packed rows compile for one length; pad tokens
labelled ``-100``: with an attention mask they are masked out; in packed rows they are a new
document at the end; in plain rows the causal mask already keeps them from every real token),
then cuts them with ``loong_compile.shard_batch``, which shifts the labels over the whole
sequence.  ``count_labels`` is what the Trainer counts for ``num_items_in_batch``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from loong_compile.errors import LoongConfigError, LoongShapeError
from loong_compile.parallel.rules import sequence_divisor
from loong_compile.parallel.tokens import IGNORE_INDEX, ShardedBatch, packed_positions, shard_batch

# the keys the model is called with, and the packed-row keys that repeat the positions' documents
MODEL_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
DOCUMENT_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


def count_labels(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """How many next-token labels of the batch are not ``-100`` (0-dim int64): the labels
    shifted by one, as the Trainer counts ``num_items_in_batch`` for a causal LM."""
    return (inputs["labels"][:, 1:] != IGNORE_INDEX).sum()


def check_keys(inputs: Mapping[str, object]) -> None:
    """Refuse a batch this module cannot cut exactly (keys it does not know, no labels)."""
    unknown = sorted(set(inputs) - MODEL_KEYS - DOCUMENT_KEYS)
    if unknown:
        raise LoongConfigError(
            f"the collator's batch has keys {unknown}",
            f"loong_compile.hf cuts batches of {sorted(MODEL_KEYS)} (and the packed-row keys "
            f"{sorted(DOCUMENT_KEYS)}, read from position_ids); any other input would reach the "
            "model whole on every rank, or not at all",
            "use a collator that returns these keys only (DataCollatorForLanguageModeling, "
            "DataCollatorWithFlattening, TRL's SFT collator), or drop the others in your collator")
    if "input_ids" not in inputs or "labels" not in inputs:
        raise LoongConfigError(
            f"the collator's batch has keys {sorted(inputs)}",
            "a batch has input_ids and labels (the loss is computed in the compiled graph)",
            "use a language-modeling collator, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False)")


def padded_length(length: int, mesh, pad_to_multiple_of: int | None = None) -> int:
    """``length`` rounded up to a multiple of the layout's ``2·cp·hp`` (``hp`` when
    ``cp = 1``) and of ``pad_to_multiple_of``."""
    multiple = math.lcm(sequence_divisor(mesh.cp, mesh.hp), pad_to_multiple_of or 1)
    return -(-length // multiple) * multiple


def cut_batch(inputs: Mapping[str, torch.Tensor], mesh, *, pad_token_id: int,
              pad_to_multiple_of: int | None = None) -> ShardedBatch:
    """This rank's tokens of the collated ``inputs``, the rows first padded on the right to
    ``padded_length``; labels shifted over the whole sequence, ``num_labels`` counting the
    whole batch (padding added here is labelled ``-100``)."""
    check_keys(inputs)
    input_ids, labels = inputs["input_ids"], inputs["labels"]
    attention_mask, position_ids = inputs.get("attention_mask"), inputs.get("position_ids")
    documents = None
    if position_ids is not None and attention_mask is None:
        documents = _documents(position_ids)
    elif position_ids is not None:
        _check_plain_positions(position_ids, attention_mask)

    missing = padded_length(input_ids.size(1), mesh, pad_to_multiple_of) - input_ids.size(1)
    if missing:
        input_ids = F.pad(input_ids, (0, missing), value=pad_token_id)
        labels = F.pad(labels, (0, missing), value=IGNORE_INDEX)
        if attention_mask is not None:
            attention_mask = F.pad(attention_mask, (0, missing), value=0)
        if documents is not None:   # the pad is one more document, seen by no real token
            documents = torch.cat([documents, (documents[:, -1:] + 1).expand(-1, missing)], dim=1)
    return shard_batch(input_ids, labels, mesh, document_ids=documents, attention_mask=attention_mask)


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids of packed rows: a new document wherever the position ids restart at 0."""
    starts = position_ids == 0
    if not bool((position_ids == packed_positions(starts)).all()):
        raise LoongShapeError(
            "position_ids without an attention_mask that do not count 0, 1, 2, ... within each "
            "document",
            "packed rows (DataCollatorWithFlattening, TRL's padding_free) give position ids that "
            "restart at 0 at each document and go up by one: the documents are read from them",
            "use one of those collators, or give an attention_mask and positions 0..S-1")
    return starts.long().cumsum(dim=1)


def _check_plain_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Padded rows may carry position ids (TRL's ``return_position_ids``): shard_batch gives
    every token its index in the row, so the real tokens must already have exactly that."""
    index = torch.arange(position_ids.size(1), device=position_ids.device).expand_as(position_ids)
    if not bool((position_ids == index)[attention_mask.bool()].all()):
        raise LoongShapeError(
            "position_ids with an attention_mask whose real tokens are not at positions 0..S-1 "
            "of their row (left padding with positions counted from the first real token?)",
            "with an attention_mask, a token's position is its index in the row (as transformers "
            "computes it when no position_ids are given)",
            "drop position_ids from the batch, or pad on the right")
