"""Recognise key/value heads repeated for grouped-query attention, to undo the repeat; the shape,
heads and head dim of a (B, H, S, D) value.

SDPA callers often repeat each KV head ``n`` times before the call (Hugging Face's ``repeat_kv``,
``repeat_interleave``); 2D-Attention takes the un-repeated KV with ``enable_gqa`` and carries
``H_kv`` heads around its ring instead of ``H``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.nodes import example_value


def shape(node: Any) -> tuple | None:
    """A node's static shape from its fake value, or None."""
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def rank(node: Any) -> int | None:
    found = shape(node)
    return None if found is None else len(found)


def heads(node: Any) -> int | None:
    """The heads of a (B, H, S, D) tensor."""
    found = shape(node)
    return None if found is None else int(found[1])


def head_dim(node: Any) -> int:
    found = shape(node)
    return int(found[-1]) if found else 1


def unrepeated_kv(node: Any) -> torch.fx.Node | None:
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
        return src if dim == 1 and rank(src) == 4 else None
    if node.target in ("reshape", "view", torch.reshape):
        expanded = node.args[0]
        if not (isinstance(expanded, torch.fx.Node) and expanded.target == "expand"):
            return None
        unsqueezed = expanded.args[0]
        src = _unsqueezed_at_2(unsqueezed)
        if src is None or rank(src) != 4:
            return None
        out_shape, in_shape = shape(node), shape(src)
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
