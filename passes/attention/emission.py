"""What the attention pass writes in place of a call: the casts autocast would have applied, the
KV heads un-repeated (``kv_repeat``), flash-attn's (B, S, H, D) transposed to SDPA's layout and
back, one ``ops.attention_2d`` call with its fake value, and the call's users pointed at it."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from loong_compile.ops import attention_2d
from loong_compile.passes.attention.calls import AttentionCall
from loong_compile.passes.attention.kv_repeat import heads, unrepeated_kv
from loong_compile.passes.fx.autocast import autocast_dtypes
from loong_compile.passes.fx.emit import copy_source_meta
from loong_compile.passes.fx.nodes import example_value


@dataclasses.dataclass
class Written:
    """The ``attention_2d`` call written, its operands and keywords, and what was done to them."""

    node: torch.fx.Node
    q: Any
    k: Any
    v: Any
    kwargs: dict[str, Any]
    kv_unrepeated: bool
    cast_to: torch.dtype | None


def write_attention(graph: torch.fx.Graph, call: AttentionCall, causal: bool, scale: Any,
                    mesh_kwargs: dict[str, Any], mask_kwargs: dict[str, Any], autocast: dict) -> Written:
    """Replace ``call`` (a node of ``graph``) by ``attention_2d`` on its operands, with the
    mesh's and the mask's keywords.  ``autocast``: a cache of autocast's dtype at each node,
    per (graph, device type)."""
    node, q, k, v = call.node, call.q, call.k, call.v
    cast_to = None if call.flash else _autocast_dtype(graph, node, q, autocast)
    if cast_to is not None:
        q, k, v = (_cast(graph, node, t, cast_to) for t in (q, k, v))
    # flash-attn takes fewer KV heads as they are; SDPA callers often repeat them first
    k_unrepeated, v_unrepeated = (None, None) if call.flash else (unrepeated_kv(k), unrepeated_kv(v))
    unrepeat = (k_unrepeated is not None and v_unrepeated is not None
                and heads(k_unrepeated) == heads(v_unrepeated))
    if unrepeat:
        k, v = k_unrepeated, v_unrepeated
    if call.flash:  # flash_attn_func takes (B, S, H, D); attention_2d takes SDPA's (B, H, S, D)
        q, k, v = (_transpose(graph, node, t) for t in (q, k, v))
    kwargs = {"is_causal": causal, "scale": None if scale is None else float(scale),
              "enable_gqa": call.flash or unrepeat or bool(call.enable_gqa), **mesh_kwargs}
    if call.sinks is not None:
        kwargs["sinks"] = call.sinks
    kwargs |= mask_kwargs
    with graph.inserting_before(node):
        new = graph.call_function(attention_2d, (q, k, v), kwargs)
    copy_source_meta(node, new)
    new.meta["example_value"] = _fake_attention(q, k, v, kwargs)
    _replace_output(graph, call, _transpose(graph, node, new) if call.flash else new)
    return Written(new, q, k, v, kwargs, unrepeat, cast_to)


def _replace_output(graph: torch.fx.Graph, call: AttentionCall, result: torch.fx.Node) -> None:
    """Point the call's users at ``result``: SDPA's output is the node, flash-attn's is item 0
    of its (out, lse, probs) tuple (nothing reads the others: refused with the call)."""
    node = call.node
    if not call.flash:
        node.replace_all_uses_with(result)
    else:
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(result)
            if not user.users:
                graph.erase_node(user)
    if not node.users:
        graph.erase_node(node)


def _fake_attention(q, k, v, kwargs: dict) -> Any:
    """The new node's fake output, from attention_2d's own fake kernels (exact shape and strides).

    Also runs attention_2d's input checks at compile time, on every rank alike."""
    values = [example_value(n) for n in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in values):
        return None
    kwargs = {key: example_value(a) if isinstance(a, torch.fx.Node) else a for key, a in kwargs.items()}
    with values[0].fake_mode:
        return attention_2d(*values, **kwargs)


def _autocast_dtype(graph: torch.fx.Graph, node: torch.fx.Node, q: Any, cache: dict) -> torch.dtype | None:
    """The dtype autocast would cast this SDPA call's inputs to, or None.

    SDPA is on autocast's lower-precision list (CPU and CUDA): under ``torch.autocast`` it
    casts q, k and v to autocast's dtype before it runs.  The op that replaces it is no
    autocast op, so the rewrite applies the same casts itself."""
    example = example_value(q)
    if not isinstance(example, torch.Tensor):
        return None
    key = (graph, example.device.type)
    if key not in cache:
        cache[key] = autocast_dtypes(graph, example.device.type)
    return cache[key].get(node)


def _cast(graph: torch.fx.Graph, anchor: torch.fx.Node, tensor: Any, dtype: torch.dtype) -> Any:
    """``tensor.to(dtype)`` before ``anchor`` where autocast would cast it (a floating tensor
    of another dtype, float64 excepted), else ``tensor``."""
    example = example_value(tensor)
    if not (isinstance(example, torch.Tensor) and example.is_floating_point()
            and example.dtype not in (dtype, torch.float64)):
        return tensor
    with graph.inserting_before(anchor):
        new = graph.call_method("to", (tensor, dtype))
    copy_source_meta(anchor, new)
    with example.fake_mode if hasattr(example, "fake_mode") else contextlib.nullcontext():
        new.meta["example_value"] = example.to(dtype)
    return new


def _transpose(graph: torch.fx.Graph, anchor: torch.fx.Node, tensor: torch.fx.Node) -> torch.fx.Node:
    """``torch.transpose(tensor, 1, 2)`` before ``anchor``: between flash-attn's layout and SDPA's."""
    with graph.inserting_before(anchor):
        new = graph.call_function(torch.transpose, (tensor, 1, 2))
    copy_source_meta(anchor, new)
    value = example_value(tensor)
    new.meta["example_value"] = value.transpose(1, 2) if isinstance(value, torch.Tensor) else value
    return new
