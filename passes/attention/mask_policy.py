"""The mask 2D-Attention applies to one call, proven: what its ``attn_mask`` means (``mask_proof``
on probes, read by ``input_roles``' ``Prover``), the window and the chunk (seen in the mask, else
declared by the module: ``model_facts``) and the document ids (``document_ids``); refused where
the mask, the module and the layout disagree.

A window ``W`` is visible in a mask of ``L`` tokens only when ``W < L``; transformers builds no
mask at all when ``L < W`` and nothing else needs one.  So the module's window must show in the
mask when shorter than ``L``, and is taken from the module otherwise; a chunk likewise.  On one
rank (``sp = 1``) the mask covers the whole sequence and shows any window or chunk shorter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, NoReturn

import torch
import torch.fx

from loong_compile.errors import LoongTokenMixingError
from loong_compile.passes.attention import model_facts
from loong_compile.passes.fx import traced_modules
from loong_compile.passes.attention.calls import AttentionCall, refuse
from loong_compile.passes.attention.document_ids import DocumentIds
from loong_compile.passes.attention.input_roles import Prover
from loong_compile.passes.attention.kv_repeat import shape
from loong_compile.passes.attention.mask_proof import MaskMeaning, MaskNotProven
from loong_compile.passes.fx.nodes import example_value
from loong_compile.passes.fx.subgraphs import Scope
from loong_compile.passes.fx.walks import ancestors

MASK_FIX = ("build the mask as transformers does, from position_ids (packed documents restart "
            "at 0), the tokenizer's 2-D attention_mask (padding) and the config's sliding_window, "
            "or call loong_compile.ops.attention_2d(..., document_ids=, window=) yourself; "
            "otherwise run with hp=cp=1")


@dataclasses.dataclass(frozen=True)
class Extent:
    """A call's window and chunk (None: none shorter than the global sequence) and where each
    came from: "mask" (the probes saw it) or "module" (its ``sliding_window`` or
    ``attention_chunk_size``)."""

    window: int | None
    window_from: str | None
    chunk: int | None
    chunk_from: str | None


def prove_mask(call: AttentionCall, prover: Prover, eager_calls: Collection) -> MaskMeaning | None:
    """What the call's ``attn_mask`` means (None: it has none); refused when unproven, when it
    hides padded keys from a chain ``eager_attention`` wrote (``eager_calls``), or when the call
    also asks for ``is_causal``."""
    if call.attn_mask is None:
        return None
    node, mask = call.node, call.attn_mask
    if not isinstance(mask, torch.fx.Node):
        refuse(node, f"its attn_mask is the constant {mask!r}", MASK_FIX)
    try:
        meaning = prover.prove(mask)
    except MaskNotProven as e:
        refuse(node, f"it has an attn_mask, {mask_cause(mask)}, and {e}", MASK_FIX)
    if meaning.padding and node in eager_calls:
        # one process gives a query that sees no key (a left-padded token, whose output
        # transformers' labels put in the loss when the next token is real) the mean of every
        # value in its row (the additive mask's uniform softmax; NaN in float64), which no
        # attention kernel computes
        refuse(node, "it is attention written as ops whose mask hides padded keys: a query that "
                     "sees no key (left padding) gets, in one process, the mean of every value "
                     "of its row (NaN in float64), which 2D-Attention does not compute",
               "use attn_implementation='sdpa', pad on the right, or pack the documents "
               "(position_ids) instead of padding them")
    if call.causal is not False:
        refuse(node, f"it has both an attn_mask and is_causal={call.causal!r}",
               "pass one of them, as F.scaled_dot_product_attention requires")
    return meaning


def extent(node: torch.fx.Node, root: torch.nn.Module | None, causal: bool, tokens: int | None,
           sp: int, meaning: MaskMeaning | None) -> Extent:
    """The window and the chunk 2D-Attention applies to the call (``tokens`` per rank of
    ``sp``)."""
    if sp == 1:   # a mask over the whole sequence shows any window or chunk shorter
        (window, window_from), (chunk, chunk_from) = (
            (size, "mask" if size else None) for size in (meaning.window, meaning.chunk))
        if chunk is not None and meaning.padding:
            refuse(node, "its chunks count from each row's left padding in transformers",
                   "keep the mask (one rank computes it as it is)", LoongTokenMixingError)
        return Extent(window, window_from, chunk, chunk_from)
    return Extent(*_window(node, root, causal, tokens, sp, meaning),
                  *_chunk(node, root, causal, tokens, sp, meaning))


def mask_keywords(call: AttentionCall, meaning: MaskMeaning | None, sizes: Extent,
                  documents: DocumentIds, scope: Scope, sp: int, causal: bool) -> dict[str, Any]:
    """``attention_2d``'s keywords for the mask: ``document_ids``, ``window`` and the step's
    ``mask_plan`` made from them (none of them for one document without a window)."""
    try:
        document_ids = documents.for_call(meaning, scope)
    except MaskNotProven as e:
        refuse(call.node, f"its attn_mask is {meaning.describe()}, but {e}",
               "pass position_ids=batch.position_ids (and attention_mask=batch.attention_mask) "
               "from loong_compile.shard_batch to the model")
    tokens = call.tokens
    if sizes.chunk is not None:
        document_ids = documents.chunked(document_ids, sizes.chunk, shape(call.q)[0], tokens * sp,
                                         scope, example_value(call.q))
    keywords: dict[str, Any] = {}
    if document_ids is not None:
        keywords["document_ids"] = document_ids
    if sizes.window is not None:
        keywords["window"] = sizes.window
    if keywords:
        keywords["mask_plan"] = documents.plan_for(document_ids, tokens * sp, causal, sizes.window,
                                                   scope, example_value(call.q).fake_mode)
    return keywords


def mask_cause(mask: Any) -> str:
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


def _window(node: torch.fx.Node, root, causal: bool, tokens: int | None, sp: int,
            meaning: MaskMeaning | None) -> tuple[int | None, str | None]:
    """The window and where it came from: the mask's, else the module's ``sliding_window``."""
    attention = traced_modules.module_of(root, node)
    path = traced_modules.traced_in(node)
    if attention is None and path is not None:
        # the window lives on the module (or its config): not finding it is no proof of none
        refuse(node, f"it was traced in the module {path}, which the backend cannot find "
                     "from the compiled frame, so it cannot read the sliding window the module "
                     "may apply", "compile the model (or a function that calls the model "
                     "held in a variable or attribute), or run with hp=cp=1",
               error=LoongTokenMixingError)
    try:
        module_window = model_facts.sliding_window(attention, root)
    except model_facts.UnknownLayerType as kind:
        refuse(node, f"its layer's attention type is {kind}, and 2D-Attention knows the masks "
                     f"of {model_facts.FULL_LAYER}, {model_facts.WINDOWED_LAYER} and "
                     f"{model_facts.CHUNKED_LAYER} only",
               "run with hp=cp=1", error=LoongTokenMixingError)
    seen = meaning.window if meaning is not None else None
    mask = "no mask" if meaning is None else f"a mask proven to be {meaning.describe()}"

    def refuse_window(reason: str) -> NoReturn:
        refuse(node, f"its module has sliding_window={module_window} and the call has {mask} "
                     f"(is_causal={causal}): {reason}",
               "set sliding_window=None (or >= the sequence length) in the config to train "
               "with full causal attention, or run with hp=cp=1", error=LoongTokenMixingError)

    return _seen_or_declared("window", seen, module_window, causal, tokens, sp, refuse_window)


def _chunk(node: torch.fx.Node, root, causal: bool, tokens: int | None, sp: int,
           meaning: MaskMeaning | None) -> tuple[int | None, str | None]:
    """The chunk of chunked attention and where it came from, by the window's rules: the mask's,
    else the module's ``attention_chunk_size``.  Chunks count tokens by their index in the
    sequence, as one process does; key padding would shift them per row (refused)."""
    module_chunk = model_facts.chunk_size(traced_modules.module_of(root, node), root)
    seen = meaning.chunk if meaning is not None else None

    def refuse_chunk(reason: str) -> NoReturn:
        refuse(node, f"its layer is chunked attention with attention_chunk_size={module_chunk} "
                     f"and the call has {'no mask' if meaning is None else meaning.describe()} "
                     f"(is_causal={causal}): {reason}",
               "train without padding in the batch (pack documents instead), or run with "
               "hp=cp=1", error=LoongTokenMixingError)

    chunk, source = _seen_or_declared("chunk", seen, module_chunk, causal, tokens, sp, refuse_chunk)
    if chunk is not None and meaning is not None and meaning.padding:
        refuse_chunk("transformers counts each row's chunks from its left padding")
    return chunk, source


def _seen_or_declared(noun: str, seen: int | None, declared: int | None, causal: bool,
                      tokens: int | None, sp: int,
                      refuse_size: Callable[[str], NoReturn]) -> tuple[int | None, str | None]:
    """A window's or a chunk's size: what the mask shows (it must be what the module declares),
    else the module's when shorter than the global sequence, which a rank's mask of ``tokens``
    cannot show only when the size is at least ``tokens``."""
    if seen is not None:
        if declared != seen:
            refuse_size(f"the mask's {noun} is {seen}")
        return seen, "mask"
    if declared is None:
        return None, None
    if tokens is None:
        refuse_size(f"the length is dynamic, so whether the {noun} matters cannot be decided")
    if declared >= tokens * sp:
        return None, None
    if not causal:
        refuse_size(f"2D-Attention applies a {noun} to causal attention only")
    if declared < tokens:
        refuse_size(f"the {noun} is shorter than this rank's {tokens} tokens, yet the model "
                    "applied none")
    return declared, "module"
