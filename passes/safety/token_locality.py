"""Refuse token mixing on a rank's local tokens: what runs outside 2D-Attention must be per-token.

Contract
--------
stage:    dynamo, after ``attention_2d`` and the scans (whose calls are the only token mixing
          allowed)
applies:  when ``hp * cp > 1``
requires: the Dynamo graph's ``example_value`` metadata (static shapes)
matches:  every node of the graph and of its higher-order-op bodies that reads token data
          (graph inputs with a token axis and everything computed from them); the token axis is
          any axis whose size is a multiple of the local token count ``T``, except the trailing
          feature axis of a floating tensor.
refuses:  with ``LoongTokenMixingError``, on every rank alike (the graph is the same), before
          anything runs:
          - a product of two token tensors over token axes (attention the rewrite did not match),
            and a product that sums over a token axis;
          - a view that makes a token-sized axis of a token tensor whose tokens it cannot follow;
          - positions made from the local length (``arange(T)``: ``position_ids`` left out);
          - moving, selecting, cutting or joining along a token axis (``labels`` shifted inside
            the model, ``x[:, -1]``, ``cumsum``, ``roll``, ``pad`` ...), and counting over it
            (``histc``); but for a sort of the rows that ``row_permutation`` proves undone (a
            mixture of experts' dispatch: sort by expert, grouped matmuls, the inverse gather);
          - reductions over token axes other than a sum (a local mean is not the global mean),
            ``cross_entropy`` with ``reduction="mean"``, and nonlinear functions of a token sum
            (the ranks' sums only add up to the global one);
          - custom ops on token data not listed in ``token_local_ops``; attention the rewrite
            left alone: ``flex_attention``, ``nn.MultiheadAttention`` (one opaque call);
          - a graph with no rewritten attention at all, unless ``allow_graphs_without_attention``
            (attention the rewrite did not recognise would otherwise run on local tokens).
          What only reaches the graph's outputs untouched (a KV cache transformers returns) is
          not refused: it is listed in the report as local values that differ from one process.
The analysis itself (what counts as mixing, the rules of each op) is
``passes/fx/token_analysis.py``, which the tiling pass reads too.
reports:  the local token count, the token inputs found, the nodes checked, the row
          permutations proven undone (where, how many grouped matmuls), the local-only outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.errors import LoongTokenMixingError
from loong_compile.passes.base import ATTENTION_SITES, SCAN_SITES, PassContext, ShardedPass, exact_mixers
from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.nodes import op_name
from loong_compile.passes.fx.row_ops import writes
from loong_compile.passes.fx.subgraphs import graph_scopes
from loong_compile.passes.fx.token_analysis import TokenAnalysis
from loong_compile.passes.fx.token_ops import POSITIONS
from loong_compile.passes.fx.tokens import local_token_count
from loong_compile.passes.fx.walks import only_returned


class TokenLocalityPass(ShardedPass):
    name = "token_locality"
    stage = "dynamo"
    # Only the rewritten attention may combine tokens: the ops ``attention_2d`` declares it
    # emits are the ones this analysis allows ...
    requires = (ATTENTION_SITES,)
    # ... and the scans' ops, where the scans stage rewrote a convolution or a recurrence
    uses = (SCAN_SITES,)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        tokens = local_token_count(gm)
        if tokens is None:
            return {"matched": 0, "tokens_per_rank": None}
        analysis = TokenAnalysis(tokens, set(ctx.config.token_local_ops), exact_mixers(ctx))
        for scope in graph_scopes(gm):
            analysis.scan(scope)
        analysis.refuse_unproven()
        local_outputs = [f for f in analysis.findings if only_returned(_written(f[0]), gm.graph)]
        # the most telling first: unrewritten attention explains the masks and positions around it
        findings = sorted((f for f in analysis.findings if f not in local_outputs),
                          key=lambda f: f[1].startswith(tuple(POSITIONS)))
        if findings:
            node, reason, fix = findings[0]
            more = len(findings) - 1
            raise LoongTokenMixingError(
                f"{_describe(node)} under hp={ctx.config.hp}, cp={ctx.config.cp} "
                f"({tokens} tokens per rank){f' (and {more} more)' if more else ''}",
                f"each rank holds only its share of the sequence, so nothing but the rewritten "
                f"attention may combine tokens: {reason}", fix)
        attention_ops = ctx.state.get(ATTENTION_SITES, ())
        attention = sum(1 for scope in graph_scopes(gm) for n in scope.module.graph.nodes
                        if n.target in attention_ops)
        if not attention and not ctx.config.allow_graphs_without_attention:
            raise LoongTokenMixingError(
                f"graph {ctx.graph_id} has no attention call the backend rewrites, under "
                f"hp={ctx.config.hp}, cp={ctx.config.cp}",
                "a multi-rank graph runs on each rank's tokens alone: attention the backend did "
                "not recognise (or hidden in an op the analysis cannot see into) would silently "
                "see only local tokens",
                "use F.scaled_dot_product_attention (attn_implementation='sdpa'); if this graph "
                "really computes each token on its own (e.g. a loss head after a graph break), "
                "pass allow_graphs_without_attention=True")
        return {"matched": analysis.checked, "attention": attention,
                "tokens_per_rank": tokens if isinstance(tokens, int) else str(tokens),
                "token_inputs": analysis.inputs,
                "row_permutations": analysis.rows.proven(),
                "local_only_outputs": [f"{n.name}: {reason}" for n, reason, _ in local_outputs]}


def _written(node: torch.fx.Node) -> torch.fx.Node:
    """The value a node's result lives in: the tensor an in-place write changes (``x[i] = v``
    returns nothing; ``x.index_fill_`` returns x), else the node itself."""
    return node.args[0] if writes(node) and node.args else node


def _describe(node: torch.fx.Node) -> str:
    return f"{node.name} ({op_name(node)}) at {source_line(node)} (module {module_path(node)})"
