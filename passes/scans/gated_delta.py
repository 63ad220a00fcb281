"""Gated DeltaNet's recurrence (Qwen3-Next, Qwen3.5), on a rank's tokens, made exact.

Contract
--------
stage:    dynamo, after ``causal_conv`` and before ``token_locality``
applies:  when ``hp * cp > 1``
requires: ``example_value`` and ``stack_trace`` on the Dynamo graph's nodes
matches:  the nodes Dynamo traced inside one call of transformers' torch fallback
          ``torch_chunk_gated_delta_rule`` (its chunk loop unrolled over this rank's tokens),
          in the graph and its inline higher-order-op bodies: a region whose inputs are five
          tensors (query, key, value, log-decay, beta, in the order the function first reads
          them) and whose one output leaves it.  The region is not trusted by its name: it is
          run at compile time on random inputs of its shapes in float64 and must equal
          ``ops.gated_scan.gated_delta_rule`` on one rank (with or without the queries' and
          keys' l2 norm: whichever agrees) within float32 round-off.
provides: ``scan_sites``: each matched region is ``ops.gated_scan.gated_delta_rule`` (the state
          exchanged between the sequence's ranks; under hp > 1 the heads split over the HP group)
refuses:  nothing: a region that does not match is left for ``token_locality``, which refuses it
          by name
reports:  each rewritten call (module, heads, head dims, whether it l2-normalises), its proof
          error, and the bytes it sends to each other rank of its CP group per call
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile._compat.aot import real_tensors
from loong_compile.ops.gated_scan import gated_delta_rule, state_bytes
from loong_compile.ops.scan_exchange import group_runs
from loong_compile.passes.base import PassContext, ShardedPass
from loong_compile.passes.fx_util import module_path
from loong_compile.passes.safety.token_ops import example_value, only_returned
from loong_compile.passes.scans import SCAN_SITES
from loong_compile.passes.subgraphs import graph_scopes

FUNCTION = "torch_chunk_gated_delta_rule"
# the region computes in float32 (transformers casts), the candidate in float32 too: what
# differs is the order of the sums, well inside this; a different recurrence is off by O(1)
PROOF_TOLERANCE = 1e-4


class GatedDeltaPass(ShardedPass):
    name = "gated_delta"
    stage = "dynamo"
    provides = (SCAN_SITES,)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        changed, kept = [], []
        for scope in graph_scopes(gm):
            regions = _regions(scope.module.graph) if scope.inline else []
            for region in regions:
                try:
                    changed.append(_rewrite(scope.module.graph, region, ctx.mesh))
                except _NotMatched as why:
                    kept.append({"module": module_path(region[0]), "reason": str(why)})
            if regions:
                scope.module.recompile()
        return {"matched": len(changed) + len(kept), "changed": changed, "kept": kept}


class _NotMatched(Exception):
    """Why a region is left for the token analysis (a sentence)."""


def _regions(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The nodes of each call of ``FUNCTION``, in graph order: consecutive nodes of one module."""
    regions, current, path = [], [], None
    for node in graph.nodes:
        inside = f"in {FUNCTION}" in (node.meta.get("stack_trace") or "")
        if inside and current and module_path(node) == path:
            current.append(node)
            continue
        if current:
            regions.append(current)
        current, path = ([node], module_path(node)) if inside else ([], None)
    return regions + ([current] if current else [])


def _rewrite(graph: torch.fx.Graph, region: list[torch.fx.Node], mesh) -> dict[str, Any]:
    members = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in members))
    exits = [n for n in region if any(u not in members for u in n.users)]
    if len(inputs) != 5:
        raise _NotMatched(f"it reads {len(inputs)} values (expected query, key, value, decay and "
                          "beta)")
    query, key, value, beta, g = inputs     # the function reads beta before the decay
    outputs = [n for n in exits if example_value(n).shape == example_value(value).shape]
    states = [n for n in exits if n not in outputs]
    if len(outputs) != 1 or not all(_into_cache_only(n, members) for n in states):
        raise _NotMatched(f"{len(exits)} values leave it (expected its output, and the final "
                          "state at most into a cache)")
    exit_node = outputs[0]
    l2norm, error = _prove(region, inputs, exit_node)
    for state in states:    # the cache's state: for generation, which runs at hp=cp=1
        with graph.inserting_before(state):
            like = example_value(state)
            zeros = graph.call_function(torch.zeros, (tuple(like.shape),),
                                        {"dtype": like.dtype, "device": like.device})
        zeros.meta["example_value"] = like
        for use in [u for u in state.users if u not in members]:
            use.replace_input_with(state, zeros)
    with graph.inserting_before(exit_node):
        # the groups as keyword arguments ending in _group: the ranks' graph comparison leaves
        # their names out (they differ by rank)
        call = graph.call_function(gated_delta_rule, (query, key, value, g, beta, l2norm),
                                   {"hp": mesh.hp, "cp": mesh.cp, "hp_group": mesh.group_names["hp"],
                                    "cp_group": mesh.group_names["dkv_outer"]})
    call.meta.update({k: v for k, v in exit_node.meta.items()
                      if k in ("example_value", "stack_trace", "nn_module_stack", "source_fn_stack")})
    exit_node.replace_all_uses_with(call)
    for node in reversed(region):
        graph.erase_node(node)
    batch, tokens, heads, dv = example_value(value).shape
    dk = example_value(key).shape[-1]
    runs = max(len(r) for r in group_runs(tokens * mesh.hp * mesh.cp, 1, mesh.cp,
                                          [(c, 0) for c in range(mesh.cp)]))
    return {"module": module_path(call), "heads": heads, "head_dims": [dk, dv], "l2norm": l2norm,
            "proof_error": error, "cache_state": "zeros (the recurrent state a cache keeps is "
            "for generation, at hp=cp=1)" if states else None,
            "bytes_to_each_rank": state_bytes(batch, heads // mesh.hp, dk, dv, True, runs, 4)}


def _into_cache_only(state: torch.fx.Node, members: set) -> bool:
    """The final state leaves the region only to be copied into a cache's fresh buffer
    (transformers' ``update_recurrent_state``: ``zeros_like(state).copy_(state)``), which only
    the graph's outputs read."""
    for use in (u for u in state.users if u not in members):
        buffer = use if use.target is torch.zeros_like else (
            use.args[0] if use.op == "call_method" and use.target == "copy_" else None)
        if buffer is None or buffer.target is not torch.zeros_like or not all(
                u.op == "output" or (u.op == "call_method" and u.target == "copy_" and u.args[0] is buffer)
                or only_returned(u, u.graph) for u in buffer.users):
            return False
    return True


def _prove(region: list[torch.fx.Node], inputs: list[torch.fx.Node],
           exit_node: torch.fx.Node) -> tuple[bool, float]:
    """Run the region on random inputs of its shapes (float64) and find the reading of
    ``gated_delta_rule`` it computes: (l2norm, relative error)."""
    gen = torch.Generator().manual_seed(0)
    values = []
    for role, node in zip(("query", "key", "value", "beta", "g"), inputs):
        like = example_value(node)
        x = torch.randn(like.shape, generator=gen, dtype=torch.float64)
        values.append({"g": -x.abs(), "beta": x.sigmoid()}.get(role, x))
    query, key, value, beta, g = values
    with real_tensors(), torch.no_grad():
        env = dict(zip(inputs, values))
        for node in region:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = (getattr(args[0], node.target)(*args[1:], **kwargs)
                         if node.op == "call_method" else node.target(*args, **kwargs))
        got = env[exit_node]
        errors = {}
        for l2norm in (True, False):
            want = gated_delta_rule(query, key, value, g, beta, l2norm, 1, 1, "", "")
            if got.shape == want.shape:
                errors[l2norm] = float((got.double() - want.double()).norm() / want.double().norm())
    if not errors or min(errors.values()) > PROOF_TOLERANCE:
        raise _NotMatched(f"run on random inputs it is not the gated delta rule (relative error "
                          f"{min(errors.values(), default=float('inf')):.1e})")
    l2norm = min(errors, key=errors.get)
    return l2norm, errors[l2norm]
