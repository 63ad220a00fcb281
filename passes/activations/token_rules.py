"""Token-wise-ness of ops: the rules that follow the sequence dimension through a graph.

``analyse`` propagates ``TokenDim`` (which dimension of a tensor carries the tokens) op by op
from given roots: through views, elementwise ops, matmuls that don't contract it, reductions
over other dimensions, and splits / cats / slices along other dimensions; token-less operands
that broadcast along the sequence are named for slicing at their use.  An op with no rule,
or one that mixes tokens (a cumulative op, softmax or reduction along the sequence, a random
op, a collective), is a failure with the reason.  Used by the ``recompute`` pass, on the aten
graphs of the split stage (token safety reads the Dynamo graph by its own rules,
``fx/token_ops.py``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.aten_ops import is_collective, is_random

aten = torch.ops.aten
Node = torch.fx.Node


@dataclasses.dataclass(frozen=True)
class TokenDim:
    """Where a tensor's tokens are: dimension ``dim`` of size ``outer · s · inner`` (a merged
    dimension like ``batch·seq`` has ``outer = batch``)."""

    dim: int
    outer: int = 1


class NotTokenwise(Exception):
    """An op mixes tokens (or no rule shows it doesn't); the message says which and why."""


@dataclasses.dataclass
class Step:
    """What one op does to the tokens: the token dim of its output(s), the token-less operands
    to slice alike at this use, and whether its size arguments follow the token count."""

    out: TokenDim | tuple | None
    slice_operands: dict[Node, TokenDim] = dataclasses.field(default_factory=dict)
    resize: bool = False


def shape_of(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def is_tensor(node: Any) -> bool:
    return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# -- the op rules ----------------------------------------------------------------------------

def _broadcast(node: Node, tok: Callable, operands: list[Node]) -> Step:
    """Elementwise over broadcast operands: the token dims align from the right."""
    out_shape = shape_of(node)
    nd = len(out_shape)
    out, full = None, []
    for a in operands:
        t = tok(a)
        if t is None:
            full.append(a)
            continue
        cand = TokenDim(t.dim + nd - len(shape_of(a)), t.outer)
        if out is not None and cand != out:
            raise NotTokenwise(f"{node.name}: operands disagree on the sequence dimension")
        out = cand
    if out is None:
        return Step(None)
    slices = {}
    for a in full:
        d = out.dim - (nd - len(shape_of(a)))
        if d < 0 or shape_of(a)[d] == 1:
            continue
        if shape_of(a)[d] != out_shape[out.dim]:
            raise NotTokenwise(f"{node.name}: operand {a.name} is not aligned with the sequence")
        slices[a] = TokenDim(d, out.outer)
    return Step(out, slices)


def _pointwise(node, tok, s):
    return _broadcast(node, tok, [a for a in node.all_input_nodes if is_tensor(a)])


def _same(node, tok, s):
    """Single-input ops that keep the shape: copies, dtype casts, detach, alias."""
    return Step(tok(node.args[0]))


def _reshape(node, tok, s):
    """view / reshape: tokens stay whole iff one output dim holds the whole token digit of the
    row-major flat index (``inner`` elements per token, ``s`` tokens)."""
    t, in_shape, out_shape = tok(node.args[0]), shape_of(node.args[0]), shape_of(node)
    inner = math.prod(in_shape[t.dim + 1:]) * (in_shape[t.dim] // (t.outer * s))
    for j, size in enumerate(out_shape):
        after = math.prod(out_shape[j + 1:])
        if inner % after == 0 and (after * size) % (inner * s) == 0:
            return Step(TokenDim(j, after * size // (inner * s)), resize=True)
    raise NotTokenwise(f"{node.name}: the view splits the sequence dimension")


def _moved(node, tok, s):
    """Ops that move dims around: t, transpose, permute, unsqueeze, squeeze, expand."""
    t = tok(node.args[0])
    in_nd, out_nd = len(shape_of(node.args[0])), len(shape_of(node))
    target = node.target.overloadpacket
    if target in (aten.t, aten.transpose):
        d0, d1 = (0, 1) if target is aten.t else (_dim(node.args[1], in_nd), _dim(node.args[2], in_nd))
        return Step(TokenDim({d0: d1, d1: d0}.get(t.dim, t.dim), t.outer))
    if target is aten.permute:
        return Step(TokenDim([_dim(d, in_nd) for d in node.args[1]].index(t.dim), t.outer))
    if target is aten.unsqueeze:
        d = _dim(node.args[1], out_nd)
        return Step(TokenDim(t.dim + (d <= t.dim), t.outer))
    if target is aten.squeeze:
        dims = ([d for d, z in enumerate(shape_of(node.args[0])) if z == 1] if len(node.args) == 1
                else [_dim(d, in_nd) for d in (node.args[1] if isinstance(node.args[1], (list, tuple))
                                               else [node.args[1]])])
        removed = [d for d in dims if shape_of(node.args[0])[d] == 1]
        return Step(TokenDim(t.dim - sum(d < t.dim for d in removed), t.outer))
    if target is aten.expand:
        return Step(TokenDim(t.dim + out_nd - in_nd, t.outer), resize=True)
    raise NotTokenwise(f"{node.name}: no rule for {target}")


def _along(node, tok, s, dim_arg: int, what: str, keeps_dim: bool = True):
    """Ops that work along one dimension (slice, select, split, softmax, cumsum, ...): fine
    unless that dimension is the sequence."""
    t = tok(node.args[0])
    nd = len(shape_of(node.args[0]))
    d = _dim(node.args[dim_arg] if len(node.args) > dim_arg else node.kwargs.get("dim", 0), nd)
    if d == t.dim:
        raise NotTokenwise(f"{node.name}: {what} along the sequence dimension")
    if keeps_dim:
        return Step(t)
    return Step(TokenDim(t.dim - (d < t.dim), t.outer))


def _split(node, tok, s):
    step = _along(node, tok, s, 2, "split")
    return Step(tuple(step.out for _ in node.meta["val"]))


def _reduction(node, tok, s):
    t = tok(node.args[0])
    nd = len(shape_of(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        raise NotTokenwise(f"{node.name}: reduces over every dimension, the sequence included")
    dims = [_dim(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if t.dim in dims:
        raise NotTokenwise(f"{node.name}: {node.target.overloadpacket} reduces over the sequence")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return Step(TokenDim(t.dim - (0 if keepdim else sum(d < t.dim for d in dims)), t.outer))


def _cat(node, tok, s):
    tensors = [a for a in node.args[0] if shape_of(a) != (0,)]     # legacy empty tensors are skipped
    nd = len(shape_of(node))
    d = _dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), nd)
    step = _broadcast(node, tok, tensors)
    if step.out is not None and step.out.dim == d and len(tensors) > 1:
        raise NotTokenwise(f"{node.name}: concatenates along the sequence dimension")
    return step


def _matmul(node, tok, s):
    """mm / addmm / bmm: the token dim must be a free (not contracted) dim of one operand."""
    target = node.target.overloadpacket
    a, b = (node.args[1], node.args[2]) if target is aten.addmm else (node.args[0], node.args[1])
    ta, tb = tok(a), tok(b)
    if ta is not None and tb is not None:
        raise NotTokenwise(f"{node.name}: both matmul operands carry tokens")
    batched = target is aten.bmm
    rows, cols = (1, 2) if batched else (0, 1)
    t = ta if ta is not None else tb
    if batched and t is not None and t.dim == 0:          # tokens along the batch of matmuls
        return _broadcast(node, tok, [a, b])
    if ta is not None and ta.dim == rows:
        out = TokenDim(rows, ta.outer)
    elif tb is not None and tb.dim == cols:
        out = TokenDim(cols, tb.outer)
    elif t is not None:
        raise NotTokenwise(f"{node.name}: the matmul contracts over the sequence")
    else:
        return Step(None)
    if target is not aten.addmm:
        return Step(out)
    bias = node.args[0]
    if tok(bias) is not None:
        raise NotTokenwise(f"{node.name}: the bias carries tokens")
    d = out.dim - (2 - len(shape_of(bias)))
    return Step(out, {bias: TokenDim(d, out.outer)} if d >= 0 and shape_of(bias)[d] > 1 else {})


def _embedding(node, tok, s):
    t = tok(node.args[1])
    return Step(None if t is None else TokenDim(t.dim, t.outer))


def _layer_norm(node, tok, s):
    t = tok(node.args[0])
    nd = len(shape_of(node.args[0]))
    if t.dim >= nd - len(node.args[1]):
        raise NotTokenwise(f"{node.name}: normalises over the sequence")
    return Step((t, t, t))


RULES: dict[Any, Callable[[Node, Callable, int], Step]] = {
    aten.view: _reshape, aten._unsafe_view: _reshape, aten.reshape: _reshape,
    aten.t: _moved, aten.transpose: _moved, aten.permute: _moved, aten.unsqueeze: _moved,
    aten.squeeze: _moved, aten.expand: _moved,
    aten.detach: _same, aten.alias: _same, aten._to_copy: _same, aten.lift_fresh_copy: _same,
    aten.slice: lambda n, t, s: _along(n, t, s, 1, "slices"),
    aten.select: lambda n, t, s: _along(n, t, s, 1, "selects", keeps_dim=False),
    aten.split: _split, aten.split_with_sizes: _split,
    aten._softmax: lambda n, t, s: _along(n, t, s, 1, "softmax"),
    aten._log_softmax: lambda n, t, s: _along(n, t, s, 1, "log-softmax"),
    aten.cumsum: lambda n, t, s: _along(n, t, s, 1, "a cumulative sum"),
    aten.cumprod: lambda n, t, s: _along(n, t, s, 1, "a cumulative product"),
    aten.logcumsumexp: lambda n, t, s: _along(n, t, s, 1, "a cumulative log-sum-exp"),
    aten.sum: _reduction, aten.mean: _reduction, aten.amax: _reduction, aten.amin: _reduction,
    aten.var: _reduction, aten.std: _reduction,
    aten.cat: _cat, aten.mm: _matmul, aten.addmm: _matmul, aten.bmm: _matmul,
    aten.embedding: _embedding, aten.native_layer_norm: _layer_norm,
}


def token_step(node: Node, tok: Callable[[Node], TokenDim | None], s: int, identify: bool = False) -> Step:
    """The rule for ``node``, given its inputs' token dims (None: no tokens).  ``identify``:
    only find where the sequence goes, letting it through collectives (which keep the dim
    but exchange tokens between ranks, so they are never token-wise)."""
    if node.target is operator.getitem:
        parent = tok(node.args[0])
        return Step(parent[node.args[1]] if isinstance(parent, tuple) else None)
    if not any(tok(a) is not None for a in node.all_input_nodes):
        return Step(None)                       # no tokens in, none out: computed in full
    if is_random(node):
        raise NotTokenwise(f"{node.name}: random op")
    if is_collective(node):
        if not identify:
            raise NotTokenwise(f"{node.name}: a collective (it exchanges tokens between ranks)")
        first = node.args[0]
        return Step(tuple(tok(x) for x in first) if isinstance(first, (list, tuple)) else tok(first))
    packet = getattr(node.target, "overloadpacket", None)
    rule = RULES.get(packet)
    if rule is not None:
        return rule(node, tok, s)
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return _pointwise(node, tok, s)
    raise NotTokenwise(f"{node.name}: no token-wise rule for {node.target}")


def analyse(nodes: list[Node], roots: dict[Node, TokenDim], s: int, identify: bool = False) -> tuple[dict, dict]:
    """Token dims of ``nodes`` (in graph order) from those of ``roots``: (steps, failures)
    where ``failures[node]`` says why node (or an input of it) is not token-wise."""
    steps: dict[Node, Step] = {}
    failures: dict[Node, str] = {}

    def tok(a: Node):
        if a in roots:
            return roots[a]
        return steps[a].out if a in steps else None

    for node in nodes:
        if node.op != "call_function":
            continue
        bad = next((failures[a] for a in node.all_input_nodes if a in failures), None)
        if bad is not None:
            failures[node] = bad
            continue
        try:
            steps[node] = token_step(node, tok, s, identify)
        except NotTokenwise as e:
            failures[node] = str(e)
    return steps, failures
