"""transformers' loss on a rank's tokens: the label shift becomes the layout's exchange, and a
mean's count becomes the sequence's.

``model(ids, labels=ids)`` computes ``ForCausalLMLoss``: the labels are shifted by one token
(``pad(labels, (0, 1), value=ignore_index)[..., 1:]``) and the loss is
``cross_entropy(reduction="mean")`` over the tokens.  On a rank that holds some tokens of the
sequence, both read the local tokens as if they were the sequence: the label after the rank's
last token of a chunk is another rank's, and the mean divides by the rank's own count.  Each has
one exact counterpart (``loong_compile/ops/sequence.py``):

* the shift: ``next_token_labels`` gives every local token the label of the token after it in
  the sequence, from the layout of ``parallel/tokens.py`` (``fill`` after the last);
* the mean: ``reduction="sum"`` divided by ``sequence_label_count``, the count of labels that
  are not ``ignore_index`` over the ranks of the sequence.  Each rank's loss is then its share of
  one process's loss: summed over the ranks of a sequence they are that loss, and
  ``reduce_gradients`` sums their gradients.

Why this is one process's value: a label shift moves each label by one place in the sequence and
nothing else, and ``next_token_labels`` takes the place from the same layout ``shard_batch`` cut
the batch with (``checks/inputs.py`` checks the positions against it at each call, and refuses
the balanced document order, in which the next token of the reordered row is not the next in
the document).  A mean of per-token losses is their sum over the count; the sums add up over the
ranks, and ``token_locality`` still proves that the loss is per token and that nothing but
sums and constants act on it.

Contract
--------
stage:    dynamo, after ``attention_2d`` and before ``token_locality`` (which then proves what
          is left, with these ops' results as token data and a sequence value)
applies:  when ``hp * cp > 1``
matches:  ``x[..., 1:]`` (or a slice of the last axis alone) of ``pad(labels, (0, 1),
          value=v)`` where ``labels`` is an integer tensor whose last axis holds the rank's
          ``T`` tokens, and every user of the pad is such a slice; ``F.cross_entropy`` /
          ``F.nll_loss`` with ``reduction="mean"``, no class weights, over ``N·T`` targets.
emits:    ``loong_compile.ops.sequence.next_token_labels(labels, v, **mesh.document_kwargs())`` for each
          slice (the pad removed); ``loss(reduction="sum") / sequence_label_count(target,
          ignore_index, sp_group)`` for each mean.
provides: ``LABELS_SHIFTED`` (``ctx.state``): whether a shift was rewritten (the input check
          refuses the balanced order then); ``SHIFTED_LABEL_INPUTS`` (``ctx.state``): the graph
          inputs the shifted labels are (through casts, copies and views), which the input check
          refuses when they are ``shard_batch``'s already shifted labels
          (``loong_compile/checks/labels.py``).
reports:  each shift (source line, label shape, fill, the graph input it reads) and each mean
          (source line, ignore_index).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from loong_compile.ops.sequence import next_token_labels, sequence_label_count
from loong_compile.passes.base import PassContext, ShardedPass
from loong_compile.passes.fx.emit import insert_dynamo_call
from loong_compile.passes.fx.module_paths import source_line
from loong_compile.passes.fx.nodes import example_value, node_arg, op_name
from loong_compile.passes.fx.op_sets import COPIES, DTYPE_CASTS, INT_CASTS, LOSSES, VIEWS
from loong_compile.passes.fx.tokens import counts_tokens, local_token_count

# The facts: True when a label shift was rewritten into the layout's exchange; and the indices
# of the graph inputs those labels are.
LABELS_SHIFTED = "labels_shifted"
SHIFTED_LABEL_INPUTS = "shifted_label_inputs"
# what labels pass through unchanged in value on their way from the caller to the shift
# (``labels.to(logits.device)``, ``.long()``, ``.view(-1, T)``)
_KEEPS_LABELS = COPIES | DTYPE_CASTS | INT_CASTS | VIEWS


class SequenceLossPass(ShardedPass):
    name = "sequence_loss"
    stage = "dynamo"
    provides = (LABELS_SHIFTED, SHIFTED_LABEL_INPUTS)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        graph = gm.graph
        tokens = local_token_count(gm)
        shifts, means, read = [], [], []
        if tokens is not None:
            for pad in [n for n in graph.nodes if op_name(n) == "pad"]:
                shifted = _shift(pad, tokens)
                if shifted is not None:
                    read.append(_caller_input(shifted[0]))
                    shifts.append(_rewrite_shift(graph, pad, *shifted, ctx)
                                  | {"input": getattr(read[-1], "name", None)})
            for loss in [n for n in graph.nodes if op_name(n) in LOSSES]:
                if _is_token_mean(loss, tokens):
                    means.append(_rewrite_mean(graph, loss, ctx))
        if shifts or means:
            graph.lint()
            gm.recompile()
        ctx.state[LABELS_SHIFTED] = bool(shifts)
        inputs = list(graph.find_nodes(op="placeholder"))
        ctx.state[SHIFTED_LABEL_INPUTS] = sorted({inputs.index(n) for n in read if n is not None})
        return {"matched": len(shifts) + len(means), "changed": len(shifts) + len(means),
                "label_shifts": shifts, "means": means}


def _shift(pad: torch.fx.Node, tokens: Any) -> tuple[torch.fx.Node, int, list] | None:
    """(labels, fill, the slices) when ``pad`` is a label shift by one token, else None."""
    labels = pad.args[0] if pad.args else None
    value = example_value(labels)
    amounts = node_arg(pad, "pad", 1, ())
    fill = node_arg(pad, "value", 3, None)
    if not (isinstance(value, torch.Tensor) and value.dim() >= 1
            and not value.dtype.is_floating_point and value.dtype is not torch.bool
            and counts_tokens(value.shape[-1], tokens) and value.shape[-1] == tokens
            and list(amounts) == [0, 1] and node_arg(pad, "mode", 2, "constant") == "constant"
            and (fill is None or isinstance(fill, int) and not isinstance(fill, bool))):
        return None
    slices = list(pad.users)
    if not slices or not all(_drops_first(s, value.dim()) for s in slices):
        return None
    return labels, fill or 0, slices


def _drops_first(node: torch.fx.Node, ndim: int) -> bool:
    """``x[..., 1:]`` or ``x[:, ..., :, 1:]``: every axis whole but the last, from 1 on."""
    if node.target is not operator.getitem:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not index or index[-1] != slice(1, None, None):
        return False
    rest = index[:-1]
    whole = slice(None, None, None)
    return rest == (Ellipsis,) or (len(rest) == ndim - 1 and all(i == whole for i in rest))


def _rewrite_shift(graph: torch.fx.Graph, pad: torch.fx.Node, labels: torch.fx.Node, fill: int,
                   slices: list, ctx: PassContext) -> dict[str, Any]:
    # group names as keywords: they differ by rank, and the ranks' agreement leaves keywords
    # named *_group out of the graphs it compares
    new = insert_dynamo_call(graph, pad, next_token_labels, (labels, fill),
                             ctx.mesh.document_kwargs())
    for node in slices:
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.erase_node(pad)
    return {"node": new.name, "source": source_line(new), "labels": labels.name,
            "shape": list(example_value(labels).shape), "fill": fill}


def _caller_input(labels: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input ``labels`` is, through what keeps its values; None for labels the graph
    computes."""
    node = labels
    while node.op in ("call_method", "call_function") and op_name(node) in _KEEPS_LABELS \
            and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node if node.op == "placeholder" else None


def _is_token_mean(loss: torch.fx.Node, tokens: Any) -> bool:
    """A mean of per-token losses over the rank's tokens, with nothing that weighs them."""
    target = example_value(node_arg(loss, "target", 1, None))
    return (node_arg(loss, "reduction", 6, "mean") == "mean"
            and all(node_arg(loss, key, place, None) is None
                    for key, place in (("weight", 2), ("size_average", 3), ("reduce", 5)))
            and isinstance(target, torch.Tensor) and not target.dtype.is_floating_point
            and target.dim() == 1 and counts_tokens(target.shape[0], tokens))


def _rewrite_mean(graph: torch.fx.Graph, loss: torch.fx.Node, ctx: PassContext) -> dict[str, Any]:
    ignore_index = node_arg(loss, "ignore_index", 4, -100)
    if len(loss.args) > 6:
        loss.update_arg(6, "sum")
    else:
        loss.update_kwarg("reduction", "sum")
    users = list(loss.users)
    anchor = loss.next
    count = insert_dynamo_call(graph, anchor, sequence_label_count,
                               (node_arg(loss, "target", 1, None), ignore_index),
                               {"sp_group": ctx.mesh.group_names["sp"]})
    mean = insert_dynamo_call(graph, anchor, operator.truediv, (loss, count))
    for user in users:
        user.replace_input_with(loss, mean)
    return {"node": loss.name, "source": source_line(loss), "ignore_index": ignore_index,
            "count": count.name}
