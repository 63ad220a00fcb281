"""Mamba-2's selective scan (Falcon-H1, Bamba, NemotronH, Zamba2), on a rank's tokens, made exact.

Contract
--------
stage:    dynamo, after ``causal_conv`` and before ``token_locality``
applies:  when ``hp * cp > 1``; at ``hp = cp = 1`` where the graph has a positions input (the
          op then resets at each document start, as under hp·cp > 1: ``regions.ScanPass``)
requires: ``example_value`` and ``stack_trace`` on the Dynamo graph's nodes; uses
          ``position_inputs`` (the documents: ``passes/scans/documents.py``)
matches:  the nodes Dynamo traced inside one call of transformers' torch fallback
          ``mamba2_chunk_scan`` (chunked SSD over this rank's tokens), in the graph and its inline
          higher-order-op bodies: a region that reads seven tensors (in the order the function
          first reads them: dt_bias, dt, x, B, C, D, A) and whose one output leaves it.  The
          region is not trusted by its name: it is run at compile time on random inputs of its
          shapes in float64 and must equal ``ops.scans.gated_scan.mamba2_scan`` on one rank (with or
          without the softplus on dt, its clamp read from the region) within float32 round-off.
provides: ``scan_sites``: each matched region is ``ops.scans.gated_scan.mamba2_scan`` (the state
          exchanged between the sequence's ranks; under hp > 1 the heads split over the HP group)
refuses:  nothing itself: a region that does not match is left for ``token_locality``, which
          refuses it by name; the documents: several positions inputs (``LoongUnsupportedError``),
          and at run time rows in the balanced order or unreadable (``ops/scans/documents.py``)
reports:  each rewritten call (module, heads, head dim, state size, groups, the dt rule read), its
          proof error, the documents it resets at, and the bytes it sends to each other rank of its
          CP group per call
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from loong_compile.ops.scans.gated_scan import mamba2_scan, state_bytes
from loong_compile.passes.fx.module_paths import module_path
from loong_compile.passes.fx.nodes import example_value
from loong_compile.passes.scans.regions import (CACHE_STATE, FunctionRegionPass, NotMatched,
                                                best_reading, output_and_cached_states,
                                                random_values, region_inputs, replace_region,
                                                run_region, runs_per_rank, zero_cached_states)

FUNCTION = "mamba2_chunk_scan"
ROLES = ("dt_bias", "dt", "x", "B", "C", "D", "A")
# the same values in mamba2_scan's order
OP_ARGS = ("x", "dt", "A", "B", "C", "D", "dt_bias")


class Mamba2Pass(FunctionRegionPass):
    name = "mamba2"
    function = FUNCTION
    op = mamba2_scan

    def rewrite(self, graph: torch.fx.Graph, region: list[torch.fx.Node], mesh,
                documents: torch.fx.Node | None) -> dict[str, Any]:
        inputs = region_inputs(region)
        if len(inputs) != len(ROLES):
            raise NotMatched(f"it reads {len(inputs)} values (expected {', '.join(ROLES)})")
        role = dict(zip(ROLES, inputs))
        x = example_value(role["x"])
        if x.dim() != 4 or tuple(example_value(role["dt"]).shape) != tuple(x.shape[:3]):
            raise NotMatched(f"its x {tuple(x.shape)} and dt {tuple(example_value(role['dt']).shape)} "
                             "are not (B, T, H, P) and (B, T, H)")
        exit_node, states = output_and_cached_states(region, x.shape)
        dt_min, dt_max = _clamp(region)
        softplus, error = _prove(region, inputs, exit_node, dt_min, dt_max)
        zero_cached_states(graph, region, states)
        call = replace_region(graph, region, exit_node, mamba2_scan,
                              tuple(role[r] for r in OP_ARGS),
                              # the groups as keywords ending in _group: the ranks' graph comparison
                              # leaves their names out (they differ by rank)
                              {"dt_softplus": softplus, "dt_min": dt_min, "dt_max": dt_max,
                               "hp": mesh.hp, "cp": mesh.cp, "hp_group": mesh.group_names["hp"],
                               "cp_group": mesh.group_names["dkv_outer"], "documents": documents})
        batch, tokens, heads, head_dim = x.shape
        groups, state = example_value(role["B"]).shape[2:]
        runs = runs_per_rank(tokens, mesh)
        return {"module": module_path(call), "heads": heads, "head_dim": head_dim, "state": state,
                "groups": groups, "dt": {"softplus": softplus, "clamp": [dt_min, dt_max]},
                "proof_error": error, "cache_state": CACHE_STATE if states else None,
                "bytes_to_each_rank": state_bytes(batch, heads // mesh.hp, state, head_dim, False, runs, 4)}


def _clamp(region: list[torch.fx.Node]) -> tuple[float, float]:
    """The bounds of the region's one clamp of dt (transformers' ``dt_limit``), or none."""
    clamps = [n for n in region if n.target in (torch.clamp, torch.clip)
              or (n.op == "call_method" and n.target in ("clamp", "clip"))]
    if len(clamps) > 1:
        raise NotMatched(f"it clamps {len(clamps)} values (expected dt's, at most)")
    if not clamps:
        return -math.inf, math.inf
    bounds = clamps[0].args[1:] + (None, None)
    low, high = (clamps[0].kwargs.get(k, b) for k, b in zip(("min", "max"), bounds[:2]))
    if not all(v is None or isinstance(v, (int, float)) for v in (low, high)):
        raise NotMatched("it clamps dt to bounds that are tensors, not the constants of dt_limit")
    return (-math.inf if low is None else float(low)), (math.inf if high is None else float(high))


def _prove(region: list[torch.fx.Node], inputs: list[torch.fx.Node], exit_node: torch.fx.Node,
           dt_min: float, dt_max: float) -> tuple[bool, float]:
    """Run the region on random inputs of its shapes and dtypes and find the reading of
    ``mamba2_scan`` it computes: (softplus on dt, relative error)."""
    # a decay rate A < 0, a step dt > 0 either way (raw through softplus, or already one)
    values = random_values(inputs, ROLES, {"A": lambda x: -x.abs() - 0.1, "dt": lambda x: x.abs() * 0.5})
    got = run_region(region, {node: values[role] for role, node in zip(ROLES, inputs)}, exit_node)
    args = [values[r] for r in OP_ARGS]
    return best_reading(got, {
        softplus: lambda softplus=softplus: mamba2_scan(*args, softplus, dt_min, dt_max, 1, 1, "", "")
        for softplus in (True, False)}, "Mamba-2's scan")
