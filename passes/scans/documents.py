"""The documents the scans reset at: one ``scan_documents`` node per graph, made from the graph
input the attention pass found to be the positions (fact ``position_inputs``), and handed to
every scan op of the graph and its inline bodies.

Packed documents live in the position ids (restarting at 0 at each document); the step's global
document ids are ``sequence_document_ids`` of those positions (the attention pass's own node
where it made one without key padding, else a new one: one small all-gather of integers per
step), which ``scan_documents`` turns into numbers that change at each document start, refusing
the rows where no reset can be placed (``ops/scans/documents.py``).  A graph with no positions
input holds no documents the model could know of: its scans run each row as one sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.errors import LoongUnsupportedError
from loong_compile.ops import sequence_document_ids
from loong_compile.ops.scans.documents import scan_documents
from loong_compile.parallel.mesh import one_process_mesh
from loong_compile.passes.base import POSITION_INPUTS, PassContext
from loong_compile.passes.fx.module_paths import source_line
from loong_compile.passes.fx.subgraphs import Scope, add_operand, parent_of

SCAN_DOCUMENTS = torch.ops.loong.scan_documents.default
NO_POSITIONS = ("none: no input of this graph is positions (none reaches RoPE's angle or a mask's "
                "documents), so each row is one sequence to the scans")


def documents_for(gm: torch.fx.GraphModule, ctx: PassContext, scope: Scope,
                  scopes: list[Scope], site: torch.fx.Node) -> tuple[torch.fx.Node | None, str]:
    """The graph's document numbers as a node of ``scope``'s graph (made once per graph), or
    None where the graph has no positions input; and what the report says of them.  Several
    positions inputs are refused by name under ``hp·cp > 1`` (``site``: the scan asking) and
    leave the scans as they are on one rank."""
    made = next(iter(gm.graph.find_nodes(op="call_function", target=SCAN_DOCUMENTS)), None)
    if made is None:
        inputs = list(gm.graph.find_nodes(op="placeholder"))
        found = [inputs[i] for i in sorted(ctx.state.get(POSITION_INPUTS, {}))]
        if not found:
            return None, NO_POSITIONS
        if len(found) > 1:
            names = ", ".join(n.name for n in found)
            if ctx.config.sp == 1:
                return None, f"none: the inputs {names} are all positions (by how they flow)"
            raise LoongUnsupportedError(
                f"a scan at {source_line(site)} in a graph whose inputs {names} are all "
                "positions (by how they flow)",
                "the scans start each packed document from a zero state, and the documents are "
                "read from one positions input: with several, which one holds them is unknown",
                "pass one position_ids to the model")
        made = _make(gm, ctx, found[0])
    how = (f"reset at each document start of {made.args[0].args[0].name}'s positions "
           f"(numbers: {made.name})")
    return _in_scope(made, scope, scopes), how


def _make(gm: torch.fx.GraphModule, ctx: PassContext, positions: torch.fx.Node) -> torch.fx.Node:
    """``scan_documents`` of the step's document ids from ``positions`` (the attention pass's
    call where it made one without key padding), after the graph's inputs."""
    graph = gm.graph
    ids = next((n for n in graph.find_nodes(op="call_function", target=sequence_document_ids)
                if n.args[0] is positions and (len(n.args) < 2 or n.args[1] is None)), None)
    fake_mode = positions.meta["example_value"].fake_mode
    if ids is None:
        mesh = ctx.mesh if ctx.mesh is not None else one_process_mesh(ctx.config.placement)
        kwargs: dict[str, Any] = mesh.document_kwargs()
        with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):
            ids = graph.call_function(sequence_document_ids, (positions, None), kwargs)
        with fake_mode:
            ids.meta["example_value"] = sequence_document_ids(positions.meta["example_value"], None,
                                                               **kwargs)
    with graph.inserting_after(ids):
        made = graph.call_function(SCAN_DOCUMENTS, (ids,))
    with fake_mode:
        made.meta["example_value"] = scan_documents(ids.meta["example_value"])
    return made


def _in_scope(node: torch.fx.Node, scope: Scope, scopes: list[Scope]) -> torch.fx.Node:
    """``node`` (of the top-level graph) as a value of ``scope``'s graph: an operand added to
    each inline body on the way down, or the one an earlier scan added."""
    if scope.hop is None:
        return node
    outer = _in_scope(node, parent_of(scope, scopes), scopes)
    held = next((inner for inner, arg in scope.operands.items() if arg is outer), None)
    return held if held is not None else add_operand(scope, outer, node.name)
