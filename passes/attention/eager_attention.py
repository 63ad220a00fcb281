"""Attention written as ops (transformers' ``eager_attention_forward``, custom models) becomes an
SDPA call, so that ``attention_2d`` distributes it like any other.

The chain, as transformers writes it for every family with ``attn_implementation="eager"``::

    scores = matmul(q, k.transpose(-2, -1)) * scale       (or / d, itruediv, casts around it)
    scores = scores + mask                                 (mask = where(keep, 0, finfo.min))
    p = softmax(scores, dim=-1[, dtype=float32]).to(q.dtype)
    p = dropout(p, p=0.0, training=...)                    (a no-op: p == 0 or not training)
    out = matmul(p, v)

is ``F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)``: the boolean ``keep``
under the additive mask is the same mask transformers hands SDPA (``where(keep, 0, min)`` adds
0 or a value whose exponential is 0), so ``attention_2d`` proves it by the same rules (causal,
windows, documents, padding).  GQA's ``repeat_kv`` stays in front of the new call and is undone
there as for SDPA callers.  Casts of q and k to float32 before the product (GPT-J) and the
softmax's float32 upcast are dropped: the attention then computes in the inputs' dtype, which
is float32's round-off away from one process at most (float64 models: closer to the exact
value; the trust matrix's eager cells are judged at float32's tolerance).

Attention sinks (gpt-oss): one logit per head joined to the scores as a last column
(``cat([scores, sinks], -1)``, the row's max subtracted, the column dropped after the softmax)
become ``ops.attention.sinks.sdpa_with_sinks(q, k, v, sinks, attn_mask=, scale=)``, which
``attention_2d`` distributes with its ``sinks=``.

A chain that has the shape of attention (a softmax over the last axis of ``q @ kᵀ``) but any
other step is refused by name (``LoongUnsupportedError``): a softcapped score (``tanh``: Gemma
2's ``attn_logit_softcapping``), a column joined to the scores that is no per-head logit, a
score bias (an additive mask that is not a boolean mask's 0 / -inf), a live dropout,
probabilities read outside the chain (``output_attentions=True``).  A softmax that is not over
such scores (a MoE router's) is not attention and is left alone.

Contract
--------
stage:    dynamo, before ``attention_2d``
applies:  when ``hp * cp > 1``
emits:    one ``F.scaled_dot_product_attention(q, k, v, attn_mask=, scale=)`` per chain
          (``sdpa_with_sinks`` with sinks); the chain's nodes are erased
refuses:  (``LoongUnsupportedError`` naming the chain's source line and the step) the chains
          above that are attention with a step SDPA cannot express
provides: ``EAGER_CALLS`` (``ctx.state``): the SDPA calls written, for ``attention_2d``
reports:  each chain replaced: its source, module, the scale, what the mask was read from, the
          softmax's dtype, the casts dropped, the dropout's p and training flag, the sinks read
"""

from __future__ import annotations

import operator
from typing import Any, NoReturn

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.errors import LoongUnsupportedError
from loong_compile.ops.attention.sinks import sdpa_with_sinks
from loong_compile.passes.base import PassContext, ShardedPass
from loong_compile.passes.fx.autocast import autocast_dtypes
from loong_compile.passes.fx.emit import insert_dynamo_call
from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.nodes import example_value, node_arg, op_name
from loong_compile.passes.fx.op_sets import DTYPE_CASTS
from loong_compile.passes.fx.subgraphs import Scope, add_operand, graph_scopes, parent_of

SCALES = {"mul": False, "imul": False, "truediv": True, "itruediv": True, "div": True}
ADDS = {"add", "iadd"}
# what a step between q @ k^T and the softmax that SDPA cannot express is, for the refusal
UNSUPPORTED = {"tanh": "a softcapped score (tanh: e.g. Gemma 2's attn_logit_softcapping)"}
# the ops a score passes through on its way to the softmax (others end the search: not attention)
SCORE_OPS = DTYPE_CASTS | set(SCALES) | ADDS | {"masked_fill", "cat", "sub"} | set(UNSUPPORTED)
HEAD_BROADCASTS = {"expand", "reshape", "view", "unsqueeze"}
# a masked score: its exponential is 0 in every float dtype (float64's smallest is e^-745)
MASKED_OUT = -1e4


# The fact: the SDPA calls this pass wrote (``attention_2d`` refuses key padding on them).
EAGER_CALLS = "eager_calls"


class EagerAttentionPass(ShardedPass):
    name = "eager_attention"
    stage = "dynamo"
    provides = (EAGER_CALLS,)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        changed, written = [], set()
        scopes = graph_scopes(gm)
        for scope in scopes:
            graph = scope.module.graph
            for softmax in [n for n in graph.nodes if _is_softmax(n)]:
                chain = _match(softmax, scope, scopes)
                if chain is not None:
                    sdpa = _rewrite(graph, chain)
                    written.add(sdpa)
                    changed.append(_record(chain, sdpa))
            graph.lint()
            scope.module.recompile()
        ctx.state[EAGER_CALLS] = written
        return {"matched": len(changed), "changed": changed}


class _Chain:
    """One matched chain: the nodes it reads (q, k, v, the boolean mask) and replaces."""

    def __init__(self, softmax: torch.fx.Node, scope: Scope, scopes: list[Scope]):
        self.softmax, self.scope, self.scopes = softmax, scope, scopes
        self.nodes: list[torch.fx.Node] = [softmax]
        self.q = self.k = self.v = self.out = None
        self.keep: torch.fx.Node | None = None
        self.mask_from = None
        self.scale: Any = 1.0
        self.softmax_dtype = node_arg(softmax, "dtype", 2, None)
        self.casts: list[str] = []
        self.dropout: dict | None = None
        self.sinks: torch.fx.Node | None = None     # (H,) logits joined to every softmax


def _is_softmax(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method") or op_name(node) != "softmax":
        return False
    value = example_value(node)
    dim = node_arg(node, "dim", 1, None)
    return (isinstance(value, torch.Tensor) and isinstance(dim, int)
            and dim % value.dim() == value.dim() - 1)


def _match(softmax: torch.fx.Node, scope: Scope, scopes: list[Scope]) -> _Chain | None:
    """The chain around ``softmax`` (in ``scope``'s graph); None when it is no attention; refused
    when it is attention with a step that SDPA cannot express."""
    path = _path_to_scores(softmax.args[0])
    if path is None:
        return None                                   # not a softmax over q @ k^T
    chain = _Chain(softmax, scope, scopes)
    *steps, qk = path
    for step in steps:
        _read_score_step(chain, step, path)
    chain.nodes += path
    chain.q, kt = qk.args[:2]
    chain.k = _untransposed(kt)           # _path_to_scores found the product by it
    chain.nodes.append(kt)
    _read_probabilities(chain)
    chain.q, chain.k = (_uncast(chain, t, example_value(chain.v).dtype) for t in (chain.q, chain.k))
    values = [example_value(t) for t in (chain.q, chain.k, chain.v)]
    if any(v.dim() != 4 for v in values):
        _refuse(softmax, "q, k and v are not 4-D (batch, heads, tokens, dim)",
                "write attention on (batch, heads, tokens, head dim) tensors")
    dtypes = sorted({str(v.dtype) for v in values})
    # under autocast the products cast their operands, as attention_2d casts SDPA's
    if len(dtypes) > 1 and autocast_dtypes(qk.graph, values[0].device.type).get(qk) is None:
        _refuse(softmax, f"q, k and v have dtypes {dtypes}", "compute the attention in one dtype")
    return chain


def _path_to_scores(node: Any, depth: int = 0) -> list[torch.fx.Node] | None:
    """The nodes from ``node`` back to the ``q @ k^T`` matmul it is computed from (following
    the operand that depends on one, at most 12 steps), the matmul last; None if none."""
    if not isinstance(node, torch.fx.Node) or depth > 12 or node.op not in ("call_function",
                                                                            "call_method"):
        return None
    if op_name(node) == "matmul" and _untransposed(node.args[1]) is not None:
        return [node]
    if op_name(node) not in SCORE_OPS:
        return None
    for arg in node.args:
        if isinstance(arg, (list, tuple)):
            found = next((p for a in arg if (p := _path_to_scores(a, depth + 1))), None)
        else:
            found = _path_to_scores(arg, depth + 1)
        if found is not None:
            return [node, *found]
    return None


def _untransposed(node: Any) -> torch.fx.Node | None:
    """``k`` for ``k.transpose(-2, -1)`` (either order, positive or negative axes), else None."""
    if not isinstance(node, torch.fx.Node) or op_name(node) != "transpose":
        return None
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return None
    axes = {a % value.dim() for a in node.args[1:3] if isinstance(a, int)}
    return node.args[0] if axes == {value.dim() - 2, value.dim() - 1} else None


def _read_score_step(chain: _Chain, step: torch.fx.Node, path: list[torch.fx.Node]) -> None:
    name = op_name(step)
    if name in UNSUPPORTED:
        _refuse(step, f"between q @ k^T and the softmax the scores go through {UNSUPPORTED[name]}",
                "use attn_implementation='sdpa' where the model supports it, or run with hp=cp=1")
    operands = step.args[0] if name == "cat" else step.args
    scores = next(a for a in operands if a in path)
    others = [a for a in operands if a is not scores]
    if name in DTYPE_CASTS:
        chain.casts.append(f"{name} before the softmax")
    elif name in SCALES and len(others) == 1 and (step.args[0] is scores or not SCALES[name]):
        factor = _number(others[0])
        if factor is None:
            _refuse(step, f"the scores are scaled by {_describe(others[0])}, not a number",
                    "scale by a Python number (the module's scaling)")
        chain.scale *= 1 / factor if SCALES[name] else factor
    elif name in ADDS and len(others) == 1 and chain.keep is None:
        found = _boolean_mask(others[0], step, chain.scope, chain.scopes)
        if found is None:
            _refuse(step, f"the scores are added {_describe(others[0])}, which is no boolean "
                          "mask's 0 / -inf: a score bias (ALiBi, relative positions) 2D-Attention "
                          "does not apply", "use a boolean or 0/-inf attention mask, or run with "
                                            "hp=cp=1")
        chain.keep, chain.mask_from = found
    elif name == "sub" and step.args[0] is scores and _is_row_max(others[0], scores):
        chain.casts.append("the row's max subtracted (a softmax's own shift)")
        chain.nodes += [others[0], *others[0].all_input_nodes[:1]]
    elif name == "cat" and chain.sinks is None:
        chain.sinks = _sink_logits(step, scores)
        chain.nodes += _broadcasts(others[0])
    elif name == "masked_fill" and step.args[0] is scores and chain.keep is None:
        fill = node_arg(step, "value", 2, None)
        if not (isinstance(fill, (int, float)) and fill <= MASKED_OUT):
            _refuse(step, f"masked_fill writes {fill!r} into the scores, not -inf",
                    "mask with -inf (or the dtype's smallest value)")
        chain.keep = insert_dynamo_call(step.graph, step, torch.logical_not, (step.args[1],))
        chain.mask_from = f"masked_fill of {step.args[1].name}"
    else:
        _refuse(step, f"between q @ k^T and the softmax the scores go through {name} "
                      f"({_describe(step)}) in a form SDPA has no equivalent for",
                "use attn_implementation='sdpa' where the model supports it, or run with hp=cp=1")


def _is_row_max(value: Any, scores: torch.fx.Node) -> bool:
    """``scores.max(dim=-1, keepdim=True).values`` (or ``amax``)."""
    if isinstance(value, torch.fx.Node) and value.target is operator.getitem and value.args[1] == 0:
        value = value.args[0]
    return (isinstance(value, torch.fx.Node) and op_name(value) in ("max", "amax")
            and value.args[0] is scores and node_arg(value, "dim", 1, None) in (-1, (-1,), [-1])
            and node_arg(value, "keepdim", 2, False) is True)


def _broadcasts(node: Any) -> list[torch.fx.Node]:
    """``node`` and the expands and reshapes it is made by."""
    found = []
    while isinstance(node, torch.fx.Node) and op_name(node) in HEAD_BROADCASTS:
        found.append(node)
        node = node.args[0]
    return found


def _sink_logits(step: torch.fx.Node, scores: torch.fx.Node) -> torch.fx.Node:
    """The ``(H,)`` logits of ``cat([scores, sinks], -1)`` where ``sinks`` is one value per head
    broadcast to a column (gpt-oss: ``module.sinks.reshape(1, -1, 1, 1).expand(B, -1, L, -1)``)."""
    parts, dim = step.args[0], node_arg(step, "dim", 1, 0)
    column = parts[1] if len(parts) == 2 and parts[0] is scores else None
    value = example_value(column)
    heads = example_value(scores).shape[1]
    source = column
    while isinstance(source, torch.fx.Node) and op_name(source) in HEAD_BROADCASTS \
            and example_value(source).numel() != heads:
        source = source.args[0]
    if not (dim in (-1, 3) and isinstance(value, torch.Tensor) and value.shape[-1] == 1
            and isinstance(source, torch.fx.Node) and example_value(source).numel() == heads):
        _refuse(step, "a column joined to the scores is not one logit per head (attention "
                      "sinks are)", "join the sinks as module.sinks.reshape(1, -1, 1, 1)"
                                    ".expand(batch, -1, q_len, -1), or run with hp=cp=1")
    return insert_dynamo_call(step.graph, step, torch.reshape, (source, (heads,)))


def _boolean_mask(mask: Any, anchor: torch.fx.Node, scope: Scope,
                  scopes: list[Scope]) -> tuple[torch.fx.Node, str] | None:
    """The boolean mask (True = seen) under an additive ``where(keep, 0, min)``, through full
    slices of it (``mask[:, :, :, :k_len]``) and into the caller of a checkpointed body (then
    passed into the body as a new operand); None for any other additive mask.  New nodes go
    before ``anchor``, in ``scope``'s graph."""
    if isinstance(mask, torch.fx.Node) and mask.op == "placeholder" and mask in scope.operands:
        parent = parent_of(scope, scopes)
        found = _boolean_mask(scope.operands[mask], scope.caller, parent, scopes)
        if found is None:
            return None
        return add_operand(scope, found[0], f"{found[0].name}_keep"), found[1]
    index = None
    while isinstance(mask, torch.fx.Node) and mask.target is operator.getitem and _full(mask):
        index, mask = mask.args[1], mask.args[0]
    if not (isinstance(mask, torch.fx.Node) and op_name(mask) == "where" and len(mask.args) == 3
            and _is_zero(mask.args[1]) and (_number(mask.args[2]) or 0) <= MASKED_OUT):
        return None
    keep = mask.args[0]
    if index is not None:
        keep = insert_dynamo_call(anchor.graph, anchor, operator.getitem, (keep, index))
    return keep, f"where({mask.args[0].name}, 0, {_number(mask.args[2]):.3g})"


def _read_probabilities(chain: _Chain) -> None:
    """From the softmax to ``p @ v``: casts and a dropout that does nothing, read by nothing
    else."""
    node = chain.softmax
    while True:
        users = list(node.users)
        if len(users) != 1:
            _refuse(chain.softmax, f"the attention probabilities are read by {len(users)} nodes "
                                   f"({', '.join(u.name for u in users)}), not only by p @ v",
                    "do not return the attention weights (output_attentions=False)")
        (user,) = users
        name = op_name(user)
        if name in DTYPE_CASTS and user.args[0] is node:
            chain.casts.append(f"{name} after the softmax")
        elif name == "dropout":
            p, training = node_arg(user, "p", 1, 0.5), node_arg(user, "training", 2, True)
            if p != 0 and training is not False:
                _refuse(user, f"attention dropout p={p!r} is live (training={training!r}); "
                              "dropout over a sharded sequence would not equal one process's",
                        "set the attention dropout to 0 (attention_dropout=0.0), or model.eval()")
            chain.dropout = {"p": p, "training": training}
        elif chain.sinks is not None and user.target is operator.getitem and \
                user.args[1] == (Ellipsis, slice(None, -1, None)):
            pass                                      # the sink's column dropped
        elif name == "matmul" and user.args[0] is node:
            chain.v, chain.out = user.args[1], user
            return
        else:
            _refuse(user, f"the attention probabilities go into {name} ({_describe(user)}) "
                          "before p @ v", "multiply the softmax's output by v directly")
        chain.nodes.append(user)
        node = user


def _uncast(chain: _Chain, tensor: Any, dtype: torch.dtype) -> Any:
    """``tensor`` before a cast of it to another dtype than v's (GPT-J's float32 q and k)."""
    while (isinstance(tensor, torch.fx.Node) and op_name(tensor) in DTYPE_CASTS
           and example_value(tensor).dtype != dtype
           and example_value(tensor.args[0]).dtype == dtype):
        chain.casts.append(f"{op_name(tensor)} of {tensor.args[0].name}")
        tensor = tensor.args[0]
    return tensor


def _rewrite(graph: torch.fx.Graph, chain: _Chain) -> torch.fx.Node:
    """The SDPA call written in place of the chain, whose nodes are erased."""
    out = chain.out
    kwargs = {"attn_mask": chain.keep, "scale": float(chain.scale)}
    if chain.sinks is None:
        sdpa = insert_dynamo_call(graph, out, F.scaled_dot_product_attention,
                                  (chain.q, chain.k, chain.v), kwargs)
    else:
        sdpa = insert_dynamo_call(graph, out, sdpa_with_sinks,
                                  (chain.q, chain.k, chain.v, chain.sinks), kwargs)
    out.replace_all_uses_with(sdpa)
    dead = [out, *reversed(chain.nodes)]
    while any(not n.users for n in dead):
        for node in [n for n in dead if not n.users]:
            graph.erase_node(node)
            dead.remove(node)
    return sdpa


def _record(chain: _Chain, sdpa: torch.fx.Node) -> dict:
    """What the report says of one chain replaced."""
    return {"node": sdpa.name, "source": source_line(sdpa), "module": module_path(sdpa),
            "scale": chain.scale, "mask": chain.mask_from,
            "softmax_dtype": None if chain.softmax_dtype is None else str(chain.softmax_dtype),
            "casts_dropped": chain.casts, "dropout": chain.dropout,
            "sinks": None if chain.sinks is None else chain.sinks.args[0].name}


def _number(value: Any) -> float | None:
    """A Python number, or the value of a 0-d constant made by ``full``/``tensor``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.fx.Node) and op_name(value) in ("full", "tensor"):
        fill = value.args[1] if op_name(value) == "full" else value.args[0]
        return float(fill) if isinstance(fill, (int, float)) else None
    return None


def _is_zero(value: Any) -> bool:
    if isinstance(value, torch.fx.Node) and op_name(value) in ("zeros", "zeros_like"):
        return True
    return _number(value) == 0


def _full(node: torch.fx.Node) -> bool:
    """A getitem of slices and ``None``-free indices that keeps every element of its input."""
    index, src = node.args[1], example_value(node.args[0])
    value = example_value(node)
    return (isinstance(index, tuple) and isinstance(src, torch.Tensor)
            and isinstance(value, torch.Tensor) and value.shape == src.shape
            and all(isinstance(i, slice) or i is Ellipsis for i in index))


def _describe(node: Any) -> str:
    return node.name if isinstance(node, torch.fx.Node) else repr(node)


def _refuse(node: torch.fx.Node, reason: str, fix: str) -> NoReturn:
    raise LoongUnsupportedError(
        f"attention written as ops at {source_line(node)} (module {module_path(node)}, "
        f"node {node.name})", f"it cannot become 2D-Attention exactly: {reason}", fix)

