"""Offload and prefetch (MEMO §4.1): the saved values of every swapped layer go to host memory
in the forward and come back in the backward.

Stage ``split``, policies ``memo`` and ``full_offload``; runs after ``activations`` and ``recompute``.

Matches: the saved values of the swapped layers (all but the last ``resident_layers``): layer
inputs, attention outputs (out, lse) and what ``recompute`` left of the "other" tensors (their
``[0, a)`` token prefixes, or whole tensors it could not recompute).  Views saved of one
storage are rebased so the storage travels once.

Emits, with the ops of ``loong_compile.ops.offload``:

- forward: ``h = loong.offload(x)`` right after ``x``'s last forward use, and
  ``loong.wait_tensor(h, keepalive=x, after=m, layer=i)`` before the forward of layer ``i + 2`` (MEMO:
  the copy of layer ``i`` overlaps layer ``i + 1``); the wait's result (the host tensor) is
  what is saved.
  ``keepalive`` keeps ``x`` alive until its copy has finished, so no memory an in-flight copy
  reads is reused; nothing is freed by the op itself.
- backward: ``y = loong.reload(h, device, after=m)`` where the backward of layer ``i + 1``
  starts (the prefetch overlaps it; for the top layer, where the backward graph starts),
  ``loong.wait_tensor(y, keepalive=h, after=m, layer=i)`` right before the first use.

``after=m`` is a data dependency that pins the op in any order Inductor's scheduler picks:
``m`` is the last matmul (the last node with FLOPs, a buffer Inductor materialises anyway)
before the op's place in the FX graph: for a forward wait, layer ``i + 1``'s last; for a
prefetch, the last of the layer whose backward precedes layer ``i + 1``'s; for a backward
wait, the last before the first use.  None where no such node follows the copy's start (then
nothing could run between them anyway).  Dependencies, not a post-scheduling pass: they hold
through every Inductor reordering (peak memory, comms) and in every lowering, and they
cost nothing at run time (``after`` is never read).  A dependency says "not before", never
"not after": Inductor's peak-memory order can still issue some of a layer's prefetches
after the layer's backward has begun: the schedule stage's ``prefetch_order`` closes that on
Inductor's scheduler nodes (a layer's reloads, one ``after``, issued together, each of their
waits held after all of them).

Nodes holding a swapped layer's skeletal tensors (forward) and their reloads (backward) carry
``meta["loong_rounding_buffer"] = layer % 2``: MEMO's two rounding buffers, for a memory plan
to place.  Summary, per layer: bytes kept on device, offloaded to host, and recomputed (from
``recompute``), with totals; the rows of ``recompute`` are read through its fact ``recomputed_layers``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from loong_compile.ops.offload import OFFLOAD, RELOAD, WAIT
from loong_compile.parallel.rules import CATEGORIES
from loong_compile.passes.activations.classify import ActivationPlan, FollowsActivationPlan
from loong_compile.passes.fx.aten_ops import node_flops
from loong_compile.passes.fx.emit import insert_call
from loong_compile.passes.fx.storage import base_of, is_view, nbytes
from loong_compile.passes.fx.walks import first_in_order, last_in_order
from loong_compile.passes.activations.layers import layer_name
from loong_compile.passes.activations.recompute import RECOMPUTED_LAYERS
from loong_compile.passes.activations.saved_values import SavedValues
from loong_compile.passes.base import PassContext, SplitGraphs

Node = torch.fx.Node
ROUNDING_BUFFER = "loong_rounding_buffer"   # meta key: 0 (even layers) or 1 (odd layers)


def forward_uses(node: Node) -> list[Node]:
    """Forward nodes that read ``node``'s storage: its users, through views."""
    uses, stack = [], [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":
                continue
            uses.append(user)
            if is_view(user):
                stack.append(user)
    return uses


def _compute_before(node: Node, start: Node | None = None) -> Node | None:
    """The last tensor-valued node with FLOPs before ``node`` (and after ``start``), or None."""
    cursor = node.prev
    while cursor.op != "root" and cursor is not start:
        if (cursor.op == "call_function" and cursor.target not in (OFFLOAD, RELOAD, WAIT)
                and isinstance(cursor.meta.get("val"), torch.Tensor) and node_flops(cursor) > 0):
            return cursor
        cursor = cursor.prev
    return None


def _insert_wait(graph: torch.fx.Graph, args: tuple, name: str) -> Node:
    """A ``wait_tensor`` call: it returns its first argument, so its fake value is that one's
    (no fake dispatch, one of the pass's costs that grow with depth)."""
    node = graph.call_function(WAIT, args, name=name)
    node.meta["val"] = args[0].meta["val"]
    return node


class OffloadPass(FollowsActivationPlan):
    name = "offload"
    uses = (RECOMPUTED_LAYERS,)    # per-layer recompute rows, for the report

    def run(self, split: SplitGraphs, ctx: PassContext) -> dict[str, Any]:
        plan = self.plan_of(ctx)
        if plan is None:
            return dict(self.NO_PLAN)
        saved = SavedValues(split, keep=plan.prefixes)
        units = self._units(plan, saved) if plan.offload else {}
        for unit in units:
            if unit not in plan.prefixes:
                saved.rebase(unit)
        bw_starts = self._backward_starts(plan, saved.bw)
        fw_starts = self._forward_starts(plan, saved.fw)
        for unit, layer in units.items():
            ph = saved.placeholder(unit)
            # MEMO's rounding buffers: layer i's skeletal tensors (as produced in the forward,
            # as reloaded in the backward) belong to staging buffer i % 2; a memory plan can
            # give them static offsets there.
            unit.meta[ROUNDING_BUFFER] = layer % 2
            self._offload(saved, unit, layer, fw_starts.get(layer + 2))
            if ph.users:
                self._reload(saved.bw, ph, layer, unit.meta["val"].device, bw_starts.get(layer + 1)
                             ).meta[ROUNDING_BUFFER] = layer % 2
        split.forward.graph.lint()
        split.backward.graph.lint()
        summary = self._summary(plan, saved, ctx.state.get(RECOMPUTED_LAYERS, {}))
        summary["matched"] = len(units)
        if not plan.offload and plan.decision is not None:
            summary["skipped"] = plan.decision.message
        return summary

    @staticmethod
    def _units(plan: ActivationPlan, saved: SavedValues) -> dict[Node, int]:
        """What travels, and its layer: a base storage, or a token prefix as it is."""
        units: dict[Node, int] = {}
        swapped = set(plan.swapped)
        for node, _ in saved:
            unit = node if node in plan.prefixes else base_of(node)
            layer, category = plan.category(unit)
            if layer in swapped and category in CATEGORIES:
                units.setdefault(unit, layer)
        return units

    @staticmethod
    def _forward_starts(plan: ActivationPlan, fw: torch.fx.Graph) -> dict[int, Node]:
        starts: dict[int, Node] = {}
        for node in fw.nodes:
            layer = plan.layers.layer_of(node)
            if layer is not None and layer not in starts:
                starts[layer] = node
        return starts

    @staticmethod
    def _backward_starts(plan: ActivationPlan, bw: torch.fx.Graph) -> dict[int, Node]:
        """The first backward node of each layer: by autograd's seq_nr (gradient nodes) or by
        nn_module_stack (forward nodes recomputed there)."""
        names = {name: i for i, name in enumerate(plan.layers.names)}
        starts: dict[int, Node] = {}
        for node in bw.nodes:
            if node.op != "call_function":
                continue
            layer = names.get(layer_name(node)) if node.meta.get("nn_module_stack") else None
            if layer is None:
                layer = plan.seq_layer.get(node.meta.get("seq_nr"))
            if layer is not None and layer not in starts:
                starts[layer] = node
        return starts

    @staticmethod
    def _offload(saved: SavedValues, unit: Node, layer: int, next_next_layer: Node | None) -> None:
        fw = saved.fw
        uses = forward_uses(unit)
        last = last_in_order(uses) if uses else unit
        with fw.inserting_before(last.next):
            host = insert_call(fw, OFFLOAD, (unit,), name=f"offload_{unit.name}")
        anchor = next_next_layer if next_next_layer is not None and next_next_layer > host \
            else saved.output
        with fw.inserting_before(anchor):
            waited = _insert_wait(fw, (host, unit, _compute_before(anchor, host), layer),
                                  name=f"wait_{host.name}")
        saved.replace(unit, waited)

    @staticmethod
    def _reload(bw: torch.fx.Graph, ph: Node, layer: int, device: torch.device,
                layer_above: Node | None) -> Node:
        users = list(ph.users)
        first = first_in_order(users)
        if layer_above is not None and layer_above < first:
            start, after = layer_above, _compute_before(layer_above)
        else:   # no layer above: the backward of what follows the layers (the head) overlaps it
            start, after = next(n for n in bw.nodes if n.op == "call_function"), None
        with bw.inserting_before(start):
            back = insert_call(bw, RELOAD, (ph, device, after), name=f"reload_{ph.name}")
        with bw.inserting_before(first):
            ready = _insert_wait(bw, (back, ph, _compute_before(first, back), layer),
                                 name=f"wait_{back.name}")
        for user in users:
            user.replace_input_with(ph, ready)
        return back

    @staticmethod
    def _summary(plan: ActivationPlan, saved: SavedValues, recompute: dict[str, dict]) -> dict[str, Any]:
        device: dict[int | None, dict[Node, int]] = {}     # layer -> {storage: bytes}
        host: dict[int | None, int] = {}
        for node, _ in saved:
            if node.target is WAIT:                          # a host copy: its own bytes
                unit = node.args[1]
                layer = plan.category(unit if unit in plan.prefixes else base_of(unit))[0]
                host[layer] = host.get(layer, 0) + nbytes(node)
                continue
            layer, category = plan.category(base_of(node))
            if category != "graph_input":                    # parameters and inputs are the caller's
                device.setdefault(layer, {})[base_of(node)] = nbytes(base_of(node))
        rows = [{"layer": name, "device_bytes": sum(device.get(i, {}).values()),
                 "offloaded_bytes": host.get(i, 0),
                 "recomputed_bytes": recompute.get(name, {}).get("recomputed_bytes", 0),
                 "swapped": i in plan.swapped} for i, name in enumerate(plan.layers.names)]
        outside = sum(device.get(None, {}).values())
        return {"alpha": plan.alpha, "layers": rows, "outside_device_bytes": outside,
                "device_bytes": sum(r["device_bytes"] for r in rows) + outside,
                "host_bytes": sum(r["offloaded_bytes"] for r in rows),
                "recomputed_bytes": sum(r["recomputed_bytes"] for r in rows)}
