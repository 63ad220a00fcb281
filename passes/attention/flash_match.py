"""Recognise flash-attn's ``flash_attn_func`` in a Dynamo graph, where it appears traced.

Dynamo does not leave ``flash_attn_func`` in the graph: it traces into
``FlashAttnFunc`` (a ``torch.autograd.Function``) and emits one
``torch.ops.higher_order.autograd_function_apply(fwd_body, bwd_body, *operands)``
node, whose forward subgraph pads the head dim to a multiple of 8 and calls
``torch.ops.flash_attn._flash_attn_forward`` (flash-attn 2.7-2.8; checked on
torch 2.13).  When no input requires grad, Dynamo inlines the Function and
the op call sits in the graph itself.  ``match_flash_attn(node)`` reads either
form and returns the call's operands (outer graph nodes) and settings, or
``None`` for any other node.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

# flash-attn 2.8's _flash_attn_forward schema, in order
FORWARD_PARAMS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
                  "window_size_right", "softcap", "alibi_slopes", "return_softmax")


@dataclass(frozen=True)
class FlashAttnCall:
    """One traced ``flash_attn_func``; q, k, v are outer nodes in flash-attn's (B, S, H, D).

    ``softmax_scale`` is always a number: FlashAttnFunc resolves ``None`` to
    ``head_dim ** -0.5`` (of the unpadded head dim) before tracing reaches the op.
    The attention output is ``getitem(node, 0)`` in both traced forms (inlined,
    it is then cut back to the unpadded head dim by a slice that stays valid for
    an unpadded replacement); with ``return_attn_probs`` the LSE and
    probabilities are items 1 and 2, and ``reads_attn_probs`` says whether the
    graph reads them.
    """

    node: torch.fx.Node
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    causal: Any
    softmax_scale: Any
    dropout_p: Any
    window_size: tuple
    softcap: Any
    alibi_slopes: torch.fx.Node | None
    reads_attn_probs: bool


def match_flash_attn(node: torch.fx.Node) -> FlashAttnCall | None:
    """The flash_attn_func call ``node`` is, or ``None``.

    Two traced forms: with an input that requires grad, an ``autograd_function_apply``
    whose forward subgraph calls the op; with none (inference), Dynamo inlines the
    Function and ``node`` is the ``_flash_attn_forward`` call itself, after the pads.
    """
    if node.op != "call_function":
        return None
    if _is_flash_forward(node):
        return _record(node, node, _unpadded, _uses_items_after_first(node))
    apply_op = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    if apply_op is None or node.target is not apply_op:
        return None
    forward = _subgraph(node, node.args[0])
    if forward is None:
        return None
    calls = [n for n in forward.graph.nodes if n.op == "call_function" and _is_flash_forward(n)]
    if len(calls) != 1:
        return None
    operands = dict(zip([p for p in forward.graph.nodes if p.op == "placeholder"], node.args[2:]))
    return _record(node, calls[0], lambda value: operands.get(_unpadded(value)),
                   _uses_items_after_first(node))


def _record(node, call, outer, reads_attn_probs) -> FlashAttnCall | None:
    """The call's settings, its tensors mapped by ``outer`` to nodes of ``node``'s graph."""
    args = dict(zip(FORWARD_PARAMS, call.args))
    args.update(call.kwargs)
    q, k, v = (outer(args[name]) for name in ("q", "k", "v"))
    alibi = args.get("alibi_slopes")
    alibi_outer = outer(alibi) if isinstance(alibi, torch.fx.Node) else None
    if q is None or k is None or v is None or (alibi is not None and alibi_outer is None):
        return None
    return FlashAttnCall(
        node=node, q=q, k=k, v=v, causal=args.get("causal"),
        softmax_scale=args.get("softmax_scale"), dropout_p=args.get("dropout_p"),
        window_size=(args.get("window_size_left"), args.get("window_size_right")),
        softcap=args.get("softcap"), alibi_slopes=alibi_outer,
        reads_attn_probs=reads_attn_probs)


def _uses_items_after_first(node: torch.fx.Node) -> bool:
    """Whether the graph reads items 1 or 2 (LSE, probabilities) of ``return_attn_probs``."""
    return any(user.target is operator.getitem and user.args[1] in (1, 2) and user.users
               for user in node.users)


def _subgraph(node: torch.fx.Node, body: Any) -> torch.fx.GraphModule | None:
    owner = node.graph.owning_module
    if owner is None or not (isinstance(body, torch.fx.Node) and body.op == "get_attr"):
        return None
    module = getattr(owner, body.target, None)
    return module if isinstance(module, torch.fx.GraphModule) else None


def _is_flash_forward(n: torch.fx.Node) -> bool:
    op = getattr(torch.ops.flash_attn, "_flash_attn_forward", None)
    return op is not None and getattr(n.target, "overloadpacket", n.target) is op


def _unpadded(value: Any) -> Any:
    """The tensor FlashAttnFunc padded (zeros after the head dim) or made contiguous."""
    while isinstance(value, torch.fx.Node):
        if value.op == "call_method" and value.target == "contiguous":
            value = value.args[0]
        elif (value.op == "call_function"
              and value.target in (torch._C._nn.pad, torch.nn.functional.pad)
              and _pads_last_dim_with_zeros(value)):
            value = value.args[0]
        else:
            return value
    return value


def _pads_last_dim_with_zeros(pad: torch.fx.Node) -> bool:
    params = dict(zip(("input", "pad", "mode", "value"), pad.args))
    params.update(pad.kwargs)
    widths = params.get("pad")
    return (isinstance(widths, (list, tuple)) and len(widths) == 2 and widths[0] == 0
            and params.get("mode", "constant") == "constant" and params.get("value") in (None, 0))
