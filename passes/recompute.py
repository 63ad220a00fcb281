"""Token-slice recompute (MEMO §4.1): of every "other" saved tensor of a swapped layer, the
forward keeps tokens ``[0, a)`` (``a = round(alpha·s)``, offloaded by ``offload``) and the
backward recomputes tokens ``[a, s)`` from the matching slice of the layer's input (and of
its attention outputs, which are saved), then concatenates the two.

Stage ``split``, policy ``memo``; runs after ``activations`` (its ``ActivationPlan``).

Proof of token-wise-ness: the pass follows the sequence dimension op by op from the layer
input (``TokenDim``: which dimension carries the tokens, and how many outer elements a
merged dimension such as ``batch·seq`` holds) through views, elementwise ops, matmuls that
don't contract it, reductions over other dimensions, and splits / cats / slices along other
dimensions.  Operands without tokens that broadcast along the sequence (RoPE's cos/sin) are
sliced alike where they are used.  Anything else (a cumulative op, softmax or reduction
along the sequence, a slice of it, an unknown op, a collective) proves nothing: that tensor
is recomputed in full instead, and the report says why.  A chain with a random op is not
recomputed at all (it would draw new numbers): the tensor stays saved.

``alpha = 0`` recomputes every "other" tensor in full (= Selective Checkpoint++), ``alpha = 1``
none.  Summary per layer: tokens kept and recomputed, which tensors were sliced, recomputed
in full or kept (with reasons), recomputed bytes and FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from loong_compile.passes.activations import (
    ActivationPlan, FollowsActivationPlan, SavedValues, base_of, first_in_order, getitem_users, insert_call, nbytes,
    node_flops, set_meta,
)
from loong_compile.passes.base import PassContext, SplitGraphs

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


def _shape(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _is_tensor(node: Any) -> bool:
    return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# -- the op rules ----------------------------------------------------------------------------

def _broadcast(node: Node, tok: Callable, operands: list[Node]) -> Step:
    """Elementwise over broadcast operands: the token dims align from the right."""
    out_shape = _shape(node)
    nd = len(out_shape)
    out, full = None, []
    for a in operands:
        t = tok(a)
        if t is None:
            full.append(a)
            continue
        cand = TokenDim(t.dim + nd - len(_shape(a)), t.outer)
        if out is not None and cand != out:
            raise NotTokenwise(f"{node.name}: operands disagree on the sequence dimension")
        out = cand
    if out is None:
        return Step(None)
    slices = {}
    for a in full:
        d = out.dim - (nd - len(_shape(a)))
        if d < 0 or _shape(a)[d] == 1:
            continue
        if _shape(a)[d] != out_shape[out.dim]:
            raise NotTokenwise(f"{node.name}: operand {a.name} is not aligned with the sequence")
        slices[a] = TokenDim(d, out.outer)
    return Step(out, slices)


def _pointwise(node, tok, s):
    return _broadcast(node, tok, [a for a in node.all_input_nodes if _is_tensor(a)])


def _same(node, tok, s):
    """Single-input ops that keep the shape: copies, dtype casts, detach, alias."""
    return Step(tok(node.args[0]))


def _reshape(node, tok, s):
    """view / reshape: tokens stay whole iff one output dim holds the whole token digit of the
    row-major flat index (``inner`` elements per token, ``s`` tokens)."""
    t, in_shape, out_shape = tok(node.args[0]), _shape(node.args[0]), _shape(node)
    inner = math.prod(in_shape[t.dim + 1:]) * (in_shape[t.dim] // (t.outer * s))
    for j, size in enumerate(out_shape):
        after = math.prod(out_shape[j + 1:])
        if inner % after == 0 and (after * size) % (inner * s) == 0:
            return Step(TokenDim(j, after * size // (inner * s)), resize=True)
    raise NotTokenwise(f"{node.name}: the view splits the sequence dimension")


def _moved(node, tok, s):
    """Ops that move dims around: t, transpose, permute, unsqueeze, squeeze, expand."""
    t = tok(node.args[0])
    in_nd, out_nd = len(_shape(node.args[0])), len(_shape(node))
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
        dims = ([d for d, z in enumerate(_shape(node.args[0])) if z == 1] if len(node.args) == 1
                else [_dim(d, in_nd) for d in (node.args[1] if isinstance(node.args[1], (list, tuple))
                                               else [node.args[1]])])
        removed = [d for d in dims if _shape(node.args[0])[d] == 1]
        return Step(TokenDim(t.dim - sum(d < t.dim for d in removed), t.outer))
    if target is aten.expand:
        return Step(TokenDim(t.dim + out_nd - in_nd, t.outer), resize=True)
    raise NotTokenwise(f"{node.name}: no rule for {target}")


def _along(node, tok, s, dim_arg: int, what: str, keeps_dim: bool = True):
    """Ops that work along one dimension (slice, select, split, softmax, cumsum, ...): fine
    unless that dimension is the sequence."""
    t = tok(node.args[0])
    nd = len(_shape(node.args[0]))
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
    nd = len(_shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        raise NotTokenwise(f"{node.name}: reduces over every dimension, the sequence included")
    dims = [_dim(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if t.dim in dims:
        raise NotTokenwise(f"{node.name}: {node.target.overloadpacket} reduces over the sequence")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return Step(TokenDim(t.dim - (0 if keepdim else sum(d < t.dim for d in dims)), t.outer))


def _cat(node, tok, s):
    tensors = [a for a in node.args[0] if _shape(a) != (0,)]     # legacy empty tensors are skipped
    nd = len(_shape(node))
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
    d = out.dim - (2 - len(_shape(bias)))
    return Step(out, {bias: TokenDim(d, out.outer)} if d >= 0 and _shape(bias)[d] > 1 else {})


def _embedding(node, tok, s):
    t = tok(node.args[1])
    return Step(None if t is None else TokenDim(t.dim, t.outer))


def _layer_norm(node, tok, s):
    t = tok(node.args[0])
    nd = len(_shape(node.args[0]))
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


def is_random(node: Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


COLLECTIVES = ("loong.seq_all_to_all",)


def is_collective(node: Node) -> bool:
    return (getattr(node.target, "namespace", None) == "_c10d_functional"
            or str(getattr(node.target, "overloadpacket", "")) in COLLECTIVES)


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


# -- emitting token slices -----------------------------------------------------------------

def take_tokens(graph: torch.fx.Graph, x: Node, t: TokenDim, start: int, end: int, s: int,
                dense: bool = False) -> Node:
    """Nodes (at the insertion point) computing tokens ``[start, end)`` of ``x``.  ``dense``: copy
    a strided slice into dense memory (same dim order), so that the views a recompute chain
    takes of it apply as they did to the whole tensor."""
    shape = list(_shape(x))
    d = t.dim
    inner = shape[d] // (t.outer * s)
    if t.outer == 1:
        part = insert_call(graph, aten.slice.Tensor, (x, d, start * inner, end * inner))
        part.meta["loong"] = "token_slice"
        if dense and _memory_order(part.meta["val"]) is None:
            part = insert_call(graph, aten.clone.default, (part,))
        return part
    src = x if x.meta["val"].is_contiguous() else insert_call(
        graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    split = insert_call(graph, aten.view.default, (src, shape[:d] + [t.outer, s * inner] + shape[d + 1:]))
    part = insert_call(graph, aten.slice.Tensor, (split, d + 1, start * inner, end * inner))
    part.meta["loong"] = "token_slice"
    dense = insert_call(graph, aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
    return insert_call(graph, aten.view.default,
                       (dense, shape[:d] + [t.outer * (end - start) * inner] + shape[d + 1:]))


def join_tokens(graph: torch.fx.Graph, head: Node, tail: Node, t: TokenDim, like: torch.Tensor) -> Node:
    """``head`` (the first tokens) and ``tail`` (the rest) as one tensor shaped like ``like``, in
    its memory order when ``like`` is dense, so views the backward takes of it still apply."""
    d = t.dim
    if t.outer > 1:
        pieces = []
        for part in (head, tail):
            shape = list(_shape(part))
            if not part.meta["val"].is_contiguous():
                part = insert_call(graph, aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
            pieces.append(insert_call(graph, aten.view.default,
                                      (part, shape[:d] + [t.outer, shape[d] // t.outer] + shape[d + 1:])))
        joined = insert_call(graph, aten.cat.default, (pieces, d + 1))
        joined.meta["loong"] = "token_join"
        return insert_call(graph, aten.view.default, (joined, list(like.shape)))
    order = _memory_order(like)
    if order is None or order == list(range(like.dim())):
        joined = insert_call(graph, aten.cat.default, ([head, tail], d))
        joined.meta["loong"] = "token_join"
        return joined
    pieces = [insert_call(graph, aten.permute.default, (p, order)) for p in (head, tail)]
    joined = insert_call(graph, aten.cat.default, (pieces, order.index(d)))
    joined.meta["loong"] = "token_join"
    inverse = [order.index(i) for i in range(len(order))]
    return insert_call(graph, aten.permute.default, (joined, inverse))


def _memory_order(val: torch.Tensor) -> list[int] | None:
    """Dims from outermost to innermost in memory if ``val`` is dense, else None."""
    order = sorted(range(val.dim()), key=lambda i: (-val.stride(i), i))
    expected = 1
    for i in reversed(order):
        if val.shape[i] != 1 and val.stride(i) != expected:
            return None
        expected *= val.shape[i]
    return order


# -- the pass --------------------------------------------------------------------------------

def input_token_dim(plan: ActivationPlan, layer: int, fw_nodes: list[Node]) -> tuple[Node, TokenDim, int] | str:
    """The layer input, its token dim and the token count, found by following each candidate
    dim to the attention's query (whose dim -2 is the sequence); or why it can't be found."""
    inputs = plan.layers.inputs[layer]
    if len(inputs) != 1:
        return f"{len(inputs)} layer inputs found (need exactly one)"
    attention = plan.layers.attention[layer]
    if not attention:
        return "no attention op in the layer to anchor the sequence dimension"
    x = base_of(inputs[0])
    members = [n for n in fw_nodes if plan.layers.layer_of(n) == layer]
    query = attention[0].args[0]
    q_nd = len(_shape(query))
    found = []
    for d, size in enumerate(_shape(x)):
        if size < 2:
            continue
        steps, _ = analyse(members, {x: TokenDim(d)}, size, identify=True)
        if query in steps and steps[query].out == TokenDim(q_nd - 2):
            found.append(d)
    if len(found) != 1:
        return (f"the layer input's sequence dimension is unknown: {len(found)} of its dims lead to the "
                "attention query's sequence dim (need exactly one)")
    return x, TokenDim(found[0]), _shape(x)[found[0]]


def region(targets: list[Node], stop: Callable[[Node], bool], order: dict[Node, int]) -> list[Node]:
    """The forward nodes between the stops and ``targets``, in graph order."""
    seen: set[Node] = set()
    stack = list(targets)
    while stack:
        n = stack.pop()
        if n in seen or stop(n):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(seen, key=order.__getitem__)


class TokenSliceRecomputePass(FollowsActivationPlan):
    name = "recompute"

    def run(self, split: SplitGraphs, ctx: PassContext) -> dict[str, Any]:
        plan = self.plan_of(ctx)
        if plan is None:
            return dict(self.NO_PLAN)
        saved = SavedValues(split, keep=plan.prefixes)
        fw_nodes = list(split.forward.graph.nodes)
        order = {n: k for k, n in enumerate(fw_nodes)}
        layers = []
        for layer in plan.swapped:
            layers.append(self._layer(plan, layer, saved, fw_nodes, order))
        split.forward.graph.eliminate_dead_code()
        split.backward.graph.eliminate_dead_code()
        split.forward.graph.lint()
        split.backward.graph.lint()
        ctx.state["recompute"] = {row["layer"]: row for row in layers}
        return {"matched": sum(len(r["sliced"]) + len(r["full"]) + len(r["kept"]) for r in layers),
                "alpha": plan.alpha, "layers": layers}

    def _layer(self, plan, layer, saved, fw_nodes, order) -> dict[str, Any]:
        others = list(dict.fromkeys(v.base for v in plan.values if v.layer == layer and v.category == "other"))
        row: dict[str, Any] = {"layer": plan.layers.names[layer], "sliced": [], "full": [], "kept": [],
                               "recomputed_bytes": 0, "recompute_flops": 0}
        found = input_token_dim(plan, layer, fw_nodes)
        unknown = found if isinstance(found, str) else None      # why tokens can't be sliced
        s = a = 0
        if unknown is None:
            x, t_in, s = found
            a = round(plan.alpha * s)
            row |= {"tokens": s, "offloaded_tokens": [0, a], "recomputed_tokens": [a, s]}
        if not others:
            return row
        if plan.alpha >= 1 or (unknown is None and a == s):
            row["kept"] = [{"value": b.name, "reason": "alpha = 1: offloaded whole"} for b in others]
            return row
        attention_outs = {o for att in plan.layers.attention[layer] for o in getitem_users(att)}
        roots = attention_outs | {base_of(n) for n in plan.layers.inputs[layer]}

        def stop(n: Node) -> bool:
            return n.op in ("placeholder", "get_attr") or n in roots or plan.layers.layer_of(n) != layer

        token_roots: dict[Node, TokenDim] = {}
        if unknown is None and a > 0:
            token_roots[x] = t_in
            for att in plan.layers.attention[layer]:
                if _shape(att.args[0])[-2] == s:    # the attention sees this layer's tokens
                    token_roots |= {o: TokenDim(2) for o in getitem_users(att)
                                    if _is_tensor(o) and len(_shape(o)) >= 3 and _shape(o)[2] == s}
        steps, failures = analyse(region(others, stop, order), token_roots, s) if token_roots else ({}, {})
        sliced, full = [], []
        for b in others:
            if any(is_random(n) for n in region([b], stop, order)):
                row["kept"].append({"value": b.name, "reason": "its recompute chain has a random op"})
                continue
            reason = (unknown or (a == 0 and "no token offloaded (alpha·s rounds to 0): full recompute")
                      or failures.get(b)
                      or (steps[b].out is None and "no token-sliced input reaches it: recomputed whole"))
            if reason:
                full.append(b)
                row["full"].append({"value": b.name, "reason": reason})
            else:
                sliced.append(b)
                row["sliced"].append(b.name)
        emitted = self._emit(saved, plan, sliced, full, stop, roots, order, steps, token_roots, a, s)
        row["recomputed_bytes"] = sum(nbytes(b) * (s - a) // s for b in sliced) + sum(nbytes(b) for b in full)
        row["recompute_flops"] = sum(node_flops(n) for n in emitted)
        return row

    def _emit(self, saved: SavedValues, plan, sliced, full, stop, roots, order, steps, token_roots, a,
              s) -> list[Node]:
        """Rewrite both graphs for one layer; returns the backward nodes that recompute."""
        targets = sliced + full
        if not targets:
            return []
        placeholders = {b: saved.rebase(b) for b in targets}
        users = [u for ph in placeholders.values() for u in ph.users]
        fw, bw = saved.fw, saved.bw
        if not users:
            for b in targets:
                saved.remove(b)
            return []
        emitted: list[Node] = []
        anchor = first_in_order(bw, users)
        with bw.inserting_before(anchor):
            if sliced:
                copies = self._copy_region(saved, region(sliced, stop, order), roots, steps, token_roots,
                                           a, s, emitted)
                for b in sliced:
                    t = steps[b].out
                    with fw.inserting_before(b.next):
                        head = take_tokens(fw, b, t, 0, a, s)
                    plan.prefixes.add(head)
                    plan.owners[head] = (plan.category(b)[0], "other")
                    ph = placeholders[b]
                    old_users = list(ph.users)
                    saved.replace(b, head)
                    joined = join_tokens(bw, ph, copies[b], t, b.meta["val"])
                    for u in old_users:
                        u.replace_input_with(ph, joined)
            if full:
                copies = self._copy_region(saved, region(full, stop, order), roots, {}, {}, 0, s, emitted)
                for b in full:
                    placeholders[b].replace_all_uses_with(copies[b])
                    saved.remove(b)
        return emitted

    def _copy_region(self, saved, nodes, roots, steps, token_roots, a, s, emitted) -> dict[Node, Node]:
        """Copy ``nodes`` into the backward at its insertion point; with ``token_roots``, on
        tokens ``[a, s)`` (roots sliced, broadcast operands sliced at use, sizes rewritten)."""
        bw = saved.bw
        env: dict[Node, Node] = {}
        inside = set(nodes)
        for leaf in dict.fromkeys(x for n in nodes for x in n.all_input_nodes if x not in inside):
            ph = saved.rebase(leaf) if leaf in roots else saved.add(leaf)
            env[leaf] = take_tokens(bw, ph, token_roots[leaf], a, s, s, dense=True) if leaf in token_roots else ph
        sliced_at_use: dict[tuple[Node, TokenDim], Node] = {}
        for n in nodes:
            step = steps.get(n)
            local = {}
            if step is not None:
                for operand, t in step.slice_operands.items():
                    key = (operand, t)
                    if key not in sliced_at_use:
                        sliced_at_use[key] = take_tokens(bw, env[operand], t, a, s, s, dense=True)
                    local[operand] = sliced_at_use[key]
            new = bw.node_copy(n, lambda x, local=local: local.get(x, env[x]))
            if step is not None and step.resize and isinstance(step.out, TokenDim):
                size = list(_shape(n))
                size[step.out.dim] = size[step.out.dim] // s * (s - a)
                new.update_arg(1, size)
            if token_roots:
                set_meta(new)
            new.meta["loong"] = "recompute"
            env[n] = new
            emitted.append(new)
        return env
