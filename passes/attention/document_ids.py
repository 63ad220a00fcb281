"""The global document ids of a graph and the step's mask: one ``sequence_document_ids`` call
and one ``masked_attention_plan`` call per kind, for every masked call.

A mask that ``passes/attention/mask_proof.py`` proved to be documents and/or padding becomes the global
``(B, S)`` document ids of ``loong_compile.ops.sequence_document_ids`` (one all-gather of the
ranks' position ids and key padding per step).  The graph gets at most one such call per kind
of ids, after its inputs, whatever the number of attention calls; calls inside
higher-order-op bodies (activation checkpointing) receive the ids as an added operand.

The plan (ops/masks/step.py) is made once per (ids, causal, window) from those ids, so no
per-layer call reads device data on the host: the attention pass hands every masked call the
plan's handle.

Kinds of ids: documents from the position ids (with or without key padding), and padding alone (a
mask that reads the attention mask but not the positions, as transformers builds whenever an
attention mask is given): the same ids with every document number set to 0; either (or one
document) split into blocks of a chunk's tokens for chunked attention (``chunked_document_ids``,
no communication).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from loong_compile.ops import sequence_document_ids
from loong_compile.ops.masks.documents import chunked_document_ids
from loong_compile.passes.attention.mask_proof import PADDING, POSITIONS, MaskMeaning, MaskNotProven
from loong_compile.passes.fx.subgraphs import Scope, add_operand, parent_of


class DocumentIds:
    """Makes the document-ids nodes of one graph on demand, each once."""

    def __init__(self, gm: torch.fx.GraphModule, scopes: list[Scope],
                 input_of: Callable[[str], torch.fx.Node | None], mesh: Any):
        """``input_of(role)``: the graph input the proven masks read in ``role``
        (``Prover.input``), asked when a call needs it."""
        self.gm, self.scopes, self.input_of, self.mesh = gm, scopes, input_of, mesh
        self._made: dict[Any, torch.fx.Node] = {}
        self._top_nodes: list[torch.fx.Node] = []

    def for_call(self, meaning: MaskMeaning | None, scope: Scope) -> torch.fx.Node | None:
        """The ids ``meaning`` needs, as a node of ``scope``'s graph; None for one document."""
        if meaning is None or not (meaning.documents or meaning.padding):
            return None
        return self._in_scope(self._top(meaning.documents, meaning.padding), scope)

    def chunked(self, document_ids: torch.fx.Node | None, chunk: int, batch: int, seq_len: int,
                scope: Scope, example: torch.Tensor) -> torch.fx.Node:
        """Ids that also split the sequence into blocks of ``chunk`` tokens (chunked attention),
        from the call's ids (None: one document); made once per graph, chunk and ids."""
        top_ids = self._top_of(document_ids)
        key = ("chunked", top_ids, chunk, batch, seq_len)
        if key not in self._made:
            self._made[key] = self._call(
                chunked_document_ids, (top_ids,),
                {"chunk": chunk, "batch": batch, "seq_len": seq_len, "device": example.device},
                example.fake_mode)
        return self._in_scope(self._made[key], scope)

    def plan_for(self, document_ids: torch.fx.Node | None, seq_len: int, is_causal: bool,
                 window: int | None, scope: Scope, fake_mode) -> torch.fx.Node:
        """The step's mask-plan handle for these ids (None: one document), as a node of
        ``scope``'s graph; made once per graph and kind in the top-level graph."""
        top_ids = self._top_of(document_ids)
        key = ("plan", top_ids, seq_len, is_causal, window)
        if key not in self._made:
            mesh = self.mesh.attention_kwargs()
            self._made[key] = self._call(
                torch.ops.loong.masked_attention_plan.default,
                (top_ids, seq_len, is_causal, window or 0, mesh["cp"]),
                # a keyword: the rank check leaves out group names, which differ by rank
                {"dkv_outer_group": mesh["dkv_outer_group"]}, fake_mode)
        return self._in_scope(self._made[key], scope)

    def summary(self) -> list[dict]:
        """The nodes made in the top-level graph: what each computes, from which inputs."""
        return [{"node": n.name, "computes": n.target.__name__,
                 "inputs": [a.name for a in n.all_input_nodes]} for n in self._top_nodes]

    def _top(self, documents: bool, padding: bool) -> torch.fx.Node:
        key = (documents, padding)
        if key in self._made:
            return self._made[key]
        positions = self.input_of(POSITIONS)
        key_padding = self.input_of(PADDING) if padding else None
        if padding and key_padding is None:
            raise MaskNotProven("it reads a key padding that is no input of this graph")
        if documents:
            if positions is None:
                raise MaskNotProven("its global version needs document ids, which come from the "
                                    "position ids, and position_ids is no input of this graph")
            node = self._ids(positions, key_padding)
        else:  # padding alone: any numbering of documents, then every document number -> 0
            numbered = positions if positions is not None else key_padding
            node = self._call(torch.clamp, (self._ids(numbered, key_padding),), {"max": 0})
        self._made[key] = node
        return node

    def _ids(self, positions: torch.fx.Node, key_padding: torch.fx.Node | None) -> torch.fx.Node:
        key = ("ids", positions, key_padding)
        if key not in self._made:
            self._made[key] = self._call(sequence_document_ids, (positions, key_padding),
                                         self.mesh.document_kwargs())
        return self._made[key]

    def _top_of(self, node: torch.fx.Node | None) -> torch.fx.Node | None:
        """The top-level node that ``node`` (perhaps an operand added to a body) stands for."""
        for key, made in self._made.items():
            if made is node and key[0] == "in":
                return key[2]
        return node

    def _call(self, fn, args: tuple, kwargs: dict, fake_mode=None) -> torch.fx.Node:
        graph = self.gm.graph
        anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        after = [a for a in args if isinstance(a, torch.fx.Node) and a.op != "placeholder"]
        if after:
            anchor = after[-1]
        with graph.inserting_after(anchor):
            node = graph.call_function(fn, args, kwargs)
        values = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in args]
        if fake_mode is None:
            fake_mode = next(v for v in values if isinstance(v, torch.Tensor)).fake_mode
        with fake_mode:
            node.meta["example_value"] = fn(*values, **kwargs)
        self._top_nodes.append(node)
        return node

    def _in_scope(self, node: torch.fx.Node, scope: Scope) -> torch.fx.Node:
        if scope.hop is None:
            return node
        key = ("in", id(scope.module), node)
        if key not in self._made:
            outer = self._in_scope(node, parent_of(scope, self.scopes))
            self._made[key] = add_operand(scope, outer, node.name)
        return self._made[key]
