"""Run-time checks of what a compiled graph receives: its position ids against the token layout.

Under ``hp·cp > 1`` each rank holds the tokens that the layout of ``parallel/tokens.py`` gives
it, and the position ids are how the model learns which: RoPE rotates, and
learned position embeddings look up, by them.  Position ids that are not the
layout's (a batch not cut with ``shard_batch``, positions made by hand or for
another mesh) make every result silently wrong.  So before each call of a graph
that takes position ids (whatever the argument's name: the attention pass finds
them by how they flow, into RoPE's angle or a mask's documents; and the input
named ``position_ids``), each rank compares them with what the layout says
it holds (one comparison of a ``(B, S_local)`` integer tensor), and the ranks of
the sequence exchange their verdicts (one all-reduce of ``2·hp·cp`` integers) so
that either all of them raise, before the graph's first collective, or none
does.  The exchange is needed: the first rank legitimately holds positions
``0..S_local-1``, so its own check passes when nobody called ``shard_batch``.

The rule.  A rank's positions are accepted when they are the layout's
(``OK``) or packed documents (``PACKED``: each position counts from a document
start at or before its token, ``0 <= position <= global position``, and along
tokens that are neighbours in the sequence it goes up by one or restarts at
0) -- the packed-sequence convention of transformers, whose global document
structure ``sequence_document_ids`` rebuilds from the same positions, so the
graph computes what one process computes with them.  A rank whose positions
are exactly ``0..S_local-1`` (``LOCAL``) holds a document starting at its
first token, which is accepted unless *every* rank of the sequence holds
``0..S_local-1``: that is what positions counted per rank look like (no
``shard_batch``, or the whole sequence fed to every rank), and is refused
(documents that all start exactly on the ranks' first tokens are refused with
it).  Anything else (``OTHER``), or a length the layout cannot split
(``LENGTH``), is refused.  The rule needs no rank's positions but its own: a
gather of the positions would need equal shapes on every rank, which is what
the check cannot assume.

A graph that numbers its tokens itself (``made_positions``: no position ids) has nothing to
compare; ``MadePositionsCheck`` then refuses, on every rank of the sequence, a batch every rank
holds whole (their token checksums equal) and a batch ``shard_batch`` cut from packed documents
(their documents live in the position ids the call left out).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from loong_compile._compat.distributed import resolve_process_group
from loong_compile._compat.dynamo import placeholder_sources
from loong_compile.parallel.tokens import cut_from_packed_documents, layout_positions
from loong_compile.errors import LoongError, LoongShapeError

_CACHED_LENGTHS = 16


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


def graph_input_index(gm: torch.fx.GraphModule, name: str) -> int | None:
    """Index of the graph input that is the compiled function's argument ``name`` (given
    directly or among its ``**kwargs``: ``L['position_ids']``, ``L['kwargs']['position_ids']``),
    or None."""
    pattern = re.compile(rf"L\['{name}'\]|L\['\w+'\]\['{name}'\]")
    for index, source in enumerate(placeholder_sources(gm)):
        if source is not None and pattern.fullmatch(source):
            return index
    return None


def checking_positions(compiled: Callable, gm: torch.fx.GraphModule, mesh: Any,
                       found: dict[int, str], balanced_exact: bool = False,
                       labels_shifted: bool = False, made_positions: Sequence[int] = ()
                       ) -> tuple[Callable, dict[str, Any] | None]:
    """``compiled``, checking its position ids before each call when ``gm`` takes them and
    ``mesh`` splits sequences over more than one rank; and the report's summary of that
    decision (None on one rank of a sequence, where positions are the user's own business).

    ``found``: the graph inputs the attention pass found to be positions by how they flow
    (index -> how); the input named ``position_ids`` is checked too (positions used only as
    an index, by a learned position embedding, look like token ids to the flow).
    ``balanced_exact``: the graph computes documents in the balanced order exactly (the
    attention pass's fact), so ``BALANCED`` positions are let through to be verified there.
    ``labels_shifted``: the graph shifts labels in the sequence's order (``sequence_loss``),
    which is not the balanced order's: ``BALANCED`` positions are refused, saying so.
    ``made_positions``: the graph numbers its tokens with the layout's positions
    (``made_positions``); these inputs (its token data) are checked to differ between the ranks
    of the sequence."""
    if mesh is None or mesh.sp == 1:
        return compiled, None
    found = dict(found)
    named = graph_input_index(gm, "position_ids")
    if named is not None:
        found[named] = ", ".join([found[named], "its name"] if named in found else ["its name"])
    if made_positions and not found:
        check = MadePositionsCheck(mesh, list(made_positions))

        def checked_tokens(*args: Any) -> Any:
            check(args)
            return compiled(*args)

        return checked_tokens, {"matched": len(made_positions), "position_ids": None, "result": (
            "the graph numbers its tokens with the layout's positions (made_positions): before "
            f"each call the {mesh.sp} ranks of the sequence compare a checksum of their token "
            "inputs (one all-gather of three numbers each) and refuse a batch that every rank "
            "holds whole, or one shard_batch cut from packed documents")}
    if not found:
        return compiled, {"matched": 0, "position_ids": None, "result": (
            "no input of this graph is positions (none is named position_ids, and none reaches "
            "RoPE's angle or a mask's documents): nothing to check at run time (positions the "
            "model makes from the local length are refused by token_locality)")}
    sources = placeholder_sources(gm)
    balanced_exact = balanced_exact and mesh.cp > 1 and not labels_shifted
    checks = [PositionCheck(mesh, index, None if index == named else sources[index],
                            balanced_exact, labels_shifted) for index in sorted(found)]

    def checked(*args: Any) -> Any:
        for check in checks:
            check(args)
        return compiled(*args)

    return checked, {"matched": len(checks), "position_ids": [
        f"graph input {index} ({sources[index]}), found by {how}" for index, how in
        sorted(found.items())], "result": (
        f"compared with the layout of hp={mesh.hp}, cp={mesh.cp} before each call; the "
        f"verdicts of the {mesh.sp} ranks of the sequence are all-reduced; documents in the "
        f"balanced order {'let through to sequence_document_ids' if balanced_exact else 'refused'}")}


class PositionCheck:
    """Compares argument ``index`` (the position ids; ``source``: where the compiled function
    got them, when not as ``position_ids``) with the layout of ``mesh`` at each call."""

    def __init__(self, mesh: Any, index: int, source: str | None = None,
                 balanced_exact: bool = False, labels_shifted: bool = False):
        self.mesh = mesh
        self.index = index
        self.source = source
        self.balanced_exact = balanced_exact
        self.labels_shifted = labels_shifted
        self.place = mesh.sp_ranks.index(mesh.rank)
        self._expected: dict[tuple, torch.Tensor] = {}

    def __call__(self, args: Sequence[Any]) -> None:
        positions = args[self.index]
        # row 0: the ranks' verdicts; row 1: whether each holds exactly 0..S_local-1.  Made on
        # the device and read on the host once, after the all-reduce (one sync per step)
        found = torch.zeros(2, self.mesh.sp, dtype=torch.int64, device=positions.device)
        found[:, self.place] = self.verdict(positions)
        dist.all_reduce(found, group=resolve_process_group(self.mesh.group_names["sp"]))
        verdicts, holds_arange = found.tolist()
        verdicts = [Verdict(v) for v in verdicts]
        failing = {rank: v for rank, v, bad in zip(
            self.mesh.sp_ranks, verdicts,
            refused(verdicts, [bool(f) for f in holds_arange], self.balanced_exact))
            if bad}
        if failing:
            raise _error(failing, self.mesh, positions.shape[-1] if positions.dim() else 0,
                         self.detail(positions), self.source, self.labels_shifted)

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


class MadePositionsCheck:
    """The check of a graph that numbers its tokens with the layout's positions: such a rank has
    no position ids that could tell a wrong batch.  Refuses, on every rank of the sequence, a
    call whose token inputs (``indices``) are the same on all of them (what a batch fed whole
    to every rank looks like), or that some rank's ``shard_batch`` cut from packed documents
    (the model would number them as one sequence: their documents live in the position ids)."""

    def __init__(self, mesh: Any, indices: list[int]):
        self.mesh = mesh
        self.indices = indices
        self._weights: dict[tuple, torch.Tensor] = {}

    def __call__(self, args: Sequence[Any]) -> None:
        tensors = [args[i] for i in self.indices if isinstance(args[i], torch.Tensor)]
        if not tensors:
            return
        device = tensors[0].device
        # a sum and a weighted sum (equal tensors give equal checksums), and whether the
        # tokens were cut from packed documents: one all-gather, one host read
        found = torch.zeros(3, dtype=torch.float64, device=device)
        for t in tensors:
            flat = t.detach().reshape(-1).to(torch.float64)
            found[:2] += torch.stack([flat.sum(), (flat * self._weights_for(flat)).sum()])
        found[2] = float(any(cut_from_packed_documents(t) for t in tensors))
        parts = [torch.empty_like(found) for _ in range(self.mesh.sp)]
        dist.all_gather(parts, found, group=resolve_process_group(self.mesh.group_names["sp"]))
        rows = torch.stack(parts).tolist()
        packed = [rank for rank, row in zip(self.mesh.sp_ranks, rows) if row[2]]
        if packed:
            raise LoongShapeError(
                f"a batch shard_batch cut from packed documents (document_ids= or cu_seqlens=; "
                f"ranks {packed}), and the model is called without position_ids",
                "the model finds packed documents only in its position ids (restarting at 0 at "
                "each document); without them it numbers the row as one sequence, and every "
                "token would attend across the starts of its documents",
                "pass position_ids=batch.position_ids")
        if all(row[:2] == rows[0][:2] for row in rows[1:]):
            shape = tuple(tensors[0].shape)
            raise LoongShapeError(
                f"every one of the {self.mesh.sp} ranks of the sequence holds the same tokens "
                f"({shape}), and the model is called without position_ids",
                "under hp*cp > 1 a rank holds its share of a longer sequence; the model numbers "
                "its tokens with the layout's positions, which is right only for a batch cut with "
                "shard_batch (a sequence whose shards are all equal is refused with it)",
                "cut each full (B, S) batch with loong_compile.shard_batch(input_ids, labels, "
                f"mesh) for mesh = init_mesh(hp={self.mesh.hp}, cp={self.mesh.cp}) and pass "
                "batch.input_ids (and position_ids=batch.position_ids)")

    def _weights_for(self, flat: torch.Tensor) -> torch.Tensor:
        """``sqrt(1..n)`` for ``n`` values on their device, made once per shape (every step)."""
        key = (flat.numel(), flat.device)
        if key not in self._weights:
            if len(self._weights) >= _CACHED_LENGTHS:
                self._weights.clear()
            self._weights[key] = torch.arange(1, flat.numel() + 1, device=flat.device,
                                              dtype=torch.float64).sqrt()
        return self._weights[key]
