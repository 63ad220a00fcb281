"""How the token analysis reads one FX node: the rule its op falls under, the axes it works
on, the indices a product sums over.

``passes/fx/token_analysis.py`` decides what mixes tokens; this module only answers questions
about a node of a Dynamo graph (torch functions, tensor methods, custom ops and
higher-order ops alike) without running it, and without guarding a dynamic length.  What every
stage reads of a node (its value, arguments, op name) is ``passes/fx/nodes.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.nodes import example_value, node_arg
from loong_compile.passes.fx.op_sets import MATMULS
from loong_compile.passes.fx.walks import ancestors

ALONG_AXIS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "diff", "roll", "flip",
              "sort", "argsort", "topk", "kthvalue", "index_select", "gather", "take_along_dim",
              "unfold", "narrow", "split", "chunk", "tensor_split", "unbind", "select", "flatten",
              # writes at chosen places along an axis (dim is their first argument too)
              "index_fill", "index_fill_", "index_copy", "index_copy_", "index_add",
              "index_add_", "scatter", "scatter_", "scatter_add", "scatter_add_",
              "scatter_reduce", "scatter_reduce_"}
REDUCTIONS = {"mean", "nanmean", "amax", "amin", "max", "min", "logsumexp", "softmax",
              "log_softmax", "var", "std", "norm", "prod", "median", "argmax", "argmin", "any",
              "all", "nansum"}
LINEAR = {"add", "sub", "neg", "mul", "truediv", "div", "float", "double", "to", "type",
          "view", "reshape", "contiguous", "clone", "detach", "getitem", "squeeze", "unsqueeze",
          "iadd", "isub", "imul", "itruediv"}
# the products whose summed indices ``contractions`` reads
PRODUCTS = MATMULS | {"bmm", "einsum", "baddbmm"}
COUNTS = {"histc", "bincount"}
POSITIONS = {"arange", "range", "linspace"}
CONVS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d"}
# attention Dynamo keeps as one call (nn.MultiheadAttention) or that the rewrite left alone
UNREWRITTEN_ATTENTION = {"multi_head_attention_forward", "native_multi_head_attention",
                         "scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                         "scaled_dot_product_efficient_attention",
                         "scaled_dot_product_attention_math", "flash_attn_func"}
ALLOWED_HOPS = {"tag_activation_checkpoint", "wrap", "autograd_function_apply"}


def from_input(node: torch.fx.Node, word: str) -> bool:
    return any(n.op == "placeholder" and word in n.name for n in ancestors([node]))


def full_slice(item: Any, size: int) -> bool:
    if not isinstance(item, slice):
        return False
    start, stop, step = item.start, item.stop, item.step
    return (start in (None, 0) and step in (None, 1)
            and (stop is None or (isinstance(stop, int) and isinstance(size, int) and stop >= size)))


def reduced_dims(node: torch.fx.Node, ndim: int, name: str) -> list[int] | None:
    """The axes a reduction / along-axis op works on (None: all of them)."""
    if name in ("flatten",):
        start = node_arg(node, "start_dim", 1, 0) % ndim
        end = node_arg(node, "end_dim", 2, -1) % ndim
        return list(range(start, end + 1))
    position = 2 if name in ("roll", "narrow", "split", "chunk", "tensor_split", "topk",
                             "kthvalue") else 1
    if name in ("narrow", "select", "index_select", "gather", "take_along_dim", "unfold"):
        position = 1
    dim = node_arg(node, "dims" if name in ("roll", "flip") else "dim", position, None)
    if name == "diff" and dim is None:
        dim = -1
    if dim is None:
        return None if name not in ("softmax", "log_softmax", "cumsum") else [ndim - 1]
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return [d % ndim for d in dims if isinstance(d, int)]


def custom_op(target: Any) -> str | None:
    """``namespace::name`` of a custom op (not aten/prims/loong), else None."""
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return None
    return None if name.split("::")[0] in ("aten", "prims", "loong") else name


def contractions(node: torch.fx.Node, name: str) -> list[list[tuple[torch.fx.Node, int, list[int]]]]:
    """The indices a product sums over: for each, the (operand, axis, batch axes) of every operand
    that carries it, where the batch axes are the operand's axes of indices that every carrier
    shares and the result keeps.  ``name``: matmul, mm, bmm, baddbmm or einsum."""
    if name == "einsum":
        equation, *operands = node.args
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        if not isinstance(equation, str) or "..." in equation or "->" not in equation:
            return []
        inputs, output = equation.replace(" ", "").split("->")
        words = inputs.split(",")
        result = []
        for letter in sorted(set("".join(words)) - set(output)):
            carrying = [(op, word) for op, word in zip(operands, words)
                        if letter in word and isinstance(op, torch.fx.Node)]
            shared = [c for c in output if all(c in word for _, word in carrying)]
            result.append([(op, word.index(letter), [word.index(c) for c in shared])
                           for op, word in carrying])
        return result
    a, b = node.args[-2:] if name == "baddbmm" else node.args[:2]
    values = [example_value(a), example_value(b)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return []
    batch = min(values[0].dim(), values[1].dim()) - 2  # broadcast batch axes, from the right
    axes = [list(range(v.dim() - 2 - batch, v.dim() - 2)) if batch > 0 else [] for v in values]
    return [[(a, values[0].dim() - 1, axes[0]),
             (b, 0 if values[1].dim() == 1 else values[1].dim() - 2, axes[1])]]
