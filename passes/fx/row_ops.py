"""Which ops treat every row of their operands alike, read from a Dynamo node.

Such an op commutes with a permutation P of the rows, ``f(Y[P]) = f(Y)[P]``: what
``row_permutation`` needs of everything between a sort and its inverse.  An op qualifies when
it is elementwise (its aten op is tagged pointwise and its result has its operands' broadcast
shape), a cast, a view that keeps the first axis, an op along another axis, or a matmul with
the rows on the left and a weight on the right; when its other operands are permuted alike or
the same for every row (broadcast along the first axis); and when its result keeps the rows
as its first axis.  Anything else does not: a reduction or a move along the rows, an index
on them, a product that contracts them, an op this module does not know.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.nodes import example_value, node_arg, op_name
from loong_compile.passes.fx.op_sets import COPIES, DTYPE_CASTS, EXPANDS, INT_CASTS, PROJECTIONS, RESHAPES
from loong_compile.passes.fx.token_ops import full_slice

Node = torch.fx.Node

# ops that change a value's elements one by one, or not at all: every row stays where it is
CASTS = DTYPE_CASTS | INT_CASTS | {"type_as"} | COPIES
_RESHAPES = RESHAPES | EXPANDS
# ops along an axis: (position of ``dim``, its default; None: every axis)
_ALONG = {"chunk": (2, 0), "split": (2, 0), "unbind": (1, 0), "narrow": (1, None),
          "select": (1, None), "softmax": (1, None), "log_softmax": (1, None), "sum": (1, None),
          "mean": (1, None), "amax": (1, None), "amin": (1, None), "var": (1, None),
          "cumsum": (1, None), "topk": (2, -1), "cat": (1, 0)}
_IN_PLACE_OPERATORS = {"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                       "iand", "ior", "ixor", "ilshift", "irshift", "imatmul"}
_ATEN_NAMES = {"truediv": "div"}  # operators whose aten op has another name


def writes(node: Node) -> bool:
    """Whether ``node`` writes into a tensor in place (an in-place method or operator, out=)."""
    name = op_name(node)
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")) \
        or "out" in node.kwargs or node.kwargs.get("inplace") is True


def why_not_rowwise(node: Node, permuted: Collection[Node], rows: int,
                    data: Collection[Node]) -> str | None:
    """None if ``node`` treats every row of its ``permuted`` operands alike and keeps their
    ``rows`` as its result's first axis; else why not.  ``data``: the values computed from
    token data (a weight is not one)."""
    name = op_name(node)
    first = node.args[0] if node.args else None
    if name in PROJECTIONS:
        other = [a for a in node.all_input_nodes if a is not first]
        if first not in permuted or example_value(first).dim() < 2 \
                or any(a in data or example_value(a).dim() > 2 for a in other):
            return f"{name} does not take the permuted rows through a weight"
    elif name == "getitem":
        if isinstance(example_value(first), torch.Tensor) \
                and not _keeps_first(node.args[1], example_value(first)):
            return "indexing selects or moves the permuted rows"
    elif name in _ALONG or name in ("transpose", "permute"):
        if 0 in _axes(node, name, example_value(node.all_input_nodes[0]).dim()):
            return f"{name} works along the permuted rows"
    elif not (name in CASTS or name in _RESHAPES or _pointwise(node)):
        return f"{name} is not known to treat every row alike"
    if name not in PROJECTIONS:
        out = example_value(node)
        for a in node.all_input_nodes:
            if a not in permuted and _spans_rows(example_value(a), out):
                return (f"{name} combines the permuted rows with {a.name}, whose rows are not "
                        "permuted alike")
    if not all(_first_axis(v) == rows for v in _tensors(example_value(node))):
        return f"{name} does not keep the permuted rows as the first axis"
    return None


def _pointwise(node: Node) -> bool:
    """An elementwise op: its aten op is tagged pointwise, and its result has its operands'
    broadcast shape (``max(x, 0)`` has a pointwise overload too, but reduces)."""
    name = op_name(node)
    packet = getattr(torch.ops.aten, _ATEN_NAMES.get(name, name), None)
    out = example_value(node)
    shapes = [tuple(example_value(a).shape) for a in node.all_input_nodes
              if isinstance(example_value(a), torch.Tensor)]
    return isinstance(packet, torch._ops.OpOverloadPacket) and any(
        torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()) \
        and isinstance(out, torch.Tensor) and tuple(out.shape) == torch.broadcast_shapes(*shapes)


def _axes(node: Node, name: str, ndim: int) -> list[int]:
    """The axes an op along an axis (or a transpose) works on or moves."""
    if name == "transpose":
        return [node.args[1] % ndim, node.args[2] % ndim]
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [] if dims[0] % ndim == 0 else [0]
    position, default = _ALONG[name]
    dim = node_arg(node, "dim", position, default)
    if dim is None:
        return list(range(ndim))
    return [d % ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])]


def _keeps_first(index: Any, value: torch.Tensor) -> bool:
    """Whether ``rows[index]`` keeps the first axis whole (slices and ints elsewhere only)."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, Node) or i is None for i in items):
        return False
    if items[0] is Ellipsis:
        return len(items) - 1 < value.dim()
    return full_slice(items[0], value.shape[0])


def _spans_rows(operand: Any, out: Any) -> bool:
    """Whether an operand's values differ along the output's first axis (not broadcast)."""
    if not isinstance(operand, torch.Tensor) or not isinstance(out, torch.Tensor):
        return isinstance(operand, torch.Tensor) and operand.dim() > 0
    at = operand.dim() - out.dim()
    return at >= 0 and operand.shape[at] != 1


def _tensors(value: Any) -> list:
    values = value if isinstance(value, (tuple, list)) else [value]
    return [v if isinstance(v, torch.Tensor) else None for v in values]


def _first_axis(value: Any) -> Any:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None
