"""Chunk the LM head and its loss: the projection to the vocabulary and the token-wise loss after
it become one token-chunked op.

Contract
--------
stage:    dynamo, after ``token_locality`` (which proves, under hp*cp > 1, that the loss is a sum
          over this rank's tokens scaled by a constant: the rewrite keeps that value exactly)
applies:  always (``disable_passes=["lm_head_loss"]`` keeps the unchunked graph)
matches:  in the top-level graph, ``F.cross_entropy(x, labels)`` or ``F.nll_loss(
          F.log_softmax(x, -1), labels)`` with ``reduction`` "sum" or "mean", any
          ``ignore_index``, no class weights or label smoothing, where ``x`` is ``(N, V)``
          computed from ``F.linear(hidden, W, b)`` (or ``hidden @ W.T``) by views that keep the
          vocabulary axis last, casts (transformers' float upcast), scalings by constants
          (Cohere's ``logit_scale``, Granite's ``logits_scaling``) and at most one ``tanh``
          (Gemma's final softcapping: ``tanh(x / cap) * cap``), and nothing but the loss reads
          the logits or anything between them and the loss.
emits:    one ``loong_compile.ops.lm_head_loss`` call per match, with the chunk of
          ``estimate/lm_head.py::chunk_tokens`` (option ``lm_head_chunk``); the logits and the
          loss's nodes are removed.
leaves:   a projection autocast casts (called under ``torch.autocast`` or inside such a block:
          its dtype is autocast's), a loss inside a
          higher-order-op body; they run unchunked and the report says why.
reports:  each chunked head (source, tokens, vocabulary, chunk, transforms, the bytes the
          unchunked logits took and what the chunked op keeps and needs), what was left
          unchunked and why, and every projection whose logits are a graph output (their GiB
          and the fix: compile a step that returns the loss).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile._compat.aot import size_hint
from loong_compile.estimate.lm_head import chunk_tokens, kept_bytes, working_bytes
from loong_compile.ops.tiling.lm_head import lm_head_loss
from loong_compile.passes.base import Pass, PassContext
from loong_compile.passes.fx.autocast import autocast_nodes
from loong_compile.passes.fx.emit import copy_source_meta
from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.nodes import example_value, node_arg, op_name
from loong_compile.passes.fx.op_sets import DTYPE_CASTS, HALF_CASTS, PROJECTIONS, VIEWS

GIB = 2 ** 30
# What may stand between the projection and the loss besides scalings and tanh: views (checked
# to keep the vocabulary axis last) and casts; not a cast to a 16-bit float by name, which the
# chunked op would not repeat (it computes in float32 at least: ops/tiling/lm_head.py)
LOGIT_VIEWS = VIEWS | {"contiguous"}
LOGIT_CASTS = DTYPE_CASTS - HALF_CASTS
SCALES = {"mul", "truediv", "div"}
TANH = {"tanh"}
LOSS_PARAMS = {  # name -> (position, default) of F.cross_entropy / F.nll_loss
    "weight": (2, None), "size_average": (3, None), "ignore_index": (4, -100), "reduce": (5, None),
    "reduction": (6, "mean"), "label_smoothing": (7, 0.0)}
FIX = ("compile a step that returns the loss, e.g. torch.compile(loong_compile.NextTokenLoss("
       "model), backend='loong'), or for transformers `lambda ids, pos, labels, n: model(ids, "
       "position_ids=pos, labels=labels, shift_labels=labels, num_items_in_batch=n).loss`: "
       "the head and the loss are then chunked and the logits never exist")


class NotChunked(Exception):
    """Why a loss or its head cannot be chunked (reported, then the graph is left as it is)."""


@dataclasses.dataclass
class Head:
    """A matched projection + loss."""

    loss: torch.fx.Node
    projection: torch.fx.Node
    hidden: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    labels: torch.fx.Node
    chain: list[torch.fx.Node]          # the projection's users up to the loss, in order
    pre_scale: float = 1.0
    softcap: bool = False
    post_scale: float = 1.0


class LMHeadLossPass(Pass):
    name, stage = "lm_head_loss", "dynamo"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        graph = gm.graph
        autocast = autocast_nodes(graph)
        changed, not_chunked = [], []
        for loss in [n for n in graph.nodes if _is_loss(n)]:
            try:
                head = _match(loss, autocast)
            except NotChunked as why:
                not_chunked.append({"node": loss.name, "source": source_line(loss), "reason": str(why)})
                continue
            changed.append(_rewrite(graph, head, ctx.config.lm_head_chunk))
        if changed:
            graph.lint()
            gm.recompile()
        chunks = {c["chunk"] for c in changed}
        return {"matched": len(changed) + len(not_chunked), "changed": changed,
                "not_chunked": not_chunked, "logits_outputs": _logits_outputs(graph, chunks),
                "chunk_setting": ctx.config.lm_head_chunk}


# -- matching ------------------------------------------------------------------------------------

def _is_loss(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.cross_entropy, F.nll_loss)


def _match(loss: torch.fx.Node, autocast: set[torch.fx.Node]) -> Head:
    args = {k: node_arg(loss, k, pos, default) for k, (pos, default) in LOSS_PARAMS.items()}
    for key in ("weight", "size_average", "reduce"):
        if args[key] is not None:
            raise NotChunked(f"{key}={args[key]!r}: the chunked loss takes no class weights")
    if args["label_smoothing"] not in (0, 0.0):
        raise NotChunked(f"label_smoothing={args['label_smoothing']!r} is not chunked")
    if args["reduction"] not in ("sum", "mean"):
        raise NotChunked(f"reduction={args['reduction']!r}: only 'sum' and 'mean' are chunked")
    if not isinstance(args["ignore_index"], int):
        raise NotChunked(f"ignore_index={args['ignore_index']!r} is not a constant")
    x, labels = loss.args[0], node_arg(loss, "target", 1, None)
    value, target = example_value(x), example_value(labels)
    if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()
            and isinstance(target, torch.Tensor) and target.dim() == 1
            and not target.is_floating_point()):
        raise NotChunked("the loss's input is not (tokens, vocabulary) logits with (tokens,) "
                         "class labels")
    chain, transforms, node = [], [], x
    if loss.target is F.nll_loss:  # views and casts, then the log_softmax nll_loss reads
        while isinstance(node, torch.fx.Node) and op_name(node) in LOGIT_VIEWS | LOGIT_CASTS:
            chain.append(node)
            node = _step_back(node, transforms)
        chain.append(node)
        node = _log_softmax_input(node)
    while not _is_projection(node):
        chain.append(node)
        node = _step_back(node, transforms)
    projection = node
    chain.append(projection)
    for n in chain:
        users = [u for u in n.users if u is not loss]
        if len(n.users) != 1:
            raise NotChunked(f"{n.name} is also used by {', '.join(u.name for u in users)}"
                             f"{' (a graph output)' if any(u.op == 'output' for u in users) else ''}"
                             ": the logits must feed the loss alone")
    if projection in autocast:
        raise NotChunked(f"{projection.name} runs in an autocast region")
    hidden, weight, bias = _projection_operands(projection)
    head = Head(loss, projection, hidden, weight, bias, labels, chain[::-1])
    head.pre_scale, head.softcap, head.post_scale = _canonical(transforms[::-1])
    return head


def _log_softmax_input(x: Any) -> torch.fx.Node:
    if not (isinstance(x, torch.fx.Node) and op_name(x) == "log_softmax"):
        raise NotChunked("nll_loss's input is not a log_softmax of the logits")
    dim = node_arg(x, "dim", 1, None)
    ndim = example_value(x).dim()
    if dim is None or dim % ndim != ndim - 1:
        raise NotChunked(f"log_softmax over dim={dim!r}, not the vocabulary axis")
    return x.args[0]


def _is_projection(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    name = op_name(node)
    return name in PROJECTIONS or node.target is operator.matmul


def _step_back(node: Any, transforms: list) -> torch.fx.Node:
    """The node before ``node`` on the way back to the projection; scalings and tanh go to
    ``transforms`` (outermost first)."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        raise NotChunked(f"the logits come from {getattr(node, 'name', node)!r}, not a projection")
    name, value = op_name(node), example_value(node)
    source = node.args[0] if node.args else None
    if name in LOGIT_VIEWS:
        before = example_value(source)
        if not (isinstance(before, torch.Tensor) and before.shape[-1] == value.shape[-1]):
            raise NotChunked(f"{node.name} ({name}) moves the vocabulary axis")
        return source
    if name in LOGIT_CASTS:
        if not value.is_floating_point() or value.device != example_value(source).device:
            raise NotChunked(f"{node.name} ({name}) is not a cast between float dtypes")
        return source
    if name in TANH:
        transforms.append(("tanh",))
        return source
    if name in SCALES:
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        constant = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(tensors) == 1 and len(constant) == 1 and not node.kwargs:
            scale = float(constant[0])
            if name != "mul":
                if node.args[0] is not tensors[0] or scale == 0:
                    raise NotChunked(f"{node.name} divides a constant by the logits")
                scale = 1.0 / scale
            transforms.append(("scale", scale))
            return tensors[0]
    raise NotChunked(f"{node.name} ({name}) between the projection and the loss is not a view, a "
                     "cast, a scaling by a constant or tanh")


def _canonical(transforms: list) -> tuple[float, bool, float]:
    """``post * tanh(pre * z)`` (or ``post * pre * z``) from the transforms, projection first."""
    pre, post, tanh = 1.0, 1.0, False
    for transform in transforms:
        if transform[0] == "tanh":
            if tanh:
                raise NotChunked("two tanh between the projection and the loss")
            tanh = True
        elif tanh:
            post *= transform[1]
        else:
            pre *= transform[1]
    return pre, tanh, post


def _projection_operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, Any]:
    """(hidden, weight (V, h), bias or None) of the projection."""
    hidden = node.args[0]
    if op_name(node) == "linear":
        weight, bias = node_arg(node, "weight", 1, None), node_arg(node, "bias", 2, None)
    else:
        right, bias = node.args[1], None
        weight = _untransposed(right)
    w, h = example_value(weight), example_value(hidden)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(h, torch.Tensor)
            and h.shape[-1] == w.shape[1] and not isinstance(bias, (int, float))):
        raise NotChunked(f"{node.name} is not a projection of (..., h) by a (V, h) weight")
    return hidden, weight, bias


def _untransposed(right: Any) -> torch.fx.Node:
    """``W`` of ``hidden @ W.T`` (the right operand a transpose of a 2-D weight)."""
    # ``W.T`` is ``getattr(W, "T")`` in Dynamo's graph up to torch 2.14, ``aten.numpy_T`` on 2.15
    if isinstance(right, torch.fx.Node) and op_name(right) in ("t", "T", "numpy_T") or (
            isinstance(right, torch.fx.Node) and op_name(right) == "transpose"
            and {a % 2 for a in right.args[1:3]} == {0, 1}):
        return right.args[0]
    if isinstance(right, torch.fx.Node) and right.op == "call_function" \
            and right.target is getattr and right.args[1] in ("T", "mT"):
        return right.args[0]
    raise NotChunked("the matmul's right operand is not a transposed (V, h) weight")


# -- the rewrite ------------------------------------------------------------------------------------

def _rewrite(graph: torch.fx.Graph, head: Head, setting: int | str) -> dict[str, Any]:
    hidden, weight = example_value(head.hidden), example_value(head.weight)
    logits = example_value(head.loss.args[0])
    tokens, vocab = logits.shape
    chunk = chunk_tokens(tokens, vocab, setting)
    kwargs = {"ignore_index": node_arg(head.loss, "ignore_index", 4, -100),
              "reduction": node_arg(head.loss, "reduction", 6, "mean"), "chunk": chunk,
              "pre_scale": head.pre_scale, "softcap": head.softcap, "post_scale": head.post_scale,
              "dtype": str(example_value(head.loss).dtype).removeprefix("torch."),
              "with_grad": torch.is_grad_enabled() and any(
                  getattr(example_value(n), "requires_grad", False)
                  for n in (head.hidden, head.weight, head.bias) if n is not None)}
    with graph.inserting_before(head.loss):
        new = graph.call_function(lm_head_loss, (head.hidden, head.weight, head.bias, head.labels),
                                  kwargs)
    copy_source_meta(head.projection, new)
    new.meta["example_value"] = _fake(new)
    head.loss.replace_all_uses_with(new)
    for node in [head.loss, *reversed(head.chain)]:
        graph.erase_node(node)
    dtype_bytes = weight.element_size()
    return {"node": new.name, "replaced": head.loss.name, "source": source_line(head.projection),
            "module": module_path(head.projection), "weight": head.weight.name,
            "bias": head.bias is not None, "tokens": tokens, "vocab": vocab, "hidden": hidden.shape[-1],
            "chunk": chunk, "chunks": -(-tokens // chunk), "reduction": kwargs["reduction"],
            "ignore_index": kwargs["ignore_index"], "pre_scale": head.pre_scale,
            "softcap": head.softcap, "post_scale": head.post_scale, "dtype": kwargs["dtype"],
            "with_grad": kwargs["with_grad"],
            "unchunked_logits_bytes": tokens * vocab * max(4, logits.element_size()),
            "kept_bytes": int(kept_bytes(tokens, hidden.shape[-1], vocab, dtype_bytes,
                                         head.bias is not None)) if kwargs["with_grad"] else 0,
            "working_bytes": int(working_bytes(chunk, vocab, dtype_bytes, head.softcap))}


def _fake(node: torch.fx.Node) -> Any:
    """The new call's example value, from the op's own fake kernel."""
    args = [example_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
    mode = next((t.fake_mode for t in args if hasattr(t, "fake_mode")), None)
    if mode is None:
        return None
    with mode:
        return lm_head_loss(*args, **node.kwargs)


# -- logits that leave the graph ------------------------------------------------------------------

def _logits_outputs(graph: torch.fx.Graph, chunks: set[int]) -> list[dict[str, Any]]:
    """Projections to a vocabulary whose logits are graph outputs: what they cost, the fix."""
    found = []
    for node in graph.nodes:
        if not _is_projection(node):
            continue
        try:
            _, weight, _ = _projection_operands(node)
        except NotChunked:
            continue
        out_features, in_features = example_value(weight).shape
        if out_features <= in_features or not _reaches_output(node):
            continue
        value = example_value(node)
        # a dynamic sequence length is a SymInt: report at its example size, adding no guard
        shape = [size_hint(d) for d in value.shape]
        out_features = size_hint(out_features)
        numel = math.prod(shape)
        tokens = numel // out_features
        chunk = chunk_tokens(tokens, out_features)
        gib = numel * value.element_size() / GIB
        chunked = float(working_bytes(chunk, out_features, value.element_size())) / GIB
        found.append({
            "node": node.name, "source": source_line(node), "shape": shape,
            "dtype": str(value.dtype).removeprefix("torch."), "gib": gib,
            "message": (f"the logits {tuple(shape)} of {node.name} are a graph output: "
                        f"{gib:.3g} GiB held until the loss outside the graph is computed (and "
                        f"as much again for their gradient), against {chunked:.3g} GiB for one "
                        f"chunk of {chunk} tokens with the loss in the graph"),
            "fix": FIX})
    return found


def _reaches_output(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value reaches the graph's outputs through views, casts, scalings and
    tanh (what a model applies to its logits before returning them)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if user not in seen and op_name(user) in (LOGIT_VIEWS | LOGIT_CASTS | SCALES | TANH
                                                      | {"getitem"}):
                seen.add(user)
                todo.append(user)
    return False
