"""Labels the graph shifts, given already shifted (one of the input checks, ``inputs.py``).

``labels=`` means unshifted labels everywhere in transformers: its loss shifts them by one token,
and the ``sequence_loss`` pass makes that shift the sequence's (each token gets the label of the
token after it).  ``shard_batch`` returns ``labels`` already shifted over the whole sequence (for
``shift_labels=`` and ``lc.next_token_loss``); given to ``labels=`` they would be shifted twice,
each token trained on the token two places on, with nothing to show it.  The pass leaves the
graph inputs its shifts read (``SHIFTED_LABEL_INPUTS``); before each call every rank asks
``shard_batch``'s record whether the tensor given there is labels it shifted, or a view of them
(a copy is not followed: telling it would mean reading its values), and the ranks' answers are
exchanged with the other checks' findings, so that every rank refuses or none does.

Refused rather than taken as ``shift_labels=``: one process would shift the same call's labels
twice too, and reading ``labels=`` as shifted because of where the tensor came from would make
one call mean two things.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loong_compile.checks.exchange import RankCheck
from loong_compile.errors import LoongShapeError
from loong_compile.parallel.tokens import SHIFTED, made_with


class ShiftedLabelsCheck(RankCheck):
    """Refuses a call whose labels the graph shifts (arguments ``indices``; ``sources``: where
    the compiled function got each) when they are ``shard_batch``'s shifted labels."""

    def __init__(self, mesh: Any, indices: Sequence[int], sources: Sequence[str | None]):
        self.mesh = mesh
        self.indices = list(indices)
        self.sources = list(sources)

    def local(self, args: Sequence[Any]) -> Sequence[float]:
        return [float(any(made_with(args[i], SHIFTED) for i in self.indices))]

    def judge(self, found: list[list[float]], args: Sequence[Any]) -> None:
        ranks = [rank for rank, flag in zip(self.mesh.sp_ranks, found[0]) if flag]
        if not ranks:
            return
        given = ", ".join(source or f"graph input {i}" for i, source in
                          zip(self.indices, self.sources))
        raise LoongShapeError(
            f"the labels the model shifts ({given}) are shard_batch's batch.labels, which it "
            f"already shifted by one token over the whole sequence (ranks {ranks})",
            "labels= holds unshifted labels, as everywhere in transformers: the model's loss "
            "shifts them by one token (across the ranks, by the layout), so shifted labels would "
            "be shifted twice and every token trained on the token two places on",
            "pass labels=batch.input_ids (or your unshifted labels, cut by shard_batch like the "
            "input ids), or shift_labels=batch.labels together with labels=batch.labels (the "
            "loss then takes shift_labels as they are; add num_items_in_batch=batch.num_labels)")
