"""The token analysis: which nodes of a Dynamo graph act on each token alone, and why the others
do not.

``TokenAnalysis`` walks a graph (and its higher-order-op bodies, scope by scope) from the inputs
with a token axis, marks every value computed from token data (``tainted``), and records a
*finding* (node, reason, fix) at each node that mixes tokens: a product or a move along a token
axis, a reduction over it other than a sum (a sum goes to ``partial``), an op it cannot see
into, attention it does not know to be exact.  What two passes read from it:

- ``safety/token_locality.py`` refuses the graph under ``hp*cp > 1`` at the first finding;
- ``tiling/regions.py`` tiles only nodes with no finding, outside ``partial`` and the exact
  mixers (``local``): every such node computes each token from that token alone.

How a node is read (the rule its op falls under, the axes it works on) is ``token_ops.py``;
a sort of the rows proven undone (a mixture of experts' dispatch) is ``row_permutation.py``,
which reads ``row_ops.py`` (ops that treat every row alike).  The token axis is any axis whose
size is a multiple of the local token count ``T``, except the trailing feature axis of a
floating tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.ops.sequence import sequence_label_count
from loong_compile.passes.fx.nodes import example_value, is_weight, node_arg, op_name
from loong_compile.passes.fx.op_sets import LOSSES, RESHAPES
from loong_compile.passes.fx.row_permutation import PROOF, RowPermutations
from loong_compile.passes.fx.subgraphs import hop_name
from loong_compile.passes.fx.token_ops import (
    ALLOWED_HOPS, ALONG_AXIS, CONVS, COUNTS, LINEAR, POSITIONS, PRODUCTS, REDUCTIONS,
    UNREWRITTEN_ATTENTION, contractions, custom_op, from_input, full_slice, reduced_dims)
from loong_compile.passes.fx.tokens import counts_tokens


class TokenAnalysis:
    def __init__(self, tokens: int, token_local_ops: set[str], mixers: frozenset):
        self.tokens = tokens
        self.token_local_ops = token_local_ops
        self.mixers = mixers  # what the rewrites emitted: exact across ranks
        self.tainted: set[torch.fx.Node] = set()
        self.partial: set[torch.fx.Node] = set()  # sums over this rank's tokens
        self.findings: list[tuple[torch.fx.Node, str, str]] = []
        self.inputs: list[str] = []
        self.checked = 0
        self.rows = RowPermutations(tokens, self.tainted)

    def scan(self, scope) -> None:
        for node in scope.module.graph.nodes:
            if node.op == "placeholder":
                outer = scope.operands.get(node)
                token = outer in self.tainted if scope.operands else (
                    not is_weight(node) and bool(self.axes(node)))
                if token:
                    self.tainted.add(node)
                    if scope.hop is None:
                        self.inputs.append(node.name)
                continue
            verdict = self.rows.visit(node)
            if node.op not in ("call_function", "call_method") or node.target in SEQUENCE_VALUES:
                continue
            inputs = [a for a in node.all_input_nodes if a in self.tainted]
            name = op_name(node)
            if name in POSITIONS and self.axes(node) and not self.rows.defers(node):
                self.refuse(node, f"{name} of length {self.tokens} makes positions (or a mask) "
                            "from the local length: the model numbered this rank's tokens itself",
                            "pass position_ids=batch.position_ids (from loong_compile.shard_batch)"
                            " to the model")
            if not inputs:
                if self.axes(node):  # a token-shaped constant (ones(B, T), ...) counts as tokens
                    self.tainted.add(node)
                continue
            self.tainted.add(node)
            self.checked += 1
            if node.target not in self.mixers and verdict is not PROOF:
                self.check(node, name, inputs)

    def refuse_unproven(self) -> None:
        """A sort whose permutation the proof does not see undone is refused as any sort is."""
        for sort, why in self.rows.unproven():
            count = len(self.findings)
            self.check(sort, op_name(sort), [sort.args[0]])
            self.findings[count:] = [
                (node, f"{reason} (not a row permutation proven undone: {why})", fix)
                for node, reason, fix in self.findings[count:]]

    def check(self, node: torch.fx.Node, name: str, inputs: list[torch.fx.Node]) -> None:
        source = inputs[0]
        partial_in = [a for a in node.all_input_nodes if a in self.partial]
        if partial_in:
            self.check_partial(node, name, partial_in)
        hop = hop_name(node)
        if name in UNREWRITTEN_ATTENTION:
            self.refuse(node, f"{name} is attention the backend does not rewrite (Dynamo keeps "
                        "nn.MultiheadAttention as one opaque call)",
                        "call F.scaled_dot_product_attention on (B, heads, S, head_dim) tensors "
                        "(transformers: attn_implementation='sdpa'), or run with hp=cp=1")
        elif hop is not None and hop not in ALLOWED_HOPS:
            self.refuse(node, f"{hop} is not rewritten into 2D-Attention",
                        "use F.scaled_dot_product_attention (attn_implementation='sdpa'), or "
                        "run with hp=cp=1")
        elif custom_op(node.target) and custom_op(node.target) not in self.token_local_ops:
            op = custom_op(node.target)
            self.refuse(node, f"custom op {op} reads token data and the analysis cannot see "
                        "inside it", f"if {op} computes every token on its own, pass "
                        f"token_local_ops=[{op!r}] in options; otherwise run with hp=cp=1")
        elif name in PRODUCTS and len(inputs) >= 2 and self.pairs_tokens(node, name):
            self.refuse(node, f"{name} of two token tensors gives a token x token product "
                        f"{tuple(example_value(node).shape)}: attention the backend did not rewrite "
                        "(e.g. attn_implementation='eager')",
                        "use attn_implementation='sdpa' (F.scaled_dot_product_attention), which "
                        "becomes 2D-Attention, or run with hp=cp=1")
        elif name in PRODUCTS and self.sums_tokens(node, name):
            self.refuse(node, f"{name} sums over a token axis: over this rank's tokens only",
                        _GATHER_FIX)
        elif name in RESHAPES and self.axes(node) and example_value(source).dim() >= 3 \
                and not self.axes(source):
            self.refuse(node, f"{name} to {tuple(example_value(node).shape)} makes a token-sized "
                        f"axis of {tuple(example_value(source).shape)}, which has none where "
                        "tokens can be followed (a token axis moved last, then viewed back, mixes "
                        "tokens with features)", _GATHER_FIX)
        elif name in COUNTS and self.axes(source, trailing=True):
            self.refuse(node, f"{name} counts over the token axis, this rank's tokens only",
                        _GATHER_FIX)
        elif name in CONVS and self.axes(source, trailing=True):
            self.refuse(node, f"{name} slides over the token axis", "run with hp=cp=1")
        elif name in LOSSES:
            reduction = node_arg(node, "reduction", None, "mean")
            if reduction == "mean":
                self.refuse(node, f"{name}(reduction='mean') averages over this rank's tokens, "
                            "not over the batch", _SUM_FIX)
            elif reduction == "sum":
                self.partial.add(node)
        elif name in ("getitem", "setitem") and isinstance(example_value(source), torch.Tensor):
            if node.args[0] in self.tainted:  # a lookup in a tensor without tokens is per token
                self.check_index(node, node.args[0])
        elif name == "pad":
            self.check_pad(node, source)
        elif name == "cat":
            self.check_cat(node)
        elif name in ALONG_AXIS | REDUCTIONS | {"sum"}:
            self.check_axis(node, name, source)

    def pairs_tokens(self, node, name) -> bool:
        """Two token axes in a product of token tensors: among the rows and columns of a
        (batched) matmul, whose batch axes pair each token with itself."""
        axes = self.axes(node, trailing=True)
        if name != "einsum":
            axes = [a for a in axes if a >= example_value(node).dim() - 2]
        return len(axes) >= 2

    def sums_tokens(self, node, name) -> bool:
        """A product that sums over a token axis: of a token tensor (not its trailing feature
        axis), or of two token tensors over an axis of token size; unless a shared batch axis
        holds the tokens of every token operand (a product token by token)."""
        for carriers in contractions(node, name):
            # token data, not a constant shaped like tokens (a weight's transpose of token size)
            tokens = [(op, axis, batch) for op, axis, batch in carriers if op in self.rows.data
                      or op.op == "placeholder" and op in self.tainted]
            if not tokens or all(set(batch) & set(self.axes(op)) for op, _, batch in tokens):
                continue
            if any(axis in self.axes(op) for op, axis, _ in tokens):
                return True
            if len(tokens) >= 2 and all(counts_tokens(example_value(op).shape[axis], self.tokens)
                                        for op, axis, _ in tokens):
                return True
        return False

    def check_axis(self, node, name, source) -> None:
        axes = self.axes(source)
        if not axes:
            return
        value = example_value(source)
        dims = reduced_dims(node, value.dim(), name)
        hit = axes if dims is None else [d for d in dims if d in axes]
        if not hit or name in SPLITS and self.whole_or_empty(node, hit):
            return
        if name == "sum":
            self.partial.add(node)
        elif name == "flatten" and dims is not None and min(dims) < min(hit):
            return  # flatten(0, 1) of (B, T, ...) keeps tokens apart
        elif name == "mean" or name == "nanmean":
            self.refuse(node, f"{name} over the token axis averages this rank's tokens only",
                        _SUM_FIX)
        else:
            self.refuse(node, f"{name} along the token axis {hit[0]} of "
                        f"{tuple(value.shape)} mixes or moves tokens", _GATHER_FIX)

    def whole_or_empty(self, node, hit: list[int]) -> bool:
        """A split whose pieces along the token axes are all of them or none: every token stays
        where it was (transformers 5.25's ``tensor_split(x, [seq_len - states_kept])`` with no
        cache keeps no token apart for the step-by-step tail)."""
        pieces = example_value(node)
        if not isinstance(pieces, (tuple, list)) or not all(isinstance(p, torch.Tensor)
                                                            for p in pieces):
            return False
        whole = example_value(node.args[0]).shape
        sizes = [[p.shape[axis] for axis in hit] for p in pieces]
        return all(all(isinstance(s, int) and s in (0, whole[axis]) for s, axis in zip(row, hit))
                   for row in sizes) and sum(1 for row in sizes if any(row)) == 1

    def check_index(self, node, source) -> None:
        value, axes = example_value(source), self.axes(source)
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            fill = value.dim() - sum(1 for i in index if i is not None and i is not Ellipsis)
            index = index[:at] + (slice(None),) * fill + index[at + 1:]
        axis = 0
        for item in index:
            if item is None:
                continue
            if axis in axes and not full_slice(item, value.shape[axis]):
                self.refuse(node, f"indexing {item!r} on the token axis {axis} of "
                            f"{tuple(value.shape)} selects or shifts tokens{_labels_hint(source)}",
                            _labels_fix(source))
            axis += 1

    def check_pad(self, node, source) -> None:
        value, axes = example_value(source), self.axes(source, trailing=True)
        pad = node_arg(node, "pad", 1, ())
        padded = [value.dim() - 1 - i // 2 for i, p in enumerate(pad) if p]
        hit = [a for a in padded if a in axes]
        if hit:
            self.refuse(node, f"pad {tuple(pad)} on the token axis {hit[0]} shifts tokens"
                        f"{_labels_hint(source)}", _labels_fix(source))

    def check_cat(self, node) -> None:
        parts = node.args[0] if node.args else node.kwargs.get("tensors", ())
        values = [example_value(p) for p in parts]
        nonempty = [v for v in values if isinstance(v, torch.Tensor)
                    and not (isinstance(v.numel(), int) and v.numel() == 0)]
        dim = node_arg(node, "dim", 1, 0)
        out = example_value(node)
        if len(nonempty) > 1 and isinstance(out, torch.Tensor):
            dim %= out.dim()
            if any(isinstance(v, torch.Tensor) and dim in self.axes_of(v) for v in nonempty):
                self.refuse(node, f"cat along the token axis {dim} joins token sequences",
                            _GATHER_FIX)

    def check_partial(self, node, name, partial_in) -> None:
        """Sums over local tokens add up across ranks; only linear use of them stays exact."""
        rest = [a for a in node.all_input_nodes if a not in self.partial]
        scaled = not any(a in self.tainted for a in rest)  # by a constant, not by token data
        if name in ("mul", "imul") and len(partial_in) == 1 and scaled \
                or name in ("truediv", "div", "itruediv") and node.args[0] in partial_in \
                and len(partial_in) == 1 and scaled \
                or name in LINEAR - {"mul", "imul", "truediv", "div", "itruediv"}:
            self.partial.add(node)
        else:
            self.refuse(node, f"{name} of a sum over this rank's tokens ({partial_in[0].name}): "
                        "only the sum over all ranks' tokens is the one-process value", _SUM_FIX)

    def axes(self, node: Any, trailing: bool = False) -> list[int]:
        value = example_value(node)
        return self.axes_of(value, trailing) if isinstance(value, torch.Tensor) else []

    def axes_of(self, value: torch.Tensor, trailing: bool = False) -> list[int]:
        """Axes whose size is a multiple of T; the trailing feature axis of a floating tensor
        (hidden, head or class dim) is not one unless ``trailing``."""
        n = value.dim()
        skip = not trailing and n >= 2 and (value.is_floating_point() or n >= 3)
        return [i for i, size in enumerate(value.shape)
                if counts_tokens(size, self.tokens) and not (skip and i == n - 1)]

    def refuse(self, node, reason: str, fix: str) -> None:
        stack = node.meta.get("stack_trace") or ""
        if f"in {_AUX_LOSS}" in stack:
            reason = (f"{reason}, in the router's auxiliary load-balancing loss "
                      "(output_router_logits=True), whose expert statistics cover the whole "
                      "sequence")
            fix = _AUX_LOSS_FIX
        scan = next((f for f in _RECURRENCES if f"in {f}" in stack), None)
        if scan:
            reason = (f"{reason}, in {scan} ({_RECURRENCES[scan]}), a recurrence that "
                      "carries a state from token to token, in a form the scans stage does not "
                      "rewrite")
            fix = "run with hp=cp=1"
        self.findings.append((node, reason, fix))


# ops that cut a tensor into pieces along an axis
SPLITS = {"split", "tensor_split", "chunk"}
# ops whose result is a value of the whole sequence, the same on every rank of it: not token data
SEQUENCE_VALUES = (sequence_label_count,)
_SUM_FIX = ("sum the per-token losses and divide by the global count of label tokens: "
            "reduction='sum' / N (with transformers: pass num_items_in_batch=N), or compute the "
            "loss outside the compiled model")
# transformers' load-balancing loss, named in the message only (the token rules refuse it)
_AUX_LOSS = "load_balancing_loss_func"
# transformers' torch fallbacks of recurrences, named in the message when a refused node sits in
# one: a call the scans stage left as it is (its report says why) or a mixer's torch_forward
_RECURRENCES = {"torch_chunk_gated_delta_rule": "gated DeltaNet, Qwen3-Next and Qwen3.5",
                "mamba2_chunk_scan": "Mamba-2's selective scan",
                "torch_forward": "a Mamba-2 mixer's selective scan"}
_AUX_LOSS_FIX = ("pass output_router_logits=False; to train with the loss, compute it outside the "
                 "compiled model from the router_logits it returns, with the expert counts summed "
                 "over the sequence's ranks (all_reduce) and each rank's routing probabilities "
                 "summed over its tokens, both divided by the global token count (the ranks' "
                 "shares then add up to one process's loss)")
_GATHER_FIX = ("compute this outside the compiled model on gathered tokens "
               "(loong_compile.gather_sequence), or run with hp=cp=1")


def _labels_hint(node: torch.fx.Node) -> str:
    return (" (transformers' loss shifts `labels` by one token; loong_compile.shard_batch already "
            "shifted them over the full sequence)" if from_input(node, "labels") else "")


def _labels_fix(node: torch.fx.Node) -> str:
    if from_input(node, "labels"):
        return ("pass shift_labels=batch.labels besides labels=batch.labels (transformers then "
                "does not shift again) and num_items_in_batch=N, the number of label tokens "
                "!= -100 in the full batch")
    return _GATHER_FIX
