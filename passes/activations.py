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
left in ``ctx.state["activations"]`` (an ``ActivationPlan``) for ``recompute`` and
``offload``.  This module also holds the graph facts those passes share: which op is the
attention (``attention_ops``), which layer a node is in, view bases, and ``SavedValues``,
the editor of the forward/backward saved-value pairs.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from loong_compile import _compat
from loong_compile.estimate import alpha as alpha_lp
from loong_compile.passes.base import PassContext, SplitGraphs

aten = torch.ops.aten

CATEGORIES = ("input", "attention", "other")

# The attention ops: PyTorch's SDPA kernels (what a single process traces) and the
# 2D-Attention ring op.  Looked up by name, so a missing op (loong_compile.ops not
# imported, a kernel absent from this build) is simply not in the set.
ATTENTION_OP_NAMES = (
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "loong.ring_attention_fwd",
)


def attention_ops() -> frozenset:
    """The OpOverloadPackets that count as "the attention op" (forward, returning out and lse)."""
    found = []
    for name in ATTENTION_OP_NAMES:
        namespace, op = name.split(".")
        try:
            found.append(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


def is_attention(node: torch.fx.Node, ops: frozenset | None = None) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (
        attention_ops() if ops is None else ops)


def getitem_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The getitem nodes reading a multi-output op's results (the attention's out, lse, ...)."""
    return [u for u in node.users if u.target is operator.getitem]


# -- layers -----------------------------------------------------------------------------

# A module path component "<name>.<index>" or "<name>[<index>]": an element of a ModuleList.
_LAYER_PATH = re.compile(r"^(.*?[A-Za-z_]\w*)(?:\.|\[)(\d+)\]?(?=\.|\[|$)")


def layer_name(node: torch.fx.Node) -> str | None:
    """The transformer layer a forward node belongs to: the outermost ModuleList element on its
    ``nn_module_stack``, e.g. ``layers.0`` or ``model.layers.3``; None outside every layer."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ in stack.values():
        match = _LAYER_PATH.match(path)
        if match:
            prefix = re.sub(r"^L\['self'\]\.?", "", match.group(1))
            return f"{prefix}.{match.group(2)}"
    return None


def tangent_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes of a joint graph that depend on a tangent: the backward; all others are forward."""
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


@dataclasses.dataclass
class Layers:
    """The transformer layers of a forward (or joint) graph, in forward order."""

    names: list[str]
    node_layer: dict[torch.fx.Node, int]          # forward compute nodes inside a layer
    inputs: dict[int, list[torch.fx.Node]]        # each layer's input(s): the residual stream in
    attention: dict[int, list[torch.fx.Node]]     # each layer's attention op nodes
    leaving: set[torch.fx.Node]                   # layer values read by forward code outside every layer

    def layer_of(self, node: torch.fx.Node) -> int | None:
        return self.node_layer.get(node)


def find_layers(graph: torch.fx.Graph, is_forward: Callable[[torch.fx.Node], bool] = lambda n: True) -> Layers:
    """Layers from ``nn_module_stack`` (elements of a ModuleList or Sequential that hold an
    attention op); a layer's input is the value from outside the layer
    that has the shape and dtype of a value the layer hands on (a block maps the residual
    stream to one of the same shape), preferring one no other layer reads (RoPE tables are
    read by every layer)."""
    ops = attention_ops()
    named = {n: layer_name(n) for n in graph.nodes if n.op == "call_function" and is_forward(n)}
    # A transformer layer is a ModuleList / Sequential element with an attention op in it.
    with_attention = {name for n, name in named.items() if name is not None and is_attention(n, ops)}
    names = list(dict.fromkeys(name for name in named.values() if name in with_attention))
    index = {name: i for i, name in enumerate(names)}
    node_layer = {n: index[name] for n, name in named.items() if name in index}
    inputs: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    attention: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    leaving: set[torch.fx.Node] = set()
    external: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    handed_on: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(names))}
    readers: dict[torch.fx.Node, set[int]] = {}
    for node, i in node_layer.items():
        if is_attention(node, ops):
            attention[i].append(node)
        for a in node.all_input_nodes:
            if node_layer.get(a) != i:
                readers.setdefault(a, set()).add(i)
                if a not in external[i]:
                    external[i].append(a)
        # Readers in other modules of the forward; the backward's nodes (and forward-only
        # helpers the partition may move there) carry no nn_module_stack.
        outside = [u for u in node.users if u.meta.get("nn_module_stack") and is_forward(u)
                   and node_layer.get(u) != i]
        if outside:
            handed_on[i].append(node)
        if any(node_layer.get(u) is None for u in outside):
            leaving.add(node)
    for i in range(len(names)):
        shapes = {_signature(n) for n in handed_on[i]} - {None}
        candidates = [a for a in external[i] if _is_float(a) and _signature(a) in shapes]
        computed = [a for a in candidates if a.op != "placeholder"]   # not parameters
        candidates = computed or candidates
        if len(candidates) > 1:
            own = [a for a in candidates if readers.get(a) == {i}]
            candidates = own or candidates
        inputs[i] = candidates
    return Layers(names, node_layer, inputs, attention, leaving)


def _signature(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")   # sizes as text: symbolic ones (s0) are not hashable
    return (tuple(str(s) for s in val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


# -- views and bytes ----------------------------------------------------------------------

def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value shares its input's storage (``_unsafe_view`` does too)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0])
    target = node.target
    return target is aten._unsafe_view.default or bool(getattr(target, "is_view", False))


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node that owns ``node``'s storage (``node`` itself unless it is a view)."""
    while is_view(node):
        node = node.args[0].args[0] if node.target is operator.getitem else node.args[0]
    return node


def view_path(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The view nodes from ``base_of(node)`` (exclusive) to ``node`` (inclusive), in order."""
    path = []
    while is_view(node):
        path.append(node)
        if node.target is operator.getitem:
            path.append(node.args[0])
            node = node.args[0].args[0]
        else:
            node = node.args[0]
    return path[::-1]


def nbytes(node: torch.fx.Node) -> int:
    """Bytes of the storage behind ``node``'s value (for a symbolic size: at its example value,
    read without a guard, so a dimension marked dynamic stays dynamic)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return _compat.size_hint(val.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return _compat.size_hint(val.numel()) * val.element_size()


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one node from its fake values: matmuls via PyTorch's flop formulas, attention
    as 4·B·H·Sq·Sk·D (half of it when causal); everything else counts as 0."""
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
        return 0
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    if is_attention(node):
        q, k = vals[0], vals[1]
        named = node.normalized_arguments(None, normalize_to_only_use_kwargs=True)
        named = named.kwargs if named is not None else {}
        b, h, sq, d = q.shape
        # the ring op sees one KV chunk at a time; its queries meet all cp chunks
        flops = 4 * b * h * sq * k.shape[-2] * d * named.get("cp", 1)
        return flops // 2 if named.get("is_causal", False) else flops
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        return 0
    kwargs = {k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs.items()}
    try:
        return int(formula(*vals, out_val=node.meta.get("val"), **kwargs))
    except (TypeError, ValueError, AttributeError):
        return 0


def set_meta(node: torch.fx.Node) -> None:
    """Compute ``node.meta["val"]`` from its inputs' fake values (for nodes a pass adds)."""
    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    if node.target is operator.getitem:
        node.meta["val"] = args[0][args[1]]
        return
    fake_mode = _compat.fake_mode_of([a.meta.get("val") for a in node.all_input_nodes])
    if fake_mode is None:
        raise RuntimeError(f"no fake values on the inputs of {node.format_node()}")
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def insert_call(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None,
                name: str | None = None) -> torch.fx.Node:
    """Add a call at the graph's current insertion point, with its fake value."""
    node = graph.call_function(target, args, kwargs or {}, name=name)
    set_meta(node)
    return node


# -- the saved values: forward outputs paired with backward placeholders ------------------

class SavedValues:
    """Edit what the forward saves for the backward, keeping AOTAutograd's pairing: the
    forward's outputs after ``num_fwd_outputs`` are the backward's first placeholders, in the
    same order, tensors first and symbolic ints after."""

    def __init__(self, split: SplitGraphs, keep: set[torch.fx.Node] = frozenset()):
        self.keep = keep             # saved as they are even if they are views (token prefixes)
        self.fw, self.bw = split.forward.graph, split.backward.graph
        self.output = self.fw.find_nodes(op="output")[0]
        outs = list(self.output.args[0])
        self.user_outputs = outs[:split.num_fwd_outputs]
        saved = outs[split.num_fwd_outputs:]
        placeholders = list(self.bw.find_nodes(op="placeholder"))
        self.tensors: list[list[torch.fx.Node]] = []   # [forward node, backward placeholder]
        self.others: list[torch.fx.Node] = []          # symbolic values, kept as they are
        for fw_node, ph in zip(saved, placeholders):
            if isinstance(fw_node, torch.fx.Node) and isinstance(fw_node.meta.get("val"), torch.Tensor):
                self.tensors.append([fw_node, ph])
            else:
                self.others.append(fw_node)

    def __iter__(self):
        return iter([tuple(pair) for pair in self.tensors])

    def placeholder(self, fw_node: torch.fx.Node) -> torch.fx.Node | None:
        for node, ph in self.tensors:
            if node is fw_node:
                return ph
        return None

    def add(self, fw_node: torch.fx.Node) -> torch.fx.Node:
        """Save ``fw_node`` too (if it isn't yet); its backward placeholder."""
        existing = self.placeholder(fw_node)
        if existing is not None:
            return existing
        anchor = self.tensors[-1][1] if self.tensors else None
        if anchor is None:
            first = next(iter(self.bw.nodes))
            ctx = self.bw.inserting_before(first)
        else:
            ctx = self.bw.inserting_after(anchor)
        # A placeholder's target is its argument name in the generated code: keep it equal to
        # the node's name by choosing a name no node has (FX would rename only the node).
        taken = {n.name for n in self.bw.nodes}
        name = fw_node.name
        while name in taken:
            name += "_saved"
        with ctx:
            ph = self.bw.placeholder(name)
        ph.meta["val"] = fw_node.meta["val"]
        self.tensors.append([fw_node, ph])
        self._commit()
        return ph

    def replace(self, fw_old: torch.fx.Node, fw_new: torch.fx.Node) -> torch.fx.Node:
        """Save ``fw_new`` in ``fw_old``'s place; the same placeholder, with the new value."""
        for pair in self.tensors:
            if pair[0] is fw_old:
                pair[0] = fw_new
                pair[1].meta["val"] = fw_new.meta["val"]
                self._commit()
                return pair[1]
        raise KeyError(fw_old.name)

    def remove(self, fw_node: torch.fx.Node) -> None:
        """Stop saving ``fw_node``; its placeholder must have no users left."""
        for k, (node, ph) in enumerate(self.tensors):
            if node is fw_node:
                if ph.users:
                    raise RuntimeError(f"{ph.name} is still used by {list(ph.users)}")
                self.bw.erase_node(ph)
                del self.tensors[k]
                self._commit()
                return
        raise KeyError(fw_node.name)

    def rebase(self, base: torch.fx.Node) -> torch.fx.Node:
        """Save ``base`` alone instead of views of it: the backward rebuilds each view from the
        base's placeholder right before the view's first use.  Returns the base's placeholder."""
        views = [node for node, _ in self.tensors
                 if node is not base and node not in self.keep and base_of(node) is base]
        if not views and self.placeholder(base) is not None:
            return self.placeholder(base)
        base_ph = self.add(base)
        for view in views:
            ph = self.placeholder(view)
            users = list(ph.users)
            if users:
                with self.bw.inserting_before(first_in_order(self.bw, users)):
                    env = {base: base_ph}
                    for node in view_path(view):
                        env[node] = self.bw.node_copy(node, env.__getitem__)
                for user in users:
                    user.replace_input_with(ph, env[view])
            self.remove(view)
        return base_ph

    def _commit(self) -> None:
        saved = [node for node, _ in self.tensors] + self.others
        self.output.update_arg(0, tuple(self.user_outputs + saved))


def first_in_order(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    wanted = set(nodes)
    for node in graph.nodes:
        if node in wanted:
            return node
    raise ValueError("none of the nodes is in the graph")


def last_in_order(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    wanted, last = set(nodes), None
    for node in graph.nodes:
        if node in wanted:
            last = node
    if last is None:
        raise ValueError("none of the nodes is in the graph")
    return last


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

    def category(self, base: torch.fx.Node) -> tuple[int | None, str]:
        """(layer, category) of a storage, including ones the later passes save."""
        if base in self.owners:
            return self.owners[base]
        for v in self.values:
            if v.base is base:
                return v.layer, v.category
        if base.op in ("placeholder", "get_attr"):
            return None, "graph_input"
        return None, "outside"

    def table(self) -> list[dict[str, Any]]:
        """Per layer and category: count of saved values and bytes of their distinct storages."""
        rows = []
        for i, name in enumerate(self.layers.names):
            row: dict[str, Any] = {"layer": name}
            for cat in CATEGORIES:
                row[cat] = _count_bytes([v for v in self.values if v.layer == i and v.category == cat])
            row["total_bytes"] = sum(row[c]["bytes"] for c in CATEGORIES)
            rows.append(row)
        return rows


def _count_bytes(values: list[SavedValue]) -> dict[str, Any]:
    bases = {v.base for v in values}
    return {"count": len(values), "bytes": sum(nbytes(b) for b in bases),
            "values": [v.node.name for v in values]}


def classify(split: SplitGraphs) -> ActivationPlan:
    fw = split.forward.graph
    layers = find_layers(fw)
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


def layer_flops(plan: ActivationPlan, layer: int) -> int:
    return sum(node_flops(n) for n, i in plan.layers.node_layer.items() if i == layer)


def decide_alpha(plan: ActivationPlan, config: Any) -> None:
    """MEMO's alpha for the swapped layers (all but the last ``resident_layers``)."""
    n = len(plan.layers.names)
    plan.swapped = list(range(max(n - config.resident_layers, 0)))
    sizes = {cat: 0 for cat in CATEGORIES}
    table = plan.table()
    for i in plan.swapped:   # layers are alike; size the LP for the largest
        row = table[i]
        for cat in CATEGORIES:
            sizes[cat] = max(sizes[cat], row[cat]["bytes"])
    device, dtype = _device_and_dtype(plan)
    flops = max((layer_flops(plan, i) for i in range(n)), default=0)
    with _compat.real_tensors():   # the partitioner runs under fake mode: measure for real
        bandwidth = (alpha_lp.measure_host_bandwidth(device) if config.host_bandwidth == "auto"
                     else float(config.host_bandwidth))
        host_memory = (alpha_lp.available_host_memory() if config.host_memory == "auto"
                       else float(config.host_memory))
        layer_time = (flops / alpha_lp.measure_matmul_rate(device, dtype) if config.layer_time == "auto"
                      else float(config.layer_time))
        bandwidth, host_memory, layer_time = alpha_lp.agree_min([bandwidth, host_memory, layer_time])
    inputs = alpha_lp.AlphaInputs(sizes["input"], sizes["attention"], sizes["other"], n,
                                  config.resident_layers, bandwidth, max(layer_time, 1e-12), host_memory)
    if config.alpha == "auto":
        decision = alpha_lp.solve_alpha(inputs, config.solver_time_limit)
    else:
        decision = alpha_lp.evaluate_alpha(inputs, float(config.alpha))
    plan.decision = decision
    plan.lp_inputs = dataclasses.asdict(inputs) | {"layer_flops": flops,
                                                   "measured": [k for k in ("host_bandwidth", "host_memory", "layer_time")
                                                                if getattr(config, k) == "auto"]}
    plan.offload = decision.feasible or config.alpha != "auto"
    plan.alpha = decision.alpha if plan.offload else 0.0


def _device_and_dtype(plan: ActivationPlan) -> tuple[torch.device, torch.dtype]:
    for v in plan.values:
        if v.category in CATEGORIES:
            val = v.base.meta["val"]
            return val.device, (val.dtype if val.is_floating_point() else torch.float32)
    return torch.device("cpu"), torch.float32


class FollowsActivationPlan:
    """Base of the ``memo`` passes that act on the plan ``ActivationsPass`` left in ``ctx.state``."""

    stage = "split"
    NO_PLAN = {"matched": 0,
               "skipped": "no activation plan (the activations pass did not run or found no layer)"}

    def enabled(self, config: Any) -> bool:
        return config.activations == "memo"

    @staticmethod
    def plan_of(ctx: PassContext) -> ActivationPlan | None:
        plan: ActivationPlan | None = ctx.state.get("activations")
        return plan if plan is not None and plan.layers.names else None


class ActivationsPass:
    """Classify the saved values (all policies); under ``memo`` also choose alpha."""

    name, stage = "activations", "split"

    def enabled(self, config: Any) -> bool:
        return True

    def run(self, split: SplitGraphs, ctx: PassContext) -> dict[str, Any]:
        plan = classify(split)
        ctx.state["activations"] = plan
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
        if ctx.config.activations == "memo":
            if not plan.layers.names:
                summary["fallback"] = ("no transformer layer (nn_module_stack 'name.N') in the graph: "
                                       "nothing is offloaded or recomputed")
                return summary
            if any(not isinstance(s, int) for v in plan.values for s in v.base.meta["val"].shape):
                summary["fallback"] = ("symbolic shapes (dynamic=True / mark_dynamic): memo needs a static "
                                       "sequence length; nothing is offloaded or recomputed")
                return summary
            decide_alpha(plan, ctx.config)
            summary["alpha"] = plan.alpha
            summary["lp"] = {"inputs": plan.lp_inputs, "decision": plan.decision.to_dict()}
            summary["swapped_layers"] = [plan.layers.names[i] for i in plan.swapped]
            if not plan.offload:
                summary["fallback"] = plan.decision.message
        return summary
