"""Rewrite attention call sites into LoongTrain's 2D-Attention.

Contract
--------
stage:    dynamo (torch IR, before AOTAutograd)
applies:  when ``hp * cp > 1``
matches:  ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
          enable_gqa)`` and flash-attn's ``flash_attn_func`` (as Dynamo traces it: its
          autograd.Function around ``torch.ops.flash_attn._flash_attn_forward``, recognised by
          ``passes/flash_match.py``), in the graph and in the bodies of activation checkpointing; KV heads repeated before the call by
          ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``) or
          ``repeat_interleave(n, dim=1)``.
emits:    one ``loong_compile.ops.attention_2d`` call per site, on the un-repeated KV, with the
          mesh's group names as constant arguments; it traces into the seq all-to-all and
          Double-Ring custom ops under AOTAutograd.
refuses:  (``LoongUnsupportedError`` naming the node, its source line, the reason and the fix)
          an ``attn_mask`` (saying what built it: padding, transformers' packed-sequence
          detection, a local causal mask), ``dropout_p > 0``, attention inside another
          higher-order op's body; (``LoongTokenMixingError``) a causal call whose module has a
          sliding window shorter than the global sequence (transformers dropped the window
          because it saw only the local length), a RoPE that changes with the sequence length
          beyond its threshold.
reports:  each rewritten site (source line, module, heads, KV heads, un-repeated or not, causal,
          scale, window checked, mesh sizes, the HOP body it sits in).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.errors import LoongTokenMixingError, LoongUnsupportedError
from loong_compile.ops import attention_2d
from loong_compile.passes import model_facts
from loong_compile.passes.base import PassContext
from loong_compile.passes.flash_match import match_flash_attn
from loong_compile.passes.fx_util import module_path, source_line
from loong_compile.passes.subgraphs import graph_scopes

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False}
FLASH_DEFAULTS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                  "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
                  "return_attn_probs": False}
MASKS_LATER = ("masks are not distributed yet (packed documents, padding and windows: issue 13); "
               "until then pass no attention_mask, leave use_cache at its default and gradient "
               "checkpointing off (both make transformers build a mask), or run with hp=cp=1")


# The fact this pass provides: every attention call of the graph is rewritten to 2D-Attention.
ATTENTION_SITES = "attention_sites"


class Attention2DPass:
    name = "attention_2d"
    stage = "dynamo"
    requires: tuple[str, ...] = ()
    provides = (ATTENTION_SITES,)

    def enabled(self, config) -> bool:
        return config.sp > 1

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        root = model_facts.compiled_module()
        scopes = [s for s in graph_scopes(gm)  # flash-attn's own Function body: matched outside
                  if s.caller is None or match_flash_attn(s.caller) is None]
        sites = [(scope, n) for scope in scopes for n in scope.module.graph.nodes
                 if n.op == "call_function"
                 and (n.target in SDPA_TARGETS or match_flash_attn(n) is not None)]
        for scope, node in sites:
            if not scope.inline:
                _refuse(node, f"it sits inside a {scope.hop} body, whose computation the "
                              "backend cannot rewrite as a whole",
                        "call attention outside the higher-order op, or run with hp=cp=1")
        rewritten = [_rewrite(scope.module.graph, node, ctx, root) | {"inside": scope.hop}
                     for scope, node in sites]
        for module in {id(m): m for m in [gm] + [s.module for s, _ in sites]}.values():
            module.graph.eliminate_dead_code()
            module.graph.lint()
            module.recompile()
        summary: dict[str, Any] = {"matched": len(sites), "changed": rewritten,
                                   "model": type(root).__name__ if root is not None else None}
        rope = _check_rope(root, rewritten, ctx)
        if rope:
            summary["rope"] = rope
        return summary


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


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext,
             root: torch.nn.Module | None) -> dict:
    flash = match_flash_attn(node)
    is_flash = flash is not None
    args = _flash_args(flash) if is_flash else _bind(node, SDPA_PARAMS, SDPA_DEFAULTS)
    if is_flash:
        q, k, v = args["q"], args["k"], args["v"]
        causal, scale = args["causal"], args["softmax_scale"]
        _refuse_flash_extras(node, args)
    else:
        q, k, v = args["query"], args["key"], args["value"]
        causal, scale = args["is_causal"], args["scale"]
        if args["attn_mask"] is not None:
            _refuse(node, f"it has an attn_mask, {_mask_cause(args['attn_mask'])}", MASKS_LATER)
    if not (isinstance(args["dropout_p"], (int, float)) and args["dropout_p"] == 0):
        _refuse(node, f"dropout_p={args['dropout_p']!r}; attention dropout over a sharded "
                      "sequence would not equal one process's",
                "set the attention dropout to 0 (e.g. attention_dropout=0.0 in the model config)")
    if not isinstance(causal, bool) or not (scale is None or isinstance(scale, (int, float))):
        _refuse(node, f"is_causal={causal!r} / scale={scale!r} are not constants",
                "pass Python bool/float values")
    tokens = _static(_shape(q)[1 if is_flash else 2])
    window = _check_window(node, root, causal, tokens, ctx.config.sp)

    # flash-attn takes fewer KV heads as they are; SDPA callers often repeat them first
    k_unrepeated, v_unrepeated = (None, None) if is_flash else (_unrepeated_kv(k), _unrepeated_kv(v))
    unrepeat = (k_unrepeated is not None and v_unrepeated is not None
                and _heads(k_unrepeated) == _heads(v_unrepeated))
    if unrepeat:
        k, v = k_unrepeated, v_unrepeated
    if is_flash:  # flash_attn_func takes (B, S, H, D); attention_2d takes SDPA's (B, H, S, D)
        q, k, v = (_insert_before(graph, node, torch.transpose, (t, 1, 2)) for t in (q, k, v))
    kwargs = {"is_causal": causal, "scale": None if scale is None else float(scale),
              "enable_gqa": is_flash or unrepeat or bool(args["enable_gqa"]),
              **ctx.mesh.attention_kwargs()}
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
        "kv_unrepeated": unrepeat, "is_causal": causal, "tokens_per_rank": tokens,
        "sliding_window": window,
        "scale": kwargs["scale"] if scale is not None else 1 / math.sqrt(_head_dim(q)),
        "hp": ctx.config.hp, "cp": ctx.config.cp, "inner_ring": ctx.config.inner_ring,
        "placement": ctx.config.placement,
    }


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


def _check_window(node: torch.fx.Node, root, causal: bool, tokens: int | None,
                  sp: int) -> int | None:
    """Refuse a call whose module has a window shorter than the global sequence.

    The call reached us without a mask, so the model decided no window was needed: it saw only
    this rank's tokens.  A window at least as long as the global sequence changes nothing."""
    window = model_facts.sliding_window(model_facts.module_of(root, node), root)
    if window is not None and (tokens is None or window < tokens * sp):
        length = "a dynamic length" if tokens is None else f"{tokens * sp} tokens"
        _refuse(node, f"its module has sliding_window={window} but the call has no mask "
                      f"(is_causal={causal}): the model decided from this rank's share of the "
                      f"tokens that no window applies, while the sequence has {length}",
                "windows are not distributed yet (issue 13): set sliding_window=None (or >= the "
                "sequence length) in the config to train with full causal attention, or run with "
                "hp=cp=1", error=LoongTokenMixingError)
    return window


def _mask_cause(mask: Any) -> str:
    """What built an attention mask, from the graph inputs and ops it comes from."""
    seen, todo, ops = set(), [mask], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and "attention_mask" in n.name and n.meta.get("grapharg"):
            return "built from the attention_mask passed to the model (padding)"
        ops.add(n.target if isinstance(n.target, str) else getattr(n.target, "__name__", ""))
        todo.extend(n.all_input_nodes)
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
    with values[0].fake_mode:
        return attention_2d(*values, **kwargs)


def _bind(node: torch.fx.Node, params: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(params, node.args))
    bound.update(node.kwargs)
    return bound


def _refuse_flash_extras(node: torch.fx.Node, args: dict[str, Any]) -> None:
    for key in ("window_size", "softcap", "alibi_slopes", "return_attn_probs"):
        if args[key] != FLASH_DEFAULTS[key]:
            _refuse(node, f"flash_attn_func's {key}={args[key]!r} is not supported by 2D-Attention",
                    f"leave {key} at its default {FLASH_DEFAULTS[key]!r}")


def _refuse(node: torch.fx.Node, reason: str, fix: str, error=LoongUnsupportedError) -> None:
    raise error(
        f"attention call {node.name} at {source_line(node)} (module {module_path(node)})",
        f"it cannot be distributed exactly: {reason}", fix)


def _unrepeated_kv(node: Any) -> torch.fx.Node | None:
    """The (B, H_kv, S, D) tensor that ``node`` repeats head-wise as repeat_interleave does, or None.

    Recognised: ``x.repeat_interleave(n, dim=1)`` and Hugging Face's ``repeat_kv``:
    ``x[:, :, None, :, :].expand(B, H_kv, n, S, D).reshape(B, H_kv * n, S, D)``.  Both map query
    head ``h`` to KV head ``h // n``.  (``x.repeat(1, n, 1, 1)`` maps it to ``h % H_kv``: not
    matched, the call then keeps the repeated heads.)
    """
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    if node.target in ("repeat_interleave", torch.repeat_interleave):
        src = node.args[0]
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        return src if dim == 1 and _rank(src) == 4 else None
    if node.target in ("reshape", "view", torch.reshape):
        expanded = node.args[0]
        if not (isinstance(expanded, torch.fx.Node) and expanded.target == "expand"):
            return None
        unsqueezed = expanded.args[0]
        src = _unsqueezed_at_2(unsqueezed)
        if src is None or _rank(src) != 4:
            return None
        out_shape, in_shape = _shape(node), _shape(src)
        if out_shape is None or in_shape is None:
            return None
        # same batch, sequence, head dim; heads multiplied
        if (out_shape[0], out_shape[2], out_shape[3]) == (in_shape[0], in_shape[2], in_shape[3]) \
                and out_shape[1] % in_shape[1] == 0:
            return src
    return None


def _unsqueezed_at_2(node: Any) -> torch.fx.Node | None:
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target == operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None, None, None)
        if len(index) in (3, 5) and index[0] == full and index[1] == full and index[2] is None \
                and all(i == full for i in index[3:]):
            return node.args[0]
        return None
    if node.target in ("unsqueeze", torch.unsqueeze):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        return node.args[0] if dim == 2 else None
    return None


def _example(node: Any):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _shape(node: Any) -> tuple | None:
    value = _example(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _rank(node: Any) -> int | None:
    shape = _shape(node)
    return None if shape is None else len(shape)


def _heads(node: Any) -> int | None:
    shape = _shape(node)
    return None if shape is None else int(shape[1])


def _head_dim(node: Any) -> int:
    shape = _shape(node)
    return int(shape[-1]) if shape else 1


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
