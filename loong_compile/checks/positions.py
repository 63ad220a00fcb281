"""Each call's position ids against the token layout (one of the input checks, ``inputs.py``).

Under ``hp·cp > 1`` each rank holds the tokens that the layout of ``parallel/tokens.py`` gives
it, and the position ids are how the model learns which: RoPE rotates, and learned position
embeddings look up, by them.  Position ids that are not the layout's (a batch not cut with
``shard_batch``, positions made by hand or for another mesh) make every result silently wrong.
So before each call of a graph that takes position ids (whatever the argument's name: the
attention pass finds them by how they flow, into RoPE's angle or a mask's documents; and the
input named ``position_ids``), each rank compares them with what the layout says it holds (one
comparison of a ``(B, S_local)`` integer tensor), and the verdicts of the sequence's ranks are
exchanged with the other checks' findings, so that either all of them raise, before the graph's
first collective, or none does.  The exchange is needed: the first rank legitimately holds
positions ``0..S_local-1``, so its own check passes when nobody called ``shard_batch``.

The rule.  A rank's positions are accepted when they are the layout's (``OK``) or packed
documents (``PACKED``: each position counts from a document start at or before its token,
``0 <= position <= global position``, and along tokens that are neighbours in the sequence it
goes up by one or restarts at 0) -- the packed-sequence convention of transformers, whose global
document structure ``sequence_document_ids`` rebuilds from the same positions, so the graph
computes what one process computes with them.  A rank whose positions are exactly
``0..S_local-1`` (``LOCAL``) holds a document starting at its first token, which is accepted
unless *every* rank of the sequence holds ``0..S_local-1``: that is what positions counted per
rank look like (no ``shard_batch``, or the whole sequence fed to every rank), and is refused
(documents that all start exactly on the ranks' first tokens are refused with it).  Anything
else (``OTHER``), or a length the layout cannot split (``LENGTH``), is refused.  The rule needs
no rank's positions but its own: a gather of the positions would need equal shapes on every
rank, which is what the check cannot assume.

Positions every rank accepted under every graph's rule (no balanced order) are remembered, by
the tensor and its version, until it changes or dies: the blocks of a model compiled one by one
(``loong_compile/blocks.py``) receive the same position ids, and only the first compares them.
Every rank skips alike: the ranks run the same program on tensors of the same history.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from loong_compile.checks.exchange import RankCheck
from loong_compile.errors import LoongError, LoongShapeError
from loong_compile.parallel.tokens import layout_positions

_CACHED_LENGTHS = 16
# id -> (weak reference, version, the sequence's group) of position ids every rank accepted
_VERIFIED: dict[int, tuple[weakref.ref, int, str]] = {}


class Verdict(enum.IntEnum):
    """One rank's finding, ordered so that the largest across ranks picks the error."""

    OK = 0
    PACKED = 1    # counted from document starts at or before each token: packed documents
    BALANCED = 2  # 0 <= position <= global position otherwise: maybe shard_batch's balanced
                  # document order, which sequence_document_ids verifies (refused unless the
                  # graph's every attention is a causal mask of documents from the positions)
    LOCAL = 3     # 0..S_local-1: a document starting at the rank's first token, or the rank's
                  # own tokens counted from 0 (refused when every rank holds 0..S_local-1)
    OTHER = 4     # anything else that is not the layout's
    LENGTH = 5    # S_local·hp·cp is no sequence length the layout can split


CAUSES = {
    Verdict.BALANCED: "positions are not packed documents in the layout; if they are "
                      "shard_batch(..., balance_documents=True)'s order, only a graph whose "
                      "every attention is a causal mask of documents from the positions (and "
                      "no key padding) computes them exactly, and this graph's is not",
    Verdict.LOCAL: "positions count this rank's own tokens from 0 (as on every rank of the "
                   "sequence)",
    Verdict.OTHER: "positions are not those of the tokens the layout gives the rank",
    Verdict.LENGTH: "the local length times hp*cp is no sequence length the layout can split",
}


class PositionCheck(RankCheck):
    """Compares argument ``index`` (the position ids; ``source``: where the compiled function
    got them, when not as ``position_ids``) with the layout of ``mesh`` at each call.
    ``balanced_exact``: the graph computes documents in the balanced order exactly, so
    ``BALANCED`` positions are let through to be verified there; ``labels_shifted``: the graph
    shifts labels in the sequence's order, which the refusal of ``BALANCED`` says."""

    rows = 2   # the rank's verdict; whether it holds exactly 0..S_local-1

    def __init__(self, mesh: Any, index: int, source: str | None = None,
                 balanced_exact: bool = False, labels_shifted: bool = False):
        self.mesh = mesh
        self.index = index
        self.source = source
        self.balanced_exact = balanced_exact
        self.labels_shifted = labels_shifted
        self._expected: dict[tuple, torch.Tensor] = {}

    def wanted(self, args: Sequence[Any]) -> bool:
        return not _verified(args[self.index], self.mesh)

    def local(self, args: Sequence[Any]) -> torch.Tensor:
        return self.verdict(args[self.index])

    def judge(self, found: list[list[float]], args: Sequence[Any]) -> None:
        positions = args[self.index]
        verdicts = [Verdict(int(v)) for v in found[0]]
        holds_arange = [bool(f) for f in found[1]]
        failing = {rank: v for rank, v, bad in zip(
            self.mesh.sp_ranks, verdicts, refused(verdicts, holds_arange, self.balanced_exact))
            if bad}
        if failing:
            raise _error(failing, self.mesh, positions.shape[-1] if positions.dim() else 0,
                         self.detail(positions), self.source, self.labels_shifted)
        if not any(refused(verdicts, holds_arange)):
            _remember(positions, self.mesh)

    def verdict(self, positions: torch.Tensor) -> torch.Tensor:
        """``(verdict, holds 0..S_local-1)`` of this rank, as a device tensor (no host read)."""
        if positions.dim() == 0:
            return torch.tensor([Verdict.OTHER, 0], device=positions.device)
        try:
            expected = self._expected_for(positions.shape[-1], positions)
        except LoongShapeError:
            return torch.tensor([Verdict.LENGTH, 0], device=positions.device)
        return classify(positions, expected)

    def detail(self, positions: torch.Tensor) -> str:
        """What this rank holds instead of the layout's positions (read only to explain)."""
        if positions.dim() == 0:
            return f"position_ids is a scalar ({positions.item()})"
        local_len = positions.shape[-1]
        try:
            expected = self._expected_for(local_len, positions)
        except LoongShapeError as e:
            return str(e)
        rows = positions.reshape(-1, local_len)
        row = next((r for r in rows if not torch.equal(r, expected)), None)
        if row is None:
            return ""
        return (f"rank {self.mesh.rank} holds positions {describe(expected)}, its "
                f"position_ids are {describe(row)}")

    def _expected_for(self, local_len: int, like: torch.Tensor) -> torch.Tensor:
        key = (local_len, like.device, like.dtype)
        if key not in self._expected:
            if len(self._expected) >= _CACHED_LENGTHS:
                self._expected.clear()
            self._expected[key] = layout_positions(local_len, self.mesh).to(like.device, like.dtype)
        return self._expected[key]


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:   # an inference tensor keeps no version: never remembered
        return None


def _verified(positions: Any, mesh: Any) -> bool:
    entry = _VERIFIED.get(id(positions))
    return (entry is not None and entry[0]() is positions and entry[2] == mesh.group_names["sp"]
            and entry[1] == _version(positions))


def _remember(positions: torch.Tensor, mesh: Any) -> None:
    version = _version(positions)
    if version is None:
        return
    key = id(positions)

    def forget(ref: weakref.ref) -> None:
        if _VERIFIED.get(key, (None,))[0] is ref:
            del _VERIFIED[key]

    _VERIFIED[key] = (weakref.ref(positions, forget), version, mesh.group_names["sp"])


def refused(verdicts: Sequence[Verdict], holds_arange: Sequence[bool],
            balanced_exact: bool = False) -> list[bool]:
    """Which ranks of a sequence to refuse, from every rank's verdict and whether it holds
    exactly ``0..S_local-1`` (the rule of the module's docstring)."""
    counted_per_rank = all(holds_arange)
    return [v >= Verdict.OTHER or (v is Verdict.LOCAL and counted_per_rank)
            or (v is Verdict.BALANCED and not balanced_exact) for v in verdicts]


def classify(positions: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``(verdict, holds 0..S_local-1)`` for ``positions`` (``(..., S_local)``) against
    ``expected`` (``(S_local,)``), computed on their device."""
    local = (positions == torch.arange(len(expected), device=positions.device)).all()
    # packed: each token's position counts from its document's start, which is at or before
    # the token: 0 <= position <= global position, and along tokens that are neighbours in
    # the sequence the position goes up by one or restarts at 0
    neighbours = expected[1:] == expected[:-1] + 1
    steps_ok = ((positions[..., 1:] == positions[..., :-1] + 1) | (positions[..., 1:] == 0)
                | ~neighbours)
    counted = ((positions >= 0) & (positions <= expected)).all()
    packed = counted & steps_ok.all()
    verdict = torch.where((positions == expected).all(), int(Verdict.OK),
                          torch.where(local, int(Verdict.LOCAL),
                                      torch.where(packed, int(Verdict.PACKED),
                                                  torch.where(counted, int(Verdict.BALANCED),
                                                              int(Verdict.OTHER)))))
    return torch.stack([verdict, local.long()])


def describe(positions: torch.Tensor, most: int = 4) -> str:
    """``"0-3, 12-15"``: a 1-D tensor of positions as runs of consecutive values."""
    values = positions.tolist()
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs[:most])
    return text + (", ..." if len(runs) > most else "")


def _error(failing: dict[int, Verdict], mesh: Any, local_len: int, detail: str,
           source: str | None, labels_shifted: bool = False) -> LoongError:
    """The same error class and rule on every rank of the sequence; each adds its own detail."""
    worst = max(failing.values())
    causes = "; ".join(f"rank {rank}: {CAUSES[v]}" for rank, v in sorted(failing.items()))
    given = f" (the compiled function's {source})" if source else ""
    what = (f"position_ids{given} of {local_len} tokens per rank (a {local_len * mesh.sp}-token "
            f"sequence) do not match the token layout of hp={mesh.hp}, cp={mesh.cp}, "
            f"placement={mesh.placement!r} on ranks {sorted(failing)} ({causes})"
            + (f"; {detail}" if detail else ""))
    shard = ("cut each full (B, S) batch with loong_compile.shard_batch(input_ids, labels, mesh) "
             f"for mesh = init_mesh(hp={mesh.hp}, cp={mesh.cp}, placement={mesh.placement!r}) "
             "and pass position_ids=batch.position_ids")
    if worst is Verdict.BALANCED and labels_shifted:
        return LoongShapeError(
            what, "the model shifts its labels by one token (labels= without shift_labels=), "
            "which is the next token of the sequence; in shard_batch's balanced order the next "
            "token of a reordered row is not the next of its document",
            "pass labels=batch.labels, shift_labels=batch.labels and "
            "num_items_in_batch=batch.num_labels (shard_batch shifted them in each document), "
            "or cut the batch without balance_documents")
    if worst is Verdict.BALANCED:
        return LoongShapeError(
            what, "documents in shard_batch's balanced order are exact only where every "
            "attention call is causal and reads its documents from the position ids: any other "
            "mask would mix the reordered tokens", "call the model without an attention_mask "
            "(transformers then finds the packed documents in position_ids), or cut the batch "
            "without balance_documents")
    if worst is Verdict.LENGTH:
        return LoongShapeError(
            what, "position_ids holds S_local tokens of a sequence of S_local*hp*cp, which the "
            "layout must split", shard)
    return LoongShapeError(
        what, "under hp*cp > 1 a rank holds some tokens of a longer sequence; its position_ids "
        "are their global positions in the layout (see docs/usage.md, \"Sharding the inputs\")",
        shard)
