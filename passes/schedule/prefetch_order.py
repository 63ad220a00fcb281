"""A layer's prefetches issued together, before its backward reads any of them.

``offload`` puts each reload of a layer after the same compute (the layer above's backward
begins), but a dependency can say "not before", never "not after": Inductor's peak-memory
order can move some reloads of a layer down, past the first wait of that layer, and the
backward then stalls on a copy that started late.  On Inductor's scheduler nodes before
fusion, the reloads of one layer (those sharing one ``after=`` input) are moved up to the
first of them, and each of their waits is held after all of them by an ordering-only
dependency.

Stage ``schedule``, under ``activations="memo"``.  Report: the layers whose prefetches were
grouped, the reloads moved and the waits held.
"""

from __future__ import annotations

from typing import Any

from loong_compile.passes.base import Pass, PassContext, ScheduleRequest


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
    holds, moved = [], 0
    for reloads in layers.values():
        reloads.sort(key=position.__getitem__)
        later = set(reloads[1:])
        moved += sum(position[r] != position[reloads[0]] + k for k, r in enumerate(reloads))
        order = [n for n in order if n not in later]
        at = order.index(reloads[0]) + 1
        order[at:at] = reloads[1:]
        for w, (_, _, op, inputs) in enumerate(items):
            waited = {reload_of[i] for i in inputs if i in reload_of}
            if op == "loong.wait_tensor" and waited & set(reloads):
                holds += [(w, r) for r in reloads if r not in waited]
    return order, holds, {"prefetch_layers": len(layers), "reloads_moved": moved, "waits_held": len(holds)}


class PrefetchOrderPass(Pass):
    """Each layer's reloads issued together, their waits held after all of them (``memo``)."""

    name, stage = "prefetch_order", "schedule"

    def enabled(self, config) -> bool:
        return config.activations == "memo"

    def run(self, request: ScheduleRequest, ctx: PassContext) -> dict[str, Any]:
        order, holds, report = hold_prefetches(request.items, request.order)
        request.order, request.holds = order, request.holds + holds
        return {"matched": report["prefetch_layers"], "changed": report["reloads_moved"], **report}
