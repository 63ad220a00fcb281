"""A layer's prefetches issued together, before its backward reads any of them.

``offload`` puts each reload of a layer after the same compute (the layer above's backward
begins), but a dependency can say "not before", never "not after": Inductor's peak-memory
order can move some reloads of a layer down, past the first wait of that layer, and the
backward then stalls on a copy that started late.  On Inductor's scheduler nodes before
fusion, the reloads of one layer (those sharing one ``after=`` input) are moved up to the
first of them, and each of their waits is held after all of them by an ordering-only
dependency.

Stage ``schedule``, under ``activations="memo"`` or ``"full_offload"``.  Report: the layers whose prefetches were
grouped, the reloads moved and the waits held.
"""

from __future__ import annotations

from typing import Any

from loong_compile.passes.base import Pass, PassContext, ScheduleRequest
from loong_compile.parallel.rules import OFFLOADING_POLICIES


def hold_prefetches(items: list[tuple[str, str, str, tuple[int, ...]]],
                    order: list[int]) -> tuple[list[int], list[tuple[int, int]], dict[str, int]]:
    """On Inductor's scheduler nodes (``ScheduleItem``s, in ``order``):
    the reloads that share their inputs (one layer's prefetch) moved up to the first of them,
    and holds ``(wait, reload)``: each reload's wait runs after every reload of its layer.  A
    node that reads a reload and nothing else is its output handle (Inductor's ``MultiOutput``
    on some versions): a wait reading it waits for that reload."""
    layers: dict[tuple[int, ...], list[int]] = {}
    reload_of: dict[int, int] = {}
    for i, (_, _, op, inputs) in enumerate(items):
        if op == "loong.reload":
            layers.setdefault(inputs, []).append(i)
            reload_of[i] = i
        elif op == "" and len(inputs) == 1 and inputs[0] in reload_of:
            reload_of[i] = reload_of[inputs[0]]
    position = {node: p for p, node in enumerate(order)}
    layer_of, follow = {}, {}       # reload -> its layer's key; first reload -> the others
    for key, reloads in layers.items():
        reloads.sort(key=position.__getitem__)
        layer_of.update(dict.fromkeys(reloads, key))
        follow[reloads[0]] = reloads[1:]
    moved = sum(position[r] != position[reloads[0]] + k
                for reloads in layers.values() for k, r in enumerate(reloads))
    # one pass over the order and one over the nodes, so it stays linear in depth
    moving = {r for rest in follow.values() for r in rest}
    order = [m for n in order if n not in moving for m in (n, *follow.get(n, ()))]
    held: dict[tuple[int, ...], list[tuple[int, int]]] = {key: [] for key in layers}
    for w, (_, _, op, inputs) in enumerate(items):
        if op != "loong.wait_tensor":
            continue
        waited = {reload_of[i] for i in inputs if i in reload_of}
        for key in dict.fromkeys(layer_of[r] for r in waited):
            held[key] += [(w, r) for r in layers[key] if r not in waited]
    holds = [hold for key in layers for hold in held[key]]
    return order, holds, {"prefetch_layers": len(layers), "reloads_moved": moved, "waits_held": len(holds)}


class PrefetchOrderPass(Pass):
    """Each layer's reloads issued together, their waits held after all of them (``memo``)."""

    name, stage = "prefetch_order", "schedule"

    def enabled(self, config) -> bool:
        return config.activations in OFFLOADING_POLICIES

    def run(self, request: ScheduleRequest, ctx: PassContext) -> dict[str, Any]:
        order, holds, report = hold_prefetches(request.items, request.order)
        request.order, request.holds = order, request.holds + holds
        return {"matched": report["prefetch_layers"], "changed": report["reloads_moved"], **report}
