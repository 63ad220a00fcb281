"""Rewrite attention call sites into LoongTrain's 2D-Attention.

One pass, ~370 lines: the call-site rewrite with the checks that decide it (window, RoPE,
mask causes).  What can stand alone lives beside it: KV-repeat matching (``kv_repeat``),
flash-attn matching (``flash_match``), the mask proof (``mask_proof``), which inputs are the
positions and the mask (``input_roles``) and the per-graph document ids (``document_ids``).

Contract
--------
stage:    dynamo (torch IR, before AOTAutograd)
applies:  always.  At ``hp = cp = 1`` (one rank holds the whole sequence) only to the calls with
          an ``attn_mask``, each rewritten when its mask is proven (the S×S mask transformers
          builds under ``torch.compile`` then dies) and kept as it is otherwise: nothing is
          refused on one rank, where every call already computes what one process does.
matches:  ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
          enable_gqa)``, ``ops.sinks.sdpa_with_sinks`` (its ``sinks`` passed on) and
          flash-attn's ``flash_attn_func`` (as Dynamo traces it: its
          autograd.Function around ``torch.ops.flash_attn._flash_attn_forward``, recognised by
          ``passes/attention/flash_match.py``), in the graph and in the bodies of activation checkpointing; KV heads repeated before the call by
          ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``) or
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
provides: ``attention_sites``; ``position_inputs`` (the inputs found to be positions, which the
          backend's input check compares with the token layout at each call).
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, NoReturn

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.errors import LoongError, LoongTokenMixingError, LoongUnsupportedError
from loong_compile.ops import attention_2d
from loong_compile.ops.sinks import sdpa_with_sinks
from loong_compile.passes.attention import input_roles, model_facts
from loong_compile.parallel.mesh import one_process_mesh
from loong_compile.passes.base import Pass, PassContext
from loong_compile.passes.attention.document_ids import DocumentIds
from loong_compile.passes.attention.eager_attention import EAGER_CALLS
from loong_compile.passes.attention.flash_match import match_flash_attn
from loong_compile.passes.fx_util import ancestors, autocast_dtypes, module_path, source_line
from loong_compile.passes.attention.kv_repeat import shape, unrepeated_kv
from loong_compile.passes.attention.input_roles import Prover
from loong_compile.passes.attention.mask_proof import MaskMeaning, MaskNotProven
from loong_compile.passes.subgraphs import Scope, drop_unused_operands, graph_scopes

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
                sdpa_with_sinks)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False, "sinks": None}
# eager_attention's form of gpt-oss's chain: SDPA with one sink logit per head
SINKS_PARAMS = ("query", "key", "value", "sinks", "attn_mask", "scale")
FLASH_DEFAULTS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                  "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
                  "return_attn_probs": False}
MASK_FIX = ("build the mask as transformers does, from position_ids (packed documents restart "
            "at 0), the tokenizer's 2-D attention_mask (padding) and the config's sliding_window, "
            "or call loong_compile.ops.attention_2d(..., document_ids=, window=) yourself; "
            "otherwise run with hp=cp=1")


# The fact this pass provides: every attention call of the graph is rewritten to 2D-Attention.
ATTENTION_SITES = "attention_sites"


class Attention2DPass(Pass):
    name = "attention_2d"
    stage = "dynamo"
    provides = (ATTENTION_SITES, input_roles.POSITION_INPUTS, input_roles.BALANCED_EXACT)
    uses = (EAGER_CALLS,)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        root = model_facts.compiled_module(gm)
        scopes = [s for s in graph_scopes(gm)  # flash-attn's own Function body: matched outside
                  if s.caller is None or match_flash_attn(s.caller) is None]
        sites = [(scope, n) for scope in scopes for n in scope.module.graph.nodes
                 if n.op == "call_function"
                 and (n.target in SDPA_TARGETS or match_flash_attn(n) is not None)]
        one_rank = ctx.config.sp == 1
        if one_rank:
            sites = [(scope, n) for scope, n in sites if scope.inline and _masked(n)]
        for scope, node in sites:
            if not scope.inline:
                _refuse(node, f"it sits inside a {scope.hop} body, whose computation the "
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
    in-document positions come from those positions, ops/documents.py, which also refuses
    positions in neither order).  A graph with no such call has nothing that verifies them."""
    return bool(rewritten) and all(call["is_causal"] and call["documents_alone"]
                                   for call in rewritten)


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


def _masked(node: torch.fx.Node) -> bool:
    """Whether an SDPA call (not flash-attn's, which takes no mask) has an ``attn_mask`` node."""
    if node.target not in SDPA_TARGETS:
        return False
    params = SINKS_PARAMS if node.target is sdpa_with_sinks else SDPA_PARAMS
    return isinstance(_bind(node, params, SDPA_DEFAULTS)["attn_mask"], torch.fx.Node)


def _on_one_rank(scope: Scope, node: torch.fx.Node, ctx: PassContext, mesh: Any,
                 root: torch.nn.Module | None, prover: Prover, documents: DocumentIds,
                 autocast: dict) -> dict:
    """hp = cp = 1: the call rewritten as under hp·cp > 1 when its mask is proven, else kept
    as it is with the reason (what would be refused there).  A refusal may leave nodes the
    rewrite made unused (document ids, a cast); AOTAutograd drops them."""
    try:
        return _rewrite(scope, node, ctx, mesh, root, prover, documents, autocast)
    except LoongError as e:
        return {"kept": node.name, "source": source_line(node), "module": module_path(node),
                "reason": str(e)}


def _rewrite(scope: Scope, node: torch.fx.Node, ctx: PassContext, mesh: Any,
             root: torch.nn.Module | None, prover: Prover, documents: DocumentIds,
             autocast: dict) -> dict:
    graph = scope.module.graph
    flash = match_flash_attn(node)
    is_flash = flash is not None
    params = SINKS_PARAMS if node.target is sdpa_with_sinks else SDPA_PARAMS
    args = _flash_args(flash) if is_flash else _bind(node, params, SDPA_DEFAULTS)
    if is_flash:
        q, k, v = args["q"], args["k"], args["v"]
        causal, scale = args["causal"], args["softmax_scale"]
        _refuse_flash_extras(node, args)
    else:
        q, k, v = args["query"], args["key"], args["value"]
        causal, scale = args["is_causal"], args["scale"]
    meaning = None
    if not is_flash and args["attn_mask"] is not None:
        meaning = _prove(node, args["attn_mask"], prover)
        if meaning.padding and node in ctx.state.get(EAGER_CALLS, ()):
            _refuse_eager_padding(node)
        if causal is not False:
            _refuse(node, f"it has both an attn_mask and is_causal={causal!r}",
                    "pass one of them, as F.scaled_dot_product_attention requires")
        causal = meaning.causal
    if not (isinstance(args["dropout_p"], (int, float)) and args["dropout_p"] == 0):
        _refuse(node, f"dropout_p={args['dropout_p']!r}; attention dropout over a sharded "
                      "sequence would not equal one process's",
                "set the attention dropout to 0 (e.g. attention_dropout=0.0 in the model config)")
    scale, scale_specialised = _specialised(scale)
    if not isinstance(causal, bool) or not (scale is None or isinstance(scale, (int, float))):
        _refuse(node, f"is_causal={causal!r} / scale={scale!r} are not constants",
                "pass Python bool/float values")
    tokens = _static(shape(q)[1 if is_flash else 2])
    if ctx.config.sp == 1:   # a mask over the whole sequence shows any window or chunk shorter
        (window, window_from), (chunk, chunk_from) = (
            (size, "mask" if size else None) for size in (meaning.window, meaning.chunk))
        if chunk is not None and meaning.padding:
            _refuse(node, "its chunks count from each row's left padding in transformers",
                    "keep the mask (one rank computes it as it is)", LoongTokenMixingError)
    else:
        window, window_from = _window(node, root, causal, tokens, ctx.config.sp, meaning)
        chunk, chunk_from = _chunk(node, root, causal, tokens, ctx.config.sp, meaning)
    try:
        document_ids = documents.for_call(meaning, scope)
    except MaskNotProven as e:
        _refuse(node, f"its attn_mask is {meaning.describe()}, but {e}",
                "pass position_ids=batch.position_ids (and attention_mask=batch.attention_mask) "
                "from loong_compile.shard_batch to the model")
    if chunk is not None:
        document_ids = documents.chunked(document_ids, chunk, shape(q)[0], tokens * ctx.config.sp,
                                         scope, _example(q))

    cast_to = None if is_flash else _autocast_dtype(graph, node, q, autocast)
    if cast_to is not None:
        q, k, v = (_cast(graph, node, t, cast_to) for t in (q, k, v))
    # flash-attn takes fewer KV heads as they are; SDPA callers often repeat them first
    k_unrepeated, v_unrepeated = (None, None) if is_flash else (unrepeated_kv(k), unrepeated_kv(v))
    unrepeat = (k_unrepeated is not None and v_unrepeated is not None
                and _heads(k_unrepeated) == _heads(v_unrepeated))
    if unrepeat:
        k, v = k_unrepeated, v_unrepeated
    if is_flash:  # flash_attn_func takes (B, S, H, D); attention_2d takes SDPA's (B, H, S, D)
        q, k, v = (_insert_before(graph, node, torch.transpose, (t, 1, 2)) for t in (q, k, v))
    kwargs = {"is_causal": causal, "scale": None if scale is None else float(scale),
              "enable_gqa": is_flash or unrepeat or bool(args["enable_gqa"]),
              **mesh.attention_kwargs()}
    if not is_flash and args["sinks"] is not None:
        kwargs["sinks"] = args["sinks"]
    if document_ids is not None:
        kwargs["document_ids"] = document_ids
    if window is not None:
        kwargs["window"] = window
    if document_ids is not None or window is not None:
        kwargs["mask_plan"] = documents.plan_for(document_ids, tokens * ctx.config.sp, causal,
                                                 window, scope, _example(q).fake_mode)
    with graph.inserting_before(node):
        new = graph.call_function(attention_2d, (q, k, v), kwargs)
    _copy_meta(node, new)
    new.meta["example_value"] = _fake_attention(q, k, v, kwargs)
    result = new
    if is_flash:
        result = _insert_before(graph, node, torch.transpose, (new, 1, 2))
        _copy_meta(node, result)
        result.meta["example_value"] = _transposed(new.meta["example_value"])
    _replace_output(graph, node, result, is_flash)
    return {
        "node": new.name, "replaced": node.name, "source": source_line(node),
        "module": module_path(node), "heads": _heads(q), "kv_heads": _heads(k),
        "head_dim": _head_dim(q), "value_head_dim": _head_dim(v),
        "kv_unrepeated": unrepeat, "is_causal": causal, "tokens_per_rank": tokens,
        "sliding_window": window, "window_from": window_from,
        "mask": None if meaning is None else {
            "proven": meaning.describe(), "probes": list(meaning.probes),
            "built": _mask_cause(args["attn_mask"])},
        "document_ids": None if document_ids is None else document_ids.name,
        "sinks": None if is_flash or args["sinks"] is None else args["sinks"].name,
        "chunk": chunk, "chunk_from": chunk_from,
        "documents_alone": (meaning is not None and meaning.documents and not meaning.padding
                            and chunk is None),
        "scale": kwargs["scale"] if scale is not None else 1 / math.sqrt(_head_dim(q)),
        "scale_specialised": scale_specialised,
        "autocast_dtype": None if cast_to is None else str(cast_to).removeprefix("torch."),
        "hp": ctx.config.hp, "cp": ctx.config.cp, "inner_ring": ctx.config.inner_ring,
        "placement": ctx.config.placement,
    }


def _refuse_eager_padding(node: torch.fx.Node) -> NoReturn:
    """An eager chain's mask that hides padded keys: one process gives a query that sees no key
    (a left-padded token, whose output transformers' labels put in the loss when the next token
    is real) the mean of every value in its row (the additive mask's uniform softmax; NaN in
    float64), which no attention kernel computes."""
    _refuse(node, "it is attention written as ops whose mask hides padded keys: a query that "
                  "sees no key (left padding) gets, in one process, the mean of every value "
                  "of its row (NaN in float64), which 2D-Attention does not compute",
            "use attn_implementation='sdpa', pad on the right, or pack the documents "
            "(position_ids) instead of padding them")


def _flash_args(call) -> dict[str, Any]:
    """A traced flash_attn_func's settings, keyed like flash_attn_func's parameters."""
    return {"q": call.q, "k": call.k, "v": call.v, "causal": call.causal,
            "softmax_scale": call.softmax_scale, "dropout_p": call.dropout_p,
            "window_size": tuple(call.window_size), "softcap": call.softcap,
            "alibi_slopes": call.alibi_slopes, "return_attn_probs": call.reads_attn_probs,
            "enable_gqa": True}


def _replace_output(graph: torch.fx.Graph, node: torch.fx.Node, result: torch.fx.Node,
                    is_flash: bool) -> None:
    """Point the call's users at ``result``: SDPA's output is the node, flash-attn's is item 0
    of its (out, lse, probs) tuple (nothing reads the others: refused above)."""
    if not is_flash:
        node.replace_all_uses_with(result)
    else:
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(result)
            if not user.users:
                graph.erase_node(user)
    if not node.users:
        graph.erase_node(node)


def _static(size: Any) -> int | None:
    """A static size as an int; None for a dynamic one (reading it would add a guard)."""
    return size if isinstance(size, int) else None


def _prove(node: torch.fx.Node, mask: Any, prover: Prover) -> MaskMeaning:
    """The mask's meaning, proven on probes; refused with what it did otherwise."""
    if not isinstance(mask, torch.fx.Node):
        _refuse(node, f"its attn_mask is the constant {mask!r}", MASK_FIX)
    try:
        return prover.prove(mask)
    except MaskNotProven as e:
        _refuse(node, f"it has an attn_mask, {_mask_cause(mask)}, and {e}", MASK_FIX)


def _window(node: torch.fx.Node, root, causal: bool, tokens: int | None, sp: int,
            meaning: MaskMeaning | None) -> tuple[int | None, str | None]:
    """The window 2D-Attention applies (None: none shorter than the global sequence) and
    where it came from ("mask": the probes saw it; "module": its ``sliding_window``).

    A window ``W`` is visible in a mask of ``L`` tokens only when ``W < L``; transformers
    builds no mask at all when ``L < W`` and nothing else needs one.  So the module's window
    must show in the mask when shorter than ``L``, and is taken from the module otherwise.
    """
    attention = model_facts.module_of(root, node)
    path = model_facts.traced_in(node)
    if attention is None and path is not None:
        # the window lives on the module (or its config): not finding it is no proof of none
        _refuse(node, f"it was traced in the module {path}, which the backend cannot find "
                      "from the compiled frame, so it cannot read the sliding window the module "
                      "may apply", "compile the model (or a function that calls the model "
                      "held in a variable or attribute), or run with hp=cp=1",
                error=LoongTokenMixingError)
    try:
        module_window = model_facts.sliding_window(attention, root)
    except model_facts.UnknownLayerType as kind:
        _refuse(node, f"its layer's attention type is {kind}, and 2D-Attention knows the masks "
                      f"of {model_facts.FULL_LAYER}, {model_facts.WINDOWED_LAYER} and "
                      f"{model_facts.CHUNKED_LAYER} only",
                "run with hp=cp=1", error=LoongTokenMixingError)
    seen = meaning.window if meaning is not None else None
    mask = "no mask" if meaning is None else f"a mask proven to be {meaning.describe()}"

    def refuse(reason: str) -> NoReturn:
        _refuse(node, f"its module has sliding_window={module_window} and the call has {mask} "
                      f"(is_causal={causal}): {reason}",
                "set sliding_window=None (or >= the sequence length) in the config to train "
                "with full causal attention, or run with hp=cp=1", error=LoongTokenMixingError)

    return _seen_or_declared("window", seen, module_window, causal, tokens, sp, refuse)


def _seen_or_declared(noun: str, seen: int | None, declared: int | None, causal: bool,
                      tokens: int | None, sp: int, refuse) -> tuple[int | None, str | None]:
    """A window's or a chunk's size: what the mask shows (it must be what the module declares),
    else the module's when shorter than the global sequence, which a rank's mask of ``tokens``
    cannot show only when the size is at least ``tokens``."""
    if seen is not None:
        if declared != seen:
            refuse(f"the mask's {noun} is {seen}")
        return seen, "mask"
    if declared is None:
        return None, None
    if tokens is None:
        refuse(f"the length is dynamic, so whether the {noun} matters cannot be decided")
    if declared >= tokens * sp:
        return None, None
    if not causal:
        refuse(f"2D-Attention applies a {noun} to causal attention only")
    if declared < tokens:
        refuse(f"the {noun} is shorter than this rank's {tokens} tokens, yet the model applied "
               "none")
    return declared, "module"


def _chunk(node: torch.fx.Node, root, causal: bool, tokens: int | None, sp: int,
           meaning: MaskMeaning | None) -> tuple[int | None, str | None]:
    """The chunk of chunked attention (None: none shorter than the global sequence) and where it
    came from, by the window's rules (``_window``): seen in the mask when shorter than the local
    length, else the module's ``attention_chunk_size``.  Chunks count tokens by their index in
    the sequence, as one process does; key padding would shift them per row (refused)."""
    module_chunk = model_facts.chunk_size(model_facts.module_of(root, node), root)
    seen = meaning.chunk if meaning is not None else None

    def refuse(reason: str) -> NoReturn:
        _refuse(node, f"its layer is chunked attention with attention_chunk_size={module_chunk} "
                      f"and the call has {'no mask' if meaning is None else meaning.describe()} "
                      f"(is_causal={causal}): {reason}",
                "train without padding in the batch (pack documents instead), or run with "
                "hp=cp=1", error=LoongTokenMixingError)

    chunk, source = _seen_or_declared("chunk", seen, module_chunk, causal, tokens, sp, refuse)
    if chunk is not None and meaning is not None and meaning.padding:
        refuse("transformers counts each row's chunks from its left padding")
    return chunk, source


def _mask_cause(mask: Any) -> str:
    """What built an attention mask, from the graph inputs and ops it comes from."""
    ops = set()
    for n in ancestors([mask]):
        if n.op == "placeholder" and "attention_mask" in n.name and n.meta.get("grapharg"):
            return "built from the attention_mask passed to the model (padding)"
        ops.add(n.target if isinstance(n.target, str) else getattr(n.target, "__name__", ""))
    if "diff" in ops:
        return ("built by transformers from position_ids: it treats positions that do not "
                "increase by one as packed documents (under torch.compile it does so whenever "
                "use_cache=False or gradient checkpointing is on)")
    if "attention_mask" in getattr(mask, "name", ""):
        return "passed into this block from outside (a mask built by the model)"
    return "built by the model over this rank's tokens"


def _fake_attention(q, k, v, kwargs: dict) -> Any:
    """The new node's fake output, from attention_2d's own fake kernels (exact shape and strides).

    Also runs attention_2d's input checks at compile time, on every rank alike."""
    values = [_example(n) for n in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in values):
        return None
    kwargs = {key: _example(a) if isinstance(a, torch.fx.Node) else a for key, a in kwargs.items()}
    with values[0].fake_mode:
        return attention_2d(*values, **kwargs)


def _bind(node: torch.fx.Node, params: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(params, node.args))
    bound.update(node.kwargs)
    return bound


def _autocast_dtype(graph: torch.fx.Graph, node: torch.fx.Node, q: Any, cache: dict) -> torch.dtype | None:
    """The dtype autocast would cast this SDPA call's inputs to, or None.

    SDPA is on autocast's lower-precision list (CPU and CUDA): under ``torch.autocast`` it
    casts q, k and v to autocast's dtype before it runs.  The op that replaces it is no
    autocast op, so the rewrite applies the same casts itself."""
    example = _example(q)
    if not isinstance(example, torch.Tensor):
        return None
    key = (graph, example.device.type)
    if key not in cache:
        cache[key] = autocast_dtypes(graph, example.device.type)
    return cache[key].get(node)


def _cast(graph: torch.fx.Graph, anchor: torch.fx.Node, tensor: Any, dtype: torch.dtype) -> Any:
    """``tensor.to(dtype)`` before ``anchor`` where autocast would cast it (a floating tensor
    of another dtype, float64 excepted), else ``tensor``."""
    example = _example(tensor)
    if not (isinstance(example, torch.Tensor) and example.is_floating_point()
            and example.dtype not in (dtype, torch.float64)):
        return tensor
    with graph.inserting_before(anchor):
        new = graph.call_method("to", (tensor, dtype))
    _copy_meta(anchor, new)
    with example.fake_mode if hasattr(example, "fake_mode") else contextlib.nullcontext():
        new.meta["example_value"] = example.to(dtype)
    return new


def _specialised(scale: Any) -> tuple[Any, bool]:
    """``(scale, specialised)``: a scale Dynamo made symbolic, as the number it is in this call.

    A model's ``scaling`` is a Python float; when a second model runs the same attention code
    with another one (transformers' shared ``sdpa_attention_forward``), Dynamo's automatic
    dynamic recompiles with the float as a symbol.  Still one number per call: reading its
    value adds a guard on it, so another value compiles anew instead of reusing this graph."""
    value = scale.meta.get("example_value") if isinstance(scale, torch.fx.Node) else None
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return float(value), True
    return scale, False


def _refuse_flash_extras(node: torch.fx.Node, args: dict[str, Any]) -> None:
    for key in ("window_size", "softcap", "alibi_slopes", "return_attn_probs"):
        if args[key] != FLASH_DEFAULTS[key]:
            _refuse(node, f"flash_attn_func's {key}={args[key]!r} is not supported by 2D-Attention",
                    f"leave {key} at its default {FLASH_DEFAULTS[key]!r}")


def _refuse(node: torch.fx.Node, reason: str, fix: str, error=LoongUnsupportedError) -> NoReturn:
    raise error(
        f"attention call {node.name} at {source_line(node)} (module {module_path(node)})",
        f"it cannot be distributed exactly: {reason}", fix)


def _example(node: Any):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _heads(node: Any) -> int | None:
    found = shape(node)
    return None if found is None else int(found[1])


def _head_dim(node: Any) -> int:
    found = shape(node)
    return int(found[-1]) if found else 1


def _transposed(value: Any) -> Any:
    return value.transpose(1, 2) if isinstance(value, torch.Tensor) else value


def _insert_before(graph: torch.fx.Graph, anchor: torch.fx.Node, fn, args: tuple) -> torch.fx.Node:
    with graph.inserting_before(anchor):
        new = graph.call_function(fn, args)
    _copy_meta(anchor, new)
    if isinstance(args[0], torch.fx.Node) and fn is torch.transpose:
        new.meta["example_value"] = _transposed(_example(args[0]))
    return new


def _copy_meta(src: torch.fx.Node, dst: torch.fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "example_value", "tensor_dict"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
