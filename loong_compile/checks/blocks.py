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

The rule: before each call of such a graph, every rank asks ``shard_batch``'s record whether a
batch it cut from packed documents, or with padding, is alive in the process, and the ranks'
answers are exchanged with the other checks' findings; any yes refuses the call on every rank.
Plain rows need no mask: blocks called on them run, and are exact.

False positives (refused, yet exact): a model that ignores documents in one process too
(transformers with its cache on, ``use_cache`` at its default, reads no documents from the
positions); a batch of plain rows run while another, packed or padded, is kept alive; a whole
model called with ``inputs_embeds`` (no token ids) on such a batch without a mask of its
documents.  The fix for each: compile the whole model, or block by block with
``loong_compile.hf.compile_blocks`` (whose blocks build their masks inside), or drop the other
batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loong_compile.checks.exchange import RankCheck
from loong_compile.errors import LoongUnsupportedError
from loong_compile.parallel.tokens import PACKED, PADDED, alive_with


class BlindGraphCheck(RankCheck):
    """Refuses a call of a graph blind to the batch while ``shard_batch`` has a batch of packed
    documents or of padded rows alive."""

    rows = 2   # a batch of packed documents alive; of padded rows

    def __init__(self, mesh: Any):
        self.mesh = mesh

    def local(self, args: Sequence[Any]) -> Sequence[float]:
        return [float(alive_with(PACKED)), float(alive_with(PADDED))]

    def judge(self, found: list[list[float]], args: Sequence[Any]) -> None:
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
