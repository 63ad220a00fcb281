"""The short causal convolution of hybrid models, on a rank's tokens, made exact.

Contract
--------
stage:    dynamo, after ``attention_2d`` (which fixes the tokens per rank) and before
          ``token_locality`` (which then lets the new op combine tokens)
applies:  when ``hp * cp > 1``; at ``hp = cp = 1`` where the graph has a positions input (the op
          then reads no token of an earlier document, as under hp·cp > 1: ``regions.ScanPass``)
requires: ``example_value`` on the Dynamo graph's nodes; uses ``position_inputs`` (the
          documents: ``passes/scans/documents.py``)
matches:  in the graph and its inline higher-order-op bodies (activation checkpointing), a
          ``conv1d`` over ``(B, C, T)`` with ``T`` this rank's tokens, depthwise (``groups = C``,
          weight ``(C, 1, k)``), stride and dilation 1, ``padding = k-1``, whose every use is
          ``[..., :T]``: what transformers' ``causal_conv1d_fn`` torch fallback (Qwen3-Next,
          Qwen3.5, LFM2, Mamba-2's mixers) and ``nn.Conv1d(padding=k-1)(x)[..., :T]`` compute
provides: ``scan_sites``: each matched call is ``ops.scans.causal_conv.causal_conv1d`` over the
          sequence's ranks (its halo exchanged, exact; within each packed document)
refuses:  nothing itself: a convolution that does not match is left for ``token_locality``, which
          refuses it by name; the documents as ``gated_delta``'s
reports:  each rewritten call (module, source line, channels, kernel), the documents it keeps
          apart, and the bytes it sends to each other rank per call (docs/attention.md, "Scans")
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.ops.scans.causal_conv import causal_conv1d, halo_bytes
from loong_compile.ops.scans.exchange import group_runs
from loong_compile.passes.base import SCAN_SITES, PassContext, add_exact_mixers
from loong_compile.passes.fx.emit import copy_source_meta, insert_dynamo_call
from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.nodes import example_value, node_arg
from loong_compile.passes.fx.subgraphs import graph_scopes
from loong_compile.passes.fx.tokens import local_token_count
from loong_compile.passes.scans.documents import documents_for
from loong_compile.passes.scans.regions import ONE_RANK_WITHOUT_DOCUMENTS, ScanPass, scan_mesh

CONV1D = (torch.conv1d, F.conv1d)


class CausalConvPass(ScanPass):
    name = "causal_conv"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        add_exact_mixers(ctx, SCAN_SITES, (causal_conv1d,))
        tokens = local_token_count(gm)
        scopes = graph_scopes(gm)
        found = [(scope, node) for scope in scopes if scope.inline
                 for node in scope.module.graph.nodes
                 if node.op == "call_function" and node.target in CONV1D and _causal(node, tokens)]
        if not found:
            return {"matched": 0, "changed": [], "kept": [], "tokens_per_rank": tokens}
        # each rank's place in the group is read at run time, and the group's name is a keyword
        # ending in _group (which the ranks' graph comparison leaves out): one graph on every rank
        kwargs = scan_mesh(ctx).scan_kwargs() | {"group_rank": None}
        runs = max(len(r) for r in group_runs(tokens * len(kwargs["places"]), kwargs["hp"],
                                              kwargs["cp"], kwargs["places"]))
        changed, kept = [], []
        for scope, node in found:
            documents, how = documents_for(gm, ctx, scope, scopes, node)
            if documents is None and ctx.config.sp == 1:
                kept.append({"module": module_path(node), "source": source_line(node),
                             "reason": ONE_RANK_WITHOUT_DOCUMENTS})
                continue
            changed.append(_rewrite(scope.module.graph, node, kwargs | {"documents": documents}, runs)
                           | {"documents": how})
        for scope in {id(scope): scope for scope, _ in found}.values():
            scope.module.recompile()
        return {"matched": len(found), "changed": changed, "kept": kept, "tokens_per_rank": tokens}


def _causal(conv: torch.fx.Node, tokens: int) -> bool:
    """A depthwise causal convolution over this rank's tokens, kept to its first ``T`` outputs."""
    x, weight = example_value(conv.args[0]), example_value(node_arg(conv, "weight", 1, None))
    if tokens is None or not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != tokens:
        return False
    channels, kernel = x.shape[1], weight.shape[-1]
    if (tuple(weight.shape) != (channels, 1, kernel) or node_arg(conv, "groups", 6, 1) != channels
            or _single(node_arg(conv, "padding", 4, 0)) != kernel - 1 or _single(node_arg(conv, "stride", 3, 1)) != 1
            or _single(node_arg(conv, "dilation", 5, 1)) != 1):
        return False
    return bool(conv.users) and all(_first_tokens(use, tokens) for use in conv.users)


def _single(value) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def _first_tokens(use: torch.fx.Node, tokens: int) -> bool:
    """``use`` is ``out[:, :, :T]`` (or ``out[..., :T]``)."""
    if use.target is not operator.getitem or not isinstance(use.args[1], tuple):
        return False
    *lead, last = use.args[1]
    return last == slice(None, tokens) and (lead == [Ellipsis] or lead == [slice(None)] * 2)


def _rewrite(graph: torch.fx.Graph, conv: torch.fx.Node, kwargs: dict, runs: int) -> dict[str, Any]:
    x, weight, bias = conv.args[0], node_arg(conv, "weight", 1, None), node_arg(conv, "bias", 2, None)
    kernel_2d = insert_dynamo_call(graph, conv, torch.squeeze, (weight, 1))
    with graph.inserting_before(conv):
        call = graph.call_function(causal_conv1d, (x, kernel_2d, bias), dict(kwargs))
    # the value of what it replaces (the op is not run here: it would exchange with the ranks)
    copy_source_meta(next(iter(conv.users)), call, also=("example_value",))
    for use in list(conv.users):
        use.replace_all_uses_with(call)
        graph.erase_node(use)
    graph.erase_node(conv)
    value = example_value(call)
    batch, channels, _ = value.shape
    kernel = example_value(kernel_2d).shape[-1]
    return {"module": module_path(call), "source": source_line(call), "channels": channels,
            "kernel": kernel,
            "bytes_to_each_rank": halo_bytes(batch, channels, kernel, runs, value.element_size())}
