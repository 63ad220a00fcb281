"""A graph that cannot see the batch it runs on: a block compiled on its own (one of the input
checks, ``inputs.py``).

A model compiled block by block by hand (``model.model.layers[i] = torch.compile(layer, ...)``)
builds its attention masks outside the blocks, eagerly, from each rank's own tokens: a rank whose
tokens hold no document start, or no padded token, gets no mask, and its block runs plain causal
attention across the documents, or onto the padding, of the sequence.  Such a graph holds
attention but nothing that tells it the batch: no ``sequence_document_ids`` call (the global
documents and padding of a proven mask), no positions it makes itself (``made_positions``), no
token ids it embeds (an integer input read as an embedding's index).  Its inputs are hidden states
and RoPE's tables, whatever batch they came from.

Such blocks leave the loss outside too: ``model(ids, labels=ids)`` around them runs transformers'
loss eagerly, shifting and averaging each rank's own tokens.  The backend never compiles that
loss, but the block is called from inside the forward that computes it: its frame is on the
stack, holding ``labels``.

The rules, before each call of such a graph, on every rank: it asks ``shard_batch``'s record
whether a batch it cut from packed documents, or with padding, is alive in the process, and looks
up the Python stack for a transformers model's ``forward`` running eagerly (its class's own code
object: a forward Dynamo compiled runs code of its own, and its loss is in a graph the backend
rewrote) with ``labels`` given and no ``shift_labels``.  The ranks' answers are exchanged with the other
checks' findings; any yes refuses the call on every rank.  Plain rows need no mask: blocks called
on them, with the loss computed over the whole sequence (``lc.next_token_loss``, or
``labels=`` with ``shift_labels=batch.labels`` and ``num_items_in_batch=batch.num_labels``), run
and are exact.

False positives (refused, yet exact): a model that ignores documents in one process too
(transformers with its cache on, ``use_cache`` at its default, reads no documents from the
positions); a batch of plain rows run while another, packed or padded, is kept alive; a whole
model called with ``inputs_embeds`` (no token ids) on such a batch without a mask of its
documents.  The fix for each: compile the whole model, or block by block with
``loong_compile.hf.compile_blocks`` (whose blocks build their masks inside), or drop the other
batch.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

from loong_compile.checks.exchange import RankCheck
from loong_compile.errors import LoongShapeError, LoongUnsupportedError
from loong_compile.parallel.tokens import PACKED, PADDED, alive_with


class BlindGraphCheck(RankCheck):
    """Refuses a call of a graph blind to the batch while ``shard_batch`` has a batch of packed
    documents or of padded rows alive."""

    rows = 3   # a batch of packed documents alive; of padded rows; an eager loss above the call

    def __init__(self, mesh: Any):
        self.mesh = mesh

    def local(self, args: Sequence[Any]) -> Sequence[float]:
        return [float(alive_with(PACKED)), float(alive_with(PADDED)),
                float(eager_loss_above() is not None)]

    def judge(self, found: list[list[float]], args: Sequence[Any]) -> None:
        if any(found[2]):
            caller = eager_loss_above() or "the model"
            raise LoongShapeError(
                f"a graph with attention that receives nothing of the batch (a block compiled on "
                f"its own) is called inside {caller}.forward(labels=...) running eagerly, on "
                f"ranks {[r for r, flag in zip(self.mesh.sp_ranks, found[2]) if flag]}",
                "under hp*cp > 1 that forward computes transformers' loss outside every compiled "
                "graph, on each rank's own tokens: it shifts labels= within the rank (losing the "
                "token after the rank's last) and averages the rank's tokens alone",
                "compile block by block with loong_compile.hf.compile_blocks(model, **options), "
                "whose head graph shifts labels= over the whole sequence, or the whole model; or "
                "pass shift_labels=batch.labels, num_items_in_batch=batch.num_labels with labels=, "
                "or compute the loss from the logits with lc.next_token_loss(logits, "
                "batch.labels, batch.num_labels) (docs/usage.md, \"Per-block compilation\")")
        what = [name for name, row in (("packed documents", found[0]), ("padding", found[1]))
                if any(row)]
        if not what:
            return
        ranks = sorted(rank for row in found for rank, flag in zip(self.mesh.sp_ranks, row)
                       if flag)
        raise LoongUnsupportedError(
            f"a graph with attention that receives nothing of the batch (no token ids, no "
            f"positions, no mask it builds: a block compiled on its own), called while a batch "
            f"shard_batch cut with {' and '.join(what)} is alive (ranks {sorted(set(ranks))})",
            "under hp*cp > 1 the model builds such a block's mask outside it, from each rank's "
            "own tokens: a rank whose tokens hold no document start or padded token gets none, "
            "and its block attends across the documents, or onto the padding, of the sequence",
            "compile the whole model (torch.compile(model, backend=\"loong\", ...)), or block by "
            "block with loong_compile.hf.compile_blocks(model, **options), whose graphs build "
            "the masks from the batch's positions; a batch of plain rows run while "
            "another batch of packed documents or padding is kept alive is refused too: drop "
            "that batch (docs/usage.md, \"Per-block compilation\")")


def eager_loss_above() -> str | None:
    """The class of the innermost transformers model on the Python stack whose own ``forward``
    runs eagerly with ``labels`` given and no ``shift_labels`` (it computes transformers' loss
    from unshifted labels outside any graph), or None.  Other modules' ``labels`` mean what
    their code does with them (``lc.NextTokenLoss`` takes them shifted, in its own graph)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward":
            local = frame.f_locals
            owner = type(local.get("self"))
            forward = getattr(owner, "forward", None)
            if (forward is not None and frame.f_code is inspect.unwrap(forward).__code__
                    and any(c.__name__ == "PreTrainedModel" for c in owner.__mro__)):
                extra = local.get("kwargs")
                shift = local.get("shift_labels",
                                  extra.get("shift_labels") if isinstance(extra, dict) else None)
                if local.get("labels") is not None and shift is None:
                    return owner.__name__
        frame = frame.f_back
    return None
