"""Run-time checks of what a compiled graph receives: which checks a graph gets, from what the
dynamo stage found (``GraphFacts``), and the wrapper that runs them before each call.

Under ``hp·cp > 1`` a rank holds its share of a sequence, and some mistakes in what a call is
given make every result silently wrong while nothing in the graph can show them.  Each is one
check, in its module:

* ``positions.PositionCheck``: the position ids (found by how they flow, and the input named
  ``position_ids``) against the token layout;
* ``tokens.MadePositionsCheck``: a graph that numbers its tokens itself, given a batch every rank
  holds whole or one cut from packed documents;
* ``labels.ShiftedLabelsCheck``: the labels the graph shifts, given ``shard_batch``'s shifted
  labels;
* ``blocks.BlindGraphCheck``: a graph with attention that receives nothing of the batch (a block
  compiled on its own), while a batch of packed documents or padding is alive.

They run on every rank of the sequence, and their findings are exchanged in one all-reduce per
call (``exchange.agree``), so that every rank raises the same error, before the graph's first
collective, or none does.  On one rank of a sequence nothing is checked: positions and labels
are the user's own business there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx

from loong_compile._compat.dynamo import placeholder_sources
from loong_compile.checks.blocks import BlindGraphCheck
from loong_compile.checks.exchange import RankCheck, agree
from loong_compile.checks.labels import ShiftedLabelsCheck
from loong_compile.checks.positions import PositionCheck
from loong_compile.checks.tokens import MadePositionsCheck


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What the dynamo stage's passes found about a graph's inputs."""

    positions: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """the inputs found to be positions, and how (``attention_2d``'s ``position_inputs``)"""
    balanced_exact: bool = False
    """the graph computes documents in the balanced order exactly (``attention_2d``)"""
    labels_shifted: bool = False
    """the graph shifts labels in the sequence's order (``sequence_loss``)"""
    made_positions: Sequence[int] = ()
    """the token inputs of a graph that numbers its tokens itself (``made_positions``)"""
    shifted_labels: Sequence[int] = ()
    """the inputs whose labels the graph shifts (``sequence_loss``)"""
    blind: bool = False
    """the graph holds attention and receives nothing of the batch (``passes/fx/batch_view.py``)"""


def graph_input_index(gm: torch.fx.GraphModule, name: str) -> int | None:
    """Index of the graph input that is the compiled function's argument ``name`` (given
    directly or among its ``**kwargs``: ``L['position_ids']``, ``L['kwargs']['position_ids']``),
    or None."""
    pattern = re.compile(rf"L\['{name}'\]|L\['\w+'\]\['{name}'\]")
    for index, source in enumerate(placeholder_sources(gm)):
        if source is not None and pattern.fullmatch(source):
            return index
    return None


def checking_inputs(compiled: Callable, gm: torch.fx.GraphModule, mesh: Any, facts: GraphFacts
                    ) -> tuple[Callable, dict[str, Any] | None]:
    """``compiled``, checking its inputs before each call when ``mesh`` splits sequences over
    more than one rank; and the report's summary of that decision (None on one rank)."""
    if mesh is None or mesh.sp == 1:
        return compiled, None
    sources = placeholder_sources(gm)
    checks: list[RankCheck] = []
    found = dict(facts.positions)
    named = graph_input_index(gm, "position_ids")
    if named is not None:
        found[named] = ", ".join([found[named], "its name"] if named in found else ["its name"])
    balanced_exact = facts.balanced_exact and mesh.cp > 1 and not facts.labels_shifted
    checks += [PositionCheck(mesh, index, None if index == named else sources[index],
                             balanced_exact, facts.labels_shifted) for index in sorted(found)]
    results = []
    if found:
        results.append(
            f"position_ids compared with the layout of hp={mesh.hp}, cp={mesh.cp} before each "
            f"call (once per tensor every rank accepted); documents in the balanced order "
            f"{'let through to sequence_document_ids' if balanced_exact else 'refused'}")
    elif facts.made_positions:
        checks.append(MadePositionsCheck(mesh, list(facts.made_positions)))
        results.append("the graph numbers its tokens with the layout's positions "
                       "(made_positions): the ranks compare a checksum of their token inputs and "
                       "refuse a batch every rank holds whole, or one shard_batch cut from "
                       "packed documents")
    if facts.shifted_labels:
        checks.append(ShiftedLabelsCheck(mesh, facts.shifted_labels,
                                         [sources[i] for i in facts.shifted_labels]))
        results.append("the labels the graph shifts are refused when they are shard_batch's "
                       "shifted labels (or a view of them)")
    if facts.blind:
        checks.append(BlindGraphCheck(mesh))
        results.append("the graph holds attention but receives nothing of the batch (a block "
                       "compiled on its own): refused while shard_batch has a batch of packed "
                       "documents or padding alive")
    summary = {"matched": len(checks), "position_ids": [
        f"graph input {index} ({sources[index]}), found by {how}"
        for index, how in sorted(found.items())] or None,
        "result": "; ".join(results) or (
            "nothing to check at run time: no input of this graph is positions (none is named "
            "position_ids, and none reaches RoPE's angle or a mask's documents), it shifts no "
            "labels, and it sees the batch or has no attention (positions the model makes from "
            "the local length are refused by token_locality)")}
    if not checks:
        return compiled, summary

    def checked(*args: Any) -> Any:
        agree(checks, args, mesh)
        return compiled(*args)

    return checked, summary
