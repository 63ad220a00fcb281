"""Gated DeltaNet's recurrence (Qwen3-Next, Qwen3.5), on a rank's tokens, made exact.

Contract
--------
stage:    dynamo, after ``causal_conv`` and before ``token_locality``
applies:  when ``hp * cp > 1``; at ``hp = cp = 1`` where the graph has a positions input (the
          op then resets at each document start, as under hp·cp > 1: ``regions.ScanPass``)
requires: ``example_value`` and ``stack_trace`` on the Dynamo graph's nodes; uses
          ``position_inputs`` (the documents: ``passes/scans/documents.py``)
matches:  the nodes Dynamo traced inside one call of transformers' torch fallback
          ``torch_chunk_gated_delta_rule`` (its chunk loop unrolled over this rank's tokens),
          in the graph and its inline higher-order-op bodies: a region whose inputs are five
          tensors (query, key, value, log-decay, beta, in the order the function first reads
          them) and whose one output leaves it.  The region is not trusted by its name: it is
          run at compile time on random inputs of its shapes in float64 and must equal
          ``ops.scans.gated_scan.gated_delta_rule`` on one rank (with or without the queries' and
          keys' l2 norm: whichever agrees) within float32 round-off.
provides: ``scan_sites``: each matched region is ``ops.scans.gated_scan.gated_delta_rule`` (the state
          exchanged between the sequence's ranks; under hp > 1 the heads split over the HP group)
refuses:  nothing itself: a region that does not match is left for ``token_locality``, which
          refuses it by name; the documents: several positions inputs (``LoongUnsupportedError``),
          and at run time rows in the balanced order or unreadable (``ops/scans/documents.py``)
reports:  each rewritten call (module, heads, head dims, whether it l2-normalises), its proof
          error, the documents it resets at, and the bytes it sends to each other rank of its CP
          group per call
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.ops.scans.gated_scan import gated_delta_rule, state_bytes
from loong_compile.passes.fx.module_paths import module_path
from loong_compile.passes.fx.nodes import example_value
from loong_compile.passes.scans.regions import (CACHE_STATE, FunctionRegionPass, NotMatched,
                                                best_reading, output_and_cached_states,
                                                random_values, region_inputs, replace_region,
                                                run_region, runs_per_rank, zero_cached_states)

FUNCTION = "torch_chunk_gated_delta_rule"


class GatedDeltaPass(FunctionRegionPass):
    name = "gated_delta"
    function = FUNCTION
    op = gated_delta_rule

    def rewrite(self, graph: torch.fx.Graph, region: list[torch.fx.Node], mesh,
                documents: torch.fx.Node | None) -> dict[str, Any]:
        inputs = region_inputs(region)
        if len(inputs) != 5:
            raise NotMatched(f"it reads {len(inputs)} values (expected query, key, value, decay and "
                              "beta)")
        query, key, value, beta, g = inputs     # the function reads beta before the decay
        exit_node, states = output_and_cached_states(region, example_value(value).shape)
        l2norm, error = _prove(region, inputs, exit_node)
        zero_cached_states(graph, region, states)
        # the groups as keyword arguments ending in _group: the ranks' graph comparison leaves their
        # names out (they differ by rank)
        call = replace_region(graph, region, exit_node, gated_delta_rule,
                              (query, key, value, g, beta, l2norm),
                              {"hp": mesh.hp, "cp": mesh.cp, "hp_group": mesh.group_names["hp"],
                               "cp_group": mesh.group_names["dkv_outer"], "documents": documents})
        batch, tokens, heads, dv = example_value(value).shape
        dk = example_value(key).shape[-1]
        runs = runs_per_rank(tokens, mesh)
        return {"module": module_path(call), "heads": heads, "head_dims": [dk, dv], "l2norm": l2norm,
                "proof_error": error, "cache_state": CACHE_STATE if states else None,
                "bytes_to_each_rank": state_bytes(batch, heads // mesh.hp, dk, dv, True, runs, 4)}


def _prove(region: list[torch.fx.Node], inputs: list[torch.fx.Node],
           exit_node: torch.fx.Node) -> tuple[bool, float]:
    """Run the region on random inputs of its shapes and dtypes and find the reading of
    ``gated_delta_rule`` it computes: (l2norm, relative error)."""
    roles = ("query", "key", "value", "beta", "g")
    values = random_values(inputs, roles, {"g": lambda x: -x.abs(), "beta": torch.sigmoid})
    query, key, value, beta, g = (values[r] for r in roles)
    got = run_region(region, {node: values[r] for r, node in zip(roles, inputs)}, exit_node)
    return best_reading(got, {
        l2norm: lambda l2norm=l2norm: gated_delta_rule(query, key, value, g, beta, l2norm, 1, 1, "", "")
        for l2norm in (True, False)}, "the gated delta rule")
