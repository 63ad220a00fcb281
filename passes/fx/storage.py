"""Views and the storage behind them: which node owns a value's memory, and how many bytes it
holds."""

from __future__ import annotations

import operator

import torch
import torch.fx

from loong_compile._compat.aot import size_hint

aten = torch.ops.aten


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value shares its input's storage (``_unsafe_view`` does too)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0])
    target = node.target
    return target is aten._unsafe_view.default or bool(getattr(target, "is_view", False))


_LAYOUT_COPIES = (aten.clone.default, aten.contiguous.default, aten.reshape.default)


def is_layout_op(node: torch.fx.Node) -> bool:
    """A view, or a copy that only changes the layout (the SeqAlltoAll's pack and unpack)."""
    return is_view(node) or (node.op == "call_function" and node.target in _LAYOUT_COPIES)


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node that owns ``node``'s storage (``node`` itself unless it is a view)."""
    while is_view(node):
        node = node.args[0].args[0] if node.target is operator.getitem else node.args[0]
    return node


def view_path(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The view nodes from ``base_of(node)`` (exclusive) to ``node`` (inclusive), in order."""
    path = []
    while is_view(node):
        path.append(node)
        if node.target is operator.getitem:
            path.append(node.args[0])
            node = node.args[0].args[0]
        else:
            node = node.args[0]
    return path[::-1]


def nbytes(node: torch.fx.Node) -> int:
    """Bytes of the storage behind ``node``'s value (for a symbolic size: at its example value,
    read without a guard, so a dimension marked dynamic stays dynamic)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return size_hint(val.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return size_hint(val.numel()) * val.element_size()
