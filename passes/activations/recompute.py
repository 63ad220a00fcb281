"""Token-slice recompute (MEMO §4.1): of every "other" saved tensor of a swapped layer, the
forward keeps tokens ``[0, a)`` (``a = round(alpha·s)``, offloaded by ``offload``) and the
backward recomputes tokens ``[a, s)`` from the matching slice of the layer's input (and of
its attention outputs, which are saved), then concatenates the two.

Stage ``split``, policy ``memo``; runs after ``activations`` (its ``ActivationPlan``).

Proof of token-wise-ness: ``token_rules.analyse`` follows the sequence dimension op by op
from the layer input (``TokenDim``: which dimension carries the tokens, and how many outer
elements a merged dimension such as ``batch·seq`` holds).  Operands without tokens that
broadcast along the sequence (RoPE's cos/sin) are sliced alike where they are used.  An op
the rules can't prove token-wise proves nothing: that tensor is recomputed in full instead,
and the report says why.  A chain with a random op is not
recomputed at all (it would draw new numbers): the tensor stays saved.

A recompute never communicates: a chain stops at a collective's result (under hp > 1 the
SeqAlltoAll's waits for q/k/v and for the attention's out), which is saved instead; the out
exchanged back to this rank's tokens (found through the pack's layout ops) is sliced like a
single process's attention out.  So the alpha LP,
which prices recompute by FLOPs, has no communication to price.

``alpha = 0`` recomputes every "other" tensor in full (= Selective Checkpoint++), ``alpha = 1``
none.  Summary per layer: tokens kept and recomputed, which tensors were sliced, recomputed
in full or kept (with reasons), recomputed bytes and FLOPs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from loong_compile.passes.activations.classify import ActivationPlan, FollowsActivationPlan
from loong_compile.passes.base import PassContext, SplitGraphs
from loong_compile.passes.fx.aten_ops import is_collective, is_random, node_flops
from loong_compile.passes.fx.emit import insert_call, set_meta
from loong_compile.passes.fx.nodes import getitem_users
from loong_compile.passes.fx.storage import base_of, is_layout_op, nbytes
from loong_compile.passes.fx.walks import ancestors, first_in_order
from loong_compile.passes.activations.saved_values import SavedValues
from loong_compile.passes.activations.token_rules import Step, TokenDim, analyse, is_tensor, shape_of

aten = torch.ops.aten
Node = torch.fx.Node

# The fact this pass provides: its summary row per layer name, in ``ctx.state`` (``offload``
# reports the tokens each layer recomputes from it).
RECOMPUTED_LAYERS = "recomputed_layers"


# -- emitting token slices -----------------------------------------------------------------

def take_tokens(graph: torch.fx.Graph, x: Node, t: TokenDim, start: int, end: int, s: int,
                dense: bool = False) -> Node:
    """Nodes (at the insertion point) computing tokens ``[start, end)`` of ``x``.  ``dense``: copy
    a strided slice into dense memory (same dim order), so that the views a recompute chain
    takes of it apply as they did to the whole tensor."""
    shape = list(shape_of(x))
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
            shape = list(shape_of(part))
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
    q_nd = len(shape_of(query))
    found = []
    for d, size in enumerate(shape_of(x)):
        if size < 2:
            continue
        steps, _ = analyse(members, {x: TokenDim(d)}, size, identify=True)
        # under hp > 1 the query's sequence dim holds hp ranks' tokens (outer = hp)
        if query in steps and steps[query].out is not None and steps[query].out.dim == q_nd - 2:
            found.append(d)
    if len(found) != 1:
        return (f"the layer input's sequence dimension is unknown: {len(found)} of its dims lead to the "
                "attention query's sequence dim (need exactly one)")
    return x, TokenDim(found[0]), shape_of(x)[found[0]]


def _exchanged_back(attention_outs: set[Node]) -> set[Node]:
    """The results of the collectives an attention output reaches through layout ops (hp > 1:
    the SeqAlltoAll's wait that brings ``out`` back to this rank's tokens, packed
    ``(hp, B, H/hp, s, D)``)."""
    found, seen = set(), set()
    stack = list(attention_outs)
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if is_collective(user):
                waits = {u for u in user.users if is_collective(u)}     # a start's wait
                found |= waits or set(getitem_users(user)) or {user}
            elif is_layout_op(user):
                stack.append(user)
    return found



def region(targets: list[Node], stop: Callable[[Node], bool]) -> list[Node]:
    """The forward nodes between the stops and ``targets``, in graph order (FX nodes compare
    by their place)."""
    return sorted(ancestors(targets, stop))


@dataclasses.dataclass
class LayerRewrite:
    """One swapped layer's recompute: what the rewrite of both graphs needs to know."""

    saved: SavedValues
    plan: ActivationPlan
    stop: Callable[[Node], bool]          # where a recompute chain starts (saved or outside)
    roots: set[Node]                      # the layer input and attention outputs
    steps: dict[Node, Step]               # token analysis of the layer's nodes
    token_roots: dict[Node, TokenDim]     # where the analysis started (empty: no slicing)
    kept: int                             # a: tokens offloaded, not recomputed
    tokens: int                           # s: the layer's tokens
    emitted: list[Node] = dataclasses.field(default_factory=list)   # backward nodes that recompute

    def region(self, targets: list[Node]) -> list[Node]:
        return region(targets, self.stop)


class TokenSliceRecomputePass(FollowsActivationPlan):
    name = "recompute"
    provides = (RECOMPUTED_LAYERS,)

    def run(self, split: SplitGraphs, ctx: PassContext) -> dict[str, Any]:
        plan = self.plan_of(ctx)
        if plan is None:
            return dict(self.NO_PLAN)
        saved = SavedValues(split, keep=plan.prefixes)
        fw_nodes = list(split.forward.graph.nodes)
        layers = []
        for layer in plan.swapped:
            layers.append(self._layer(plan, layer, saved, fw_nodes))
        split.forward.graph.eliminate_dead_code()
        split.backward.graph.eliminate_dead_code()
        split.forward.graph.lint()
        split.backward.graph.lint()
        ctx.state[RECOMPUTED_LAYERS] = {row["layer"]: row for row in layers}
        return {"matched": sum(len(r["sliced"]) + len(r["full"]) + len(r["kept"]) for r in layers),
                "alpha": plan.alpha, "layers": layers}

    def _layer(self, plan, layer, saved, fw_nodes) -> dict[str, Any]:
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
        attention_outs |= _exchanged_back(attention_outs)
        roots = attention_outs | {base_of(n) for n in plan.layers.inputs[layer]}

        def stop(n: Node) -> bool:
            return (n.op in ("placeholder", "get_attr") or n in roots or is_collective(n)
                    or plan.layers.layer_of(n) != layer)

        token_roots: dict[Node, TokenDim] = {}
        if unknown is None and a > 0:
            token_roots[x] = t_in
            for att in plan.layers.attention[layer]:
                if shape_of(att.args[0])[-2] == s:    # the attention sees this layer's tokens
                    token_roots |= {o: TokenDim(2) for o in getitem_users(att)
                                    if is_tensor(o) and len(shape_of(o)) >= 3 and shape_of(o)[2] == s}
            # under hp > 1: the attention's out exchanged back to this rank's tokens, whose
            # sequence dim is -2 ((hp, B, H/hp, s, D) as it arrives)
            token_roots |= {o: TokenDim(len(shape_of(o)) - 2) for o in attention_outs
                            if is_collective(o) and is_tensor(o) and len(shape_of(o)) >= 3
                            and shape_of(o)[-2] == s}
        steps, failures = analyse(region(others, stop), token_roots, s) if token_roots else ({}, {})
        sliced, full = [], []
        for b in others:
            if any(is_random(n) for n in region([b], stop)):
                row["kept"].append({"value": b.name, "reason": "its recompute chain has a random op"})
                continue
            if is_collective(b):
                row["kept"].append({"value": b.name, "reason": "a collective's result: saved, never "
                                    "communicated again"})
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
        rewrite = LayerRewrite(saved, plan, stop, roots, steps, token_roots, a, s)
        emitted = self._emit(rewrite, sliced, full)
        row["recomputed_bytes"] = sum(nbytes(b) * (s - a) // s for b in sliced) + sum(nbytes(b) for b in full)
        row["recompute_flops"] = sum(node_flops(n) for n in emitted)
        return row

    def _emit(self, rw: LayerRewrite, sliced: list[Node], full: list[Node]) -> list[Node]:
        """Rewrite both graphs for one layer; returns the backward nodes that recompute."""
        targets = sliced + full
        if not targets:
            return []
        saved, plan = rw.saved, rw.plan
        placeholders = {b: saved.rebase(b) for b in targets}
        users = [u for ph in placeholders.values() for u in ph.users]
        fw, bw = saved.fw, saved.bw
        if not users:
            for b in targets:
                saved.remove(b)
            return []
        anchor = first_in_order(users)
        with bw.inserting_before(anchor):
            if sliced:
                copies = self._copy_region(rw, rw.region(sliced), on_tokens=True)
                for b in sliced:
                    t = rw.steps[b].out
                    with fw.inserting_before(b.next):
                        head = take_tokens(fw, b, t, 0, rw.kept, rw.tokens)
                    plan.prefixes.add(head)
                    plan.owners[head] = (plan.category(b)[0], "other")
                    ph = placeholders[b]
                    old_users = list(ph.users)
                    saved.replace(b, head)
                    joined = join_tokens(bw, ph, copies[b], t, b.meta["val"])
                    for u in old_users:
                        u.replace_input_with(ph, joined)
            if full:
                copies = self._copy_region(rw, rw.region(full), on_tokens=False)
                for b in full:
                    placeholders[b].replace_all_uses_with(copies[b])
                    saved.remove(b)
        return rw.emitted

    def _copy_region(self, rw: LayerRewrite, nodes: list[Node], on_tokens: bool) -> dict[Node, Node]:
        """Copy ``nodes`` into the backward at its insertion point; ``on_tokens``: on tokens
        ``[a, s)`` (roots sliced, broadcast operands sliced at use, sizes rewritten)."""
        saved, bw, s = rw.saved, rw.saved.bw, rw.tokens
        a = rw.kept if on_tokens else 0
        steps = rw.steps if on_tokens else {}
        token_roots = rw.token_roots if on_tokens else {}
        env: dict[Node, Node] = {}
        inside = set(nodes)
        for leaf in dict.fromkeys(x for n in nodes for x in n.all_input_nodes if x not in inside):
            ph = saved.rebase(leaf) if leaf in rw.roots else saved.add(leaf)
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
                size = list(shape_of(n))
                size[step.out.dim] = size[step.out.dim] // s * (s - a)
                new.update_arg(1, size)
            if token_roots:
                set_meta(new)
            new.meta["loong"] = "recompute"
            env[n] = new
            rw.emitted.append(new)
        return env
