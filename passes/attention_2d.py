"""Rewrite attention call sites into LoongTrain's 2D-Attention.

Contract
--------
stage:    dynamo (torch IR, before AOTAutograd)
applies:  when ``hp * cp > 1``
matches:  ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
          enable_gqa)`` and flash-attn's ``flash_attn_func`` (when installed); KV heads repeated
          before the call by ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``) or
          ``repeat_interleave(n, dim=1)``.
emits:    one ``loong_compile.ops.attention_2d`` call per site, on the un-repeated KV, with the
          mesh's group names as constant arguments; it traces into the seq all-to-all and
          Double-Ring custom ops under AOTAutograd.
refuses:  an ``attn_mask``, ``dropout_p > 0``, or anything else that 2D-Attention cannot compute
          exactly: a ``LoongUnsupportedError`` naming the node, its source line and the reason,
          with or without ``strict`` (computing such a call on a rank's local tokens alone would
          be wrong over a sharded sequence).  ``strict=True`` also refuses a multi-rank graph
          with no attention at all, which otherwise gets a warning.
reports:  each rewritten site (source line, module, heads, KV heads, un-repeated or not, causal,
          scale, mesh sizes); a warning when a multi-rank graph has no attention at all.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.errors import LoongUnsupportedError
from loong_compile.ops import attention_2d
from loong_compile.passes.base import PassContext

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False}
FLASH_PARAMS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal")
FLASH_DEFAULTS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                  "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
                  "return_attn_probs": False}


def flash_attn_targets() -> tuple:
    """flash-attn's functions that Dynamo leaves in the graph, when the package is installed."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return ()
    return (flash_attn_func,)


class Attention2DPass:
    name = "attention_2d"
    stage = "dynamo"

    def enabled(self, config) -> bool:
        return config.sp > 1

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        graph = gm.graph
        flash = flash_attn_targets()
        sites = [n for n in graph.nodes if n.op == "call_function"
                 and (n.target in SDPA_TARGETS or n.target in flash)]
        rewritten = [_rewrite(graph, node, ctx, is_flash=node.target in flash) for node in sites]
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
        ctx.state[self.name] = [r["node"] for r in rewritten]
        summary: dict[str, Any] = {"matched": len(sites), "changed": rewritten}
        if not sites:
            msg = (f"no attention call found in graph {ctx.graph_id} under hp={ctx.config.hp}, "
                   f"cp={ctx.config.cp}: nothing is distributed, and every sequence-wise op runs on "
                   f"this rank's tokens only")
            if ctx.config.strict:
                raise LoongUnsupportedError(msg, "strict=True requires every graph under a "
                                            "multi-rank mesh to contain an attention call it rewrites",
                                            "check the model calls F.scaled_dot_product_attention "
                                            "or flash_attn_func, or pass strict=False")
            summary["warning"] = msg
            warnings.warn(f"loong_compile: {msg}", stacklevel=2)
        return summary


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext, is_flash: bool) -> dict:
    args = _bind(node, FLASH_PARAMS if is_flash else SDPA_PARAMS,
                 FLASH_DEFAULTS if is_flash else SDPA_DEFAULTS)
    if is_flash:
        q, k, v = args["q"], args["k"], args["v"]
        causal, scale = args["causal"], args["softmax_scale"]
        _refuse_flash_extras(node, args)
    else:
        q, k, v = args["query"], args["key"], args["value"]
        causal, scale = args["is_causal"], args["scale"]
        if args["attn_mask"] is not None:
            _refuse(node, "it has an attn_mask; 2D-Attention computes causal or full attention "
                          "only, and a mask over a sharded sequence cannot be applied per rank",
                    "drop the mask and pass is_causal=True (for a causal model), or run this "
                    "model with hp=cp=1")
    if not (isinstance(args["dropout_p"], (int, float)) and args["dropout_p"] == 0):
        _refuse(node, f"dropout_p={args['dropout_p']!r}; attention dropout over a sharded "
                      "sequence would not equal one process's",
                "set the attention dropout to 0 (e.g. attention_dropout=0.0 in the model config)")
    if not isinstance(causal, bool) or not (scale is None or isinstance(scale, (int, float))):
        _refuse(node, f"is_causal={causal!r} / scale={scale!r} are not constants",
                "pass Python bool/float values")

    k_unrepeated, v_unrepeated = _unrepeated_kv(k), _unrepeated_kv(v)
    unrepeat = (k_unrepeated is not None and v_unrepeated is not None
                and _heads(k_unrepeated) == _heads(v_unrepeated))
    if unrepeat:
        k, v = k_unrepeated, v_unrepeated
    if is_flash:  # flash_attn_func takes (B, S, H, D); attention_2d takes SDPA's (B, H, S, D)
        q, k, v = (_insert_before(graph, node, torch.transpose, (t, 1, 2)) for t in (q, k, v))
    kwargs = {"is_causal": causal, "scale": None if scale is None else float(scale),
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
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return {
        "node": new.name, "replaced": node.name, "source": _source_line(node),
        "module": _module_path(node), "heads": _heads(q), "kv_heads": _heads(k),
        "kv_unrepeated": unrepeat, "is_causal": causal,
        "scale": kwargs["scale"] if scale is not None else 1 / math.sqrt(_head_dim(q)),
        "hp": ctx.config.hp, "cp": ctx.config.cp, "inner_ring": ctx.config.inner_ring,
        "placement": ctx.config.placement,
    }


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


def _refuse(node: torch.fx.Node, reason: str, fix: str) -> None:
    raise LoongUnsupportedError(
        f"attention call {node.name} at {_source_line(node)} (module {_module_path(node)})",
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


def _source_line(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    # the last "File ..., line N" frame and the code under it
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}".strip()
    return "<unknown source>"


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path, _ = list(stack.values())[-1]
    return str(path)
