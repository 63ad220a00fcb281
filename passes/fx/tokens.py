"""The token axis of a Dynamo graph on one rank: how many tokens the rank holds, and whether an
axis of some size holds tokens.  Read without guarding a dynamic length."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.ops import attention_2d
from loong_compile.passes.fx.nodes import example_value, is_weight


def local_token_count(gm: torch.fx.GraphModule) -> int | None:
    """Tokens per rank: the sequence axis of the rewritten attention's queries, else of the first
    non-parameter input (``(B, T)`` ids or ``(B, T, D)`` states), else None."""
    for node in gm.graph.nodes:
        if node.target is attention_2d:
            return example_value(node.args[0]).shape[-2]
    for node in gm.graph.find_nodes(op="placeholder"):
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not is_weight(node):
            return value.shape[1]
    return None


def counts_tokens(size: Any, tokens: Any) -> bool:
    """Whether an axis of this size holds tokens: a multiple of the local count T.  With a dynamic
    T (``mark_dynamic``) an axis holds tokens when its size is an expression in T's symbol;
    comparing symbolic sizes numerically would add guards."""
    if isinstance(tokens, torch.SymInt):
        return isinstance(size, torch.SymInt) and bool(
            tokens.node.expr.free_symbols & size.node.expr.free_symbols)
    return isinstance(size, int) and size > 0 and size % tokens == 0
