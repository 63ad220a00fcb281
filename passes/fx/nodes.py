"""Reading one FX node without running it: its value, an argument by name or place, the name of
the op it calls (torch functions, tensor methods, aten and custom ops alike), whether it is a
weight.  ``example_value`` is Dynamo's fake value (AOTAutograd's graphs carry ``val``)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.passes.fx.op_sets import RANDOM


def example_value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def node_arg(node: torch.fx.Node, key: str, position: int | None, default: Any) -> Any:
    if key in node.kwargs:
        return node.kwargs[key]
    if position is not None and len(node.args) > position:
        return node.args[position]
    return default


def op_name(node: torch.fx.Node) -> str:
    """The op's name as the op-name sets (``fx/op_sets.py``) spell it: a method's name, an aten
    op's without its overload, a function's without leading underscores."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if target in (operator.getitem,):
        return "getitem"
    if target is F.pad or getattr(target, "__name__", "") == "pad":
        return "pad"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.__name__.split(".")[0]
    return getattr(target, "__name__", str(target)).lstrip("_")


def is_weight(node: torch.fx.Node) -> bool:
    """Whether a Dynamo graph input is a parameter or buffer of the model."""
    grapharg = node.meta.get("grapharg")
    source = getattr(getattr(grapharg, "source", None), "name", "")
    source = source() if callable(source) else str(source)
    return "_parameters" in source or "_buffers" in source or "parameters_" in node.name \
        or "buffers_" in node.name


def getitem_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The getitem nodes reading a multi-output op's results (the attention's out, lse, ...)."""
    return [u for u in node.users if u.target is operator.getitem]


def draws_random(node: torch.fx.Node) -> bool:
    """Whether a call draws random numbers: an op of ``op_sets.RANDOM``, but for a dropout with
    ``p == 0`` or ``training=False`` (the identity)."""
    name = op_name(node)
    if name not in RANDOM:
        return False
    if "dropout" in name:
        return node_arg(node, "p", 1, 0.5) != 0 and node_arg(node, "training", 2, True) is not False
    return True
