"""Activation classification (MEMO §3): every value saved for the backward, by transformer
layer and category, and MEMO's alpha for the ``memo`` policy.

Stage ``split`` (right after the partition, both graphs in hand), every policy.

Matches: the saved values of ``SplitGraphs``.  Each is traced through view ops (view,
transpose, detach, split, ...) to its *base*, the node that owns the storage, so a tensor
saved twice as two views is counted once.  Layer membership comes from the base's
``nn_module_stack`` (``layers.N``, ``model.layers.N``, ...).  Categories, per MEMO:

- ``input``: the layer's input (the residual stream entering it),
- ``attention``: the attention op's outputs (out, lse, ...),
- ``other``: every other skeletal tensor of the layer;

besides the layers: ``outside`` (computed outside every layer: embeddings' helpers, the
final norm, RoPE tables) and ``graph_input`` (parameters and user inputs, owned by the caller).

Emits: nothing in the graphs.  The summary gives count and exact bytes per layer and
category; under ``memo`` also the LP's inputs and the chosen alpha.  The classification is
left in ``ctx.state[ACTIVATION_PLAN]`` (an ``ActivationPlan``) for ``recompute`` and
``offload``.  The graph facts those passes share: ``passes/fx`` (attention ops, views, bytes,
FLOPs) and, beside it, ``layers`` (layer discovery) and ``saved_values`` (``SavedValues``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from loong_compile._compat.aot import real_tensors
from loong_compile.estimate import alpha as alpha_lp
from loong_compile.parallel.rules import CATEGORIES, OFFLOADING_POLICIES
from loong_compile.passes.activations.measure import (
    agree_min, available_host_memory, measure_host_bandwidth, measure_matmul_rate,
)
from loong_compile.passes.base import Pass, PassContext, SplitGraphs
from loong_compile.passes.fx.aten_ops import node_flops
from loong_compile.passes.fx.nodes import getitem_users
from loong_compile.passes.fx.storage import base_of, nbytes
from loong_compile.passes.activations.layers import Layers, find_layers
from loong_compile.passes.activations.saved_values import SavedValues

# The fact this pass provides: the ``ActivationPlan`` of the graphs, in ``ctx.state``.
ACTIVATION_PLAN = "activation_plan"


# -- the classification --------------------------------------------------------------------

@dataclasses.dataclass
class SavedValue:
    node: torch.fx.Node       # the forward node saved
    base: torch.fx.Node       # the node owning its storage
    layer: int | None
    category: str             # input | attention | other | outside | graph_input


@dataclasses.dataclass
class ActivationPlan:
    """What ``activations`` found and decided, for the passes after it."""

    layers: Layers
    values: list[SavedValue]
    seq_layer: dict[int, int]                   # autograd seq_nr -> layer (places backward nodes)
    alpha: float = 1.0
    decision: alpha_lp.AlphaDecision | None = None
    swapped: list[int] = dataclasses.field(default_factory=list)   # layers offloaded / sliced
    offload: bool = False                       # False: infeasible budget -> full recompute only
    lp_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Saved values the later passes create: token prefixes (a slice view that must be saved
    # as it is, not rebased onto the tensor it slices) and their (layer, category).
    prefixes: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    owners: dict[torch.fx.Node, tuple[int | None, str]] = dataclasses.field(default_factory=dict)
    _by_base: dict[torch.fx.Node, tuple[int | None, str]] = dataclasses.field(
        default_factory=dict, init=False, repr=False)

    def category(self, base: torch.fx.Node) -> tuple[int | None, str]:
        """(layer, category) of a storage, including ones the later passes save."""
        if base in self.owners:
            return self.owners[base]
        if not self._by_base:   # the first saved value of each storage, as a scan would find it
            # a block's input is a graph input the partition may not save (no backward op
            # reads it); ``recompute`` saves it to recompute from, the layer's like any input
            for i, nodes in self.layers.inputs.items():
                self._by_base.update(dict.fromkeys(nodes, (i, "input")))
            for v in reversed(self.values):
                self._by_base[v.base] = (v.layer, v.category)
        if base in self._by_base:
            return self._by_base[base]
        if base.op in ("placeholder", "get_attr"):
            return None, "graph_input"
        return None, "outside"

    def table(self) -> list[dict[str, Any]]:
        """Per layer and category: count of saved values and bytes of their distinct storages."""
        grouped: dict[tuple[int | None, str], list[SavedValue]] = {}
        for v in self.values:
            grouped.setdefault((v.layer, v.category), []).append(v)
        rows = []
        for i, name in enumerate(self.layers.names):
            row: dict[str, Any] = {"layer": name}
            for cat in CATEGORIES:
                row[cat] = _count_bytes(grouped.get((i, cat), []))
            row["total_bytes"] = sum(row[c]["bytes"] for c in CATEGORIES)
            rows.append(row)
        return rows


def _count_bytes(values: list[SavedValue]) -> dict[str, Any]:
    bases = {v.base for v in values}
    return {"count": len(values), "bytes": sum(nbytes(b) for b in bases),
            "values": [v.node.name for v in values]}


def classify(split: SplitGraphs) -> ActivationPlan:
    fw = split.forward.graph
    layers = find_layers(fw, returned=fw.output_node().args[0][:split.num_fwd_outputs])
    input_layer = {base_of(n): i for i, ns in layers.inputs.items() for n in ns}
    attention_layer = {out: i for i, nodes in layers.attention.items() for att in nodes
                       for out in getitem_users(att)}
    values = []
    for node, _ in SavedValues(split):
        base = base_of(node)
        if base in input_layer:
            layer, cat = input_layer[base], "input"
        elif base in attention_layer:
            layer, cat = attention_layer[base], "attention"
        elif base.op in ("placeholder", "get_attr"):
            layer, cat = None, "graph_input"
        elif layers.layer_of(base) is not None:
            layer, cat = layers.layer_of(base), "other"
        else:
            layer, cat = None, "outside"
        values.append(SavedValue(node, base, layer, cat))
    seq_layer = {n.meta["seq_nr"]: i for n, i in layers.node_layer.items() if "seq_nr" in n.meta}
    return ActivationPlan(layers, values, seq_layer)


def layer_flops(plan: ActivationPlan) -> dict[int, int]:
    """FLOPs per layer, in one walk over the layers' nodes."""
    flops: dict[int, int] = {}
    for node, layer in plan.layers.node_layer.items():
        flops[layer] = flops.get(layer, 0) + node_flops(node)
    return flops


def decide_alpha(plan: ActivationPlan, config: Any, alpha: float | str) -> None:
    """MEMO's alpha for the swapped layers (all but the last ``resident_layers``); ``alpha``:
    a fraction, or ``"auto"`` for MEMO's LP."""
    n = len(plan.layers.names)
    # a block compiled on its own is every block: none can stay resident
    resident = 0 if plan.layers.one_block else config.resident_layers
    plan.swapped = list(range(max(n - resident, 0)))
    sizes = {cat: 0 for cat in CATEGORIES}
    table = plan.table()
    for i in plan.swapped:   # layers are alike; size the LP for the largest
        row = table[i]
        for cat in CATEGORIES:
            sizes[cat] = max(sizes[cat], row[cat]["bytes"])
    device, dtype = _device_and_dtype(plan)
    flops = max(layer_flops(plan).values(), default=0)
    with real_tensors():   # the partitioner runs under fake mode: measure for real
        bandwidth = (measure_host_bandwidth(device) if config.host_bandwidth == "auto"
                     else float(config.host_bandwidth))
        host_memory = (available_host_memory() if config.host_memory == "auto"
                       else float(config.host_memory))
        layer_time = (flops / measure_matmul_rate(device, dtype) if config.layer_time == "auto"
                      else float(config.layer_time))
        bandwidth, host_memory, layer_time = agree_min([bandwidth, host_memory, layer_time])
    inputs = alpha_lp.AlphaInputs(sizes["input"], sizes["attention"], sizes["other"], n,
                                  resident, bandwidth, max(layer_time, 1e-12), host_memory)
    if alpha == "auto":
        decision = alpha_lp.solve_alpha(inputs, config.solver_time_limit)
    else:
        decision = alpha_lp.evaluate_alpha(inputs, float(alpha))
    plan.decision = decision
    plan.lp_inputs = dataclasses.asdict(inputs) | {"layer_flops": flops,
                                                   "measured": [k for k in ("host_bandwidth", "host_memory", "layer_time")
                                                                if getattr(config, k) == "auto"]}
    plan.offload = decision.feasible or alpha != "auto"
    plan.alpha = decision.alpha if plan.offload else 0.0


def _device_and_dtype(plan: ActivationPlan) -> tuple[torch.device, torch.dtype]:
    for v in plan.values:
        if v.category in CATEGORIES:
            val = v.base.meta["val"]
            return val.device, (val.dtype if val.is_floating_point() else torch.float32)
    return torch.device("cpu"), torch.float32


class FollowsActivationPlan(Pass):
    """Base of the ``memo`` passes that act on the plan ``ActivationsPass`` left in ``ctx.state``."""

    stage = "split"
    requires = (ACTIVATION_PLAN,)
    NO_PLAN = {"matched": 0, "skipped": "no activation plan (the activations pass found no layer)"}

    def enabled(self, config: Any) -> bool:
        return config.activations in OFFLOADING_POLICIES

    @staticmethod
    def plan_of(ctx: PassContext) -> ActivationPlan | None:
        plan: ActivationPlan | None = ctx.state.get(ACTIVATION_PLAN)
        return plan if plan is not None and plan.layers.names else None


class ActivationsPass(Pass):
    """Classify the saved values (all policies); under ``memo`` also choose alpha."""

    name, stage = "activations", "split"
    provides = (ACTIVATION_PLAN,)

    def run(self, split: SplitGraphs, ctx: PassContext) -> dict[str, Any]:
        plan = classify(split)
        ctx.state[ACTIVATION_PLAN] = plan
        outside = [v for v in plan.values if v.category == "outside"]
        inputs = [v for v in plan.values if v.category == "graph_input"]
        summary: dict[str, Any] = {
            "policy": ctx.config.activations,
            "matched": len(plan.values),
            "layers": plan.table(),
            "outside": _count_bytes(outside),
            "graph_inputs": _count_bytes(inputs),
            "activation_bytes": sum(r["total_bytes"] for r in plan.table()) + _count_bytes(outside)["bytes"],
        }
        missing = [plan.layers.names[i] for i, ns in plan.layers.inputs.items() if len(ns) != 1]
        if missing:
            summary["unclassified"] = f"no single layer input found for {', '.join(missing)}"
        if ctx.config.activations in OFFLOADING_POLICIES:
            if not plan.layers.names:
                summary["fallback"] = ("no transformer layer (nn_module_stack 'name.N') in the graph: "
                                       "nothing is offloaded or recomputed")
                return summary
            if any(not isinstance(s, int) for v in plan.values for s in v.base.meta["val"].shape):
                summary["fallback"] = ("symbolic shapes (dynamic=True / mark_dynamic): memo needs a static "
                                       "sequence length; nothing is offloaded or recomputed")
                return summary
            # full_offload: a layer saves its input alone, which is offloaded whole
            decide_alpha(plan, ctx.config, 0.0 if ctx.config.activations == "full_offload" else ctx.config.alpha)
            summary["alpha"] = plan.alpha
            summary["lp"] = {"inputs": plan.lp_inputs, "decision": plan.decision.to_dict()}
            summary["swapped_layers"] = [plan.layers.names[i] for i in plan.swapped]
            if not plan.offload:
                summary["fallback"] = plan.decision.message
        return summary
