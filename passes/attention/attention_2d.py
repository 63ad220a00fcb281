"""Rewrite attention call sites into LoongTrain's 2D-Attention.

This module is the pass's outline: find the sites, then for each read the call (``calls``:
SDPA, sinks, flash-attn by ``flash_match``), prove its mask (``mask_policy``: the meaning by
``mask_proof`` and ``input_roles``, the window and chunk by ``model_facts``, the document ids by
``document_ids``) and write the new call (``emission``: casts, KV un-repeat by ``kv_repeat``,
transposes); then the RoPE check and the report.

Contract
--------
stage:    dynamo (torch IR, before AOTAutograd)
applies:  always.  At ``hp = cp = 1`` (one rank holds the whole sequence) only to the calls with
          an ``attn_mask``, each rewritten when its mask is proven (the S×S mask transformers
          builds under ``torch.compile`` then dies) and kept as it is otherwise: nothing is
          refused on one rank, where every call already computes what one process does (but an
          option that does not fit the model: ``head_groups``, ``LoongConfigError``).  A call
          without a mask stays transformers' SDPA there, ``head_groups`` or not: 2D-Attention's
          op in its place peaked higher (one process, ``benchmarks/longest_sequence.py --at
          8192 --head-groups 2``: 59.9 against 49.6 MiB under full with tiles).
matches:  ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
          enable_gqa)``, ``ops.attention.sinks.sdpa_with_sinks`` (its ``sinks`` passed on) and
          flash-attn's ``flash_attn_func`` (as Dynamo traces it: its autograd.Function around
          ``torch.ops.flash_attn._flash_attn_forward``, recognised by ``flash_match``), in the
          graph and in the bodies of activation checkpointing; KV heads repeated before the call
          by ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``) or
          ``repeat_interleave(n, dim=1)``.
emits:    one ``loong_compile.ops.attention_2d`` call per site, on the un-repeated KV, with the
          mesh's group names as constant arguments; it traces into the seq all-to-all and
          Double-Ring custom ops under AOTAutograd.  A boolean ``attn_mask`` that
          ``passes/attention/mask_proof.py`` proves to be packed documents (from the position ids),
          key padding (from the 2-D attention mask; either input found by how it flows, whatever
          its name), causality and a window becomes
          ``document_ids=`` (one ``sequence_document_ids`` call per graph,
          ``passes/attention/document_ids.py``) and ``window=``; the mask's own subgraph dies.  A window
          the local length cannot show (``L <= W < S``) comes from the module's
          ``sliding_window`` (``model_facts``): on a masked call, and on a causal call without a
          mask (transformers skipped the mask because the local length fits the window).  A
          chunked layer's blocks (seen in the mask, or the module's ``attention_chunk_size`` by
          the window's rules) become document ids of the blocks (``chunked_document_ids``);
          ``sdpa_with_sinks``' logits become ``sinks=``.
refuses:  (``LoongUnsupportedError`` naming the node, its source line, the reason and the fix)
          an ``attn_mask`` the probes do not prove (saying what built it and what it did
          instead), ``dropout_p > 0``, attention inside another higher-order op's body, a
          flash-attn ``window_size``, key padding on a call ``eager_attention`` wrote (fact
          ``eager_calls``: one process gives a query that sees no key the mean of its row's
          values); (``LoongTokenMixingError``) a window the module declares
          that the call contradicts (a mask without it although the local length shows it, a
          non-causal call, a dynamic length), a RoPE that changes with the sequence length
          beyond its threshold.
reports:  each rewritten site (source line, module, heads, KV heads, the head dim of q/k and
          v's own (MLA's differs), un-repeated or not, causal, scale, the mask's proven meaning
          and the probes run, the window and where it came from, the document ids it reads,
          mesh sizes, the HOP body it sits in); the document-ids calls made; the mask operands
          dropped from HOP bodies; which graph inputs are the positions and the attention mask,
          and how each was found (``input_roles``).
provides: ``attention_sites`` (its value: the op the rewrite emits, which ``token_locality``
          lets combine tokens); ``position_inputs`` (the inputs found to be positions, which the
          backend's input check compares with the token layout at each call).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from loong_compile.errors import LoongConfigError, LoongError, LoongTokenMixingError
from loong_compile.ops import attention_2d
from loong_compile.parallel.mesh import one_process_mesh
from loong_compile.passes.attention import input_roles, mask_policy, model_facts
from loong_compile.passes.fx import traced_modules
from loong_compile.passes.attention.calls import (
    AttentionCall, constant_settings, is_site, masked, read_call, refuse)
from loong_compile.passes.attention.document_ids import DocumentIds
from loong_compile.passes.attention.eager_attention import EAGER_CALLS
from loong_compile.passes.attention.emission import Written, write_attention
from loong_compile.passes.attention.flash_match import match_flash_attn
from loong_compile.passes.attention.input_roles import Prover
from loong_compile.passes.attention.kv_repeat import head_dim, heads
from loong_compile.passes.attention.mask_proof import MaskMeaning
from loong_compile.passes.base import ATTENTION_SITES, Pass, PassContext, add_exact_mixers
from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.subgraphs import Scope, drop_unused_operands, graph_scopes


class Attention2DPass(Pass):
    name = "attention_2d"
    stage = "dynamo"
    provides = (ATTENTION_SITES, input_roles.POSITION_INPUTS, input_roles.BALANCED_EXACT)
    uses = (EAGER_CALLS,)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        add_exact_mixers(ctx, ATTENTION_SITES, (attention_2d,))
        root = traced_modules.compiled_module(gm)
        scopes = [s for s in graph_scopes(gm)  # flash-attn's own Function body: matched outside
                  if s.caller is None or match_flash_attn(s.caller) is None]
        sites = [(scope, n) for scope in scopes for n in scope.module.graph.nodes if is_site(n)]
        one_rank = ctx.config.sp == 1
        if one_rank:
            sites = [(scope, n) for scope, n in sites if scope.inline and masked(n)]
        for scope, node in sites:
            if not scope.inline:
                refuse(node, f"it sits inside a {scope.hop} body, whose computation the "
                             "backend cannot rewrite as a whole",
                       "call attention outside the higher-order op, or run with hp=cp=1")
        prover = Prover(scopes, input_roles.rope_positions(gm, scopes))
        mesh = ctx.mesh if ctx.mesh is not None else one_process_mesh(ctx.config.placement)
        documents = DocumentIds(gm, scopes, prover.input, mesh)
        autocast: dict = {}   # (graph, device type) -> autocast's dtype at each node
        rewrite = _on_one_rank if one_rank else _rewrite
        records = [rewrite(scope, node, ctx, mesh, root, prover, documents, autocast)
                   | {"inside": scope.hop} for scope, node in sites]
        rewritten = [r for r in records if "kept" not in r]
        dropped = drop_unused_operands(scopes)
        for scope in scopes:
            scope.module.graph.lint()
            scope.module.recompile()
        summary: dict[str, Any] = {"matched": len(sites), "changed": rewritten,
                                   "kept": [r for r in records if "kept" in r],
                                   "model": type(root).__name__ if root is not None else None,
                                   "document_ids": documents.summary(),
                                   "mask_operands_dropped": dropped,
                                   "inputs": input_roles.roles_found(gm, prover, ctx.state),
                                   "balanced_documents_exact": balanced_exact(rewritten)}
        ctx.state[input_roles.BALANCED_EXACT] = summary["balanced_documents_exact"]
        rope = None if one_rank else _check_rope(root, rewritten, ctx)
        if rope:
            summary["rope"] = rope
        return summary


def balanced_exact(rewritten: list[dict]) -> bool:
    """Whether every call's mask reads the document order from the positions alone, causally:
    then documents in shard_batch's balanced order are computed exactly (their ids and
    in-document positions come from those positions, ops/masks/documents.py, which also refuses
    positions in neither order).  A graph with no such call has nothing that verifies them."""
    return bool(rewritten) and all(call["is_causal"] and call["documents_alone"]
                                   for call in rewritten)


def _on_one_rank(scope: Scope, node: torch.fx.Node, ctx: PassContext, mesh: Any,
                 root: torch.nn.Module | None, prover: Prover, documents: DocumentIds,
                 autocast: dict) -> dict:
    """hp = cp = 1: the call rewritten as under hp·cp > 1 when its mask is proven, else kept
    as it is with the reason (what would be refused there).  A refusal may leave nodes the
    rewrite made unused (document ids, a cast); AOTAutograd drops them."""
    try:
        return _rewrite(scope, node, ctx, mesh, root, prover, documents, autocast)
    except LoongConfigError:   # an option that does not fit the model (head_groups): refused
        raise
    except LoongError as e:
        return {"kept": node.name, "source": source_line(node), "module": module_path(node),
                "reason": str(e)}


def _rewrite(scope: Scope, node: torch.fx.Node, ctx: PassContext, mesh: Any,
             root: torch.nn.Module | None, prover: Prover, documents: DocumentIds,
             autocast: dict) -> dict:
    """One call: read, its mask proven, written as 2D-Attention; its report record."""
    call = read_call(node)
    meaning = mask_policy.prove_mask(call, prover, ctx.state.get(EAGER_CALLS, ()))
    causal = call.causal if meaning is None else meaning.causal
    scale, specialised = constant_settings(call, causal)
    sp = ctx.config.sp
    sizes = mask_policy.extent(node, root, causal, call.tokens, sp, meaning)
    mask_kwargs = mask_policy.mask_keywords(call, meaning, sizes, documents, scope, sp, causal)
    mesh_kwargs = mesh.attention_kwargs()
    if ctx.config.head_groups > 1:
        mesh_kwargs["head_groups"] = ctx.config.head_groups
    written = write_attention(scope.module.graph, call, causal, scale, mesh_kwargs, mask_kwargs,
                              autocast)
    return _record(call, written, meaning, sizes, specialised, ctx)


def _record(call: AttentionCall, written: Written, meaning: MaskMeaning | None,
            sizes: mask_policy.Extent, specialised: bool, ctx: PassContext) -> dict:
    """What the report says of one call rewritten."""
    node, kwargs, q = call.node, written.kwargs, written.q
    document_ids, sinks = kwargs.get("document_ids"), kwargs.get("sinks")
    return {
        "node": written.node.name, "replaced": node.name, "source": source_line(node),
        "module": module_path(node), "heads": heads(q), "kv_heads": heads(written.k),
        "head_dim": head_dim(q), "value_head_dim": head_dim(written.v),
        "kv_unrepeated": written.kv_unrepeated, "is_causal": kwargs["is_causal"],
        "tokens_per_rank": call.tokens, "sliding_window": sizes.window, "window_from": sizes.window_from,
        "mask": None if meaning is None else {
            "proven": meaning.describe(), "probes": list(meaning.probes),
            "built": mask_policy.mask_cause(call.attn_mask)},
        "document_ids": None if document_ids is None else document_ids.name,
        "sinks": None if sinks is None else sinks.name,
        "chunk": sizes.chunk, "chunk_from": sizes.chunk_from,
        "documents_alone": (meaning is not None and meaning.documents and not meaning.padding
                            and sizes.chunk is None),
        "scale": kwargs["scale"] if kwargs["scale"] is not None else 1 / math.sqrt(head_dim(q)),
        "scale_specialised": specialised,
        "autocast_dtype": (None if written.cast_to is None
                           else str(written.cast_to).removeprefix("torch.")),
        "hp": ctx.config.hp, "cp": ctx.config.cp, "inner_ring": ctx.config.inner_ring,
        "placement": ctx.config.placement, "head_groups": ctx.config.head_groups,
    }


def _check_rope(root, rewritten: list[dict], ctx: PassContext) -> dict | None:
    rope = model_facts.length_dependent_rope(root)
    if rope is None or not rewritten:
        return None
    rope_type, threshold = rope
    tokens = rewritten[0]["tokens_per_rank"]
    global_len = None if tokens is None else tokens * ctx.config.sp
    if global_len is None or global_len > threshold:
        raise LoongTokenMixingError(
            f"{type(root).__name__} uses rope_type={rope_type!r} with threshold {threshold} at a "
            f"global sequence of {global_len} tokens",
            "this RoPE picks its frequencies from the sequence length (or the largest position) "
            "it sees, which under hp*cp > 1 is a rank's share: ranks would disagree with one "
            "process", "use a RoPE that does not depend on the length (e.g. rope_type='linear' "
            "or 'yarn' with fixed factors), keep the sequence within "
            f"{threshold} tokens, or run with hp=cp=1")
    return {"rope_type": rope_type, "threshold": threshold, "global_len": global_len}
