"""Bi-level planning (MEMO section 4.2): one layer solved once, then layers as blocks.

Level 1: the buffers of each transformer layer (``Buffer.layer``) that live
only inside that layer's span are planned on their own.  Layers whose inner
buffers have the same sizes and the same live ranges relative to the span
start share one level-1 plan, solved once.

Level 2: each layer becomes one block, as high as its level-1 arena and live
from its first inner buffer's start to its last inner buffer's end; the
blocks, the buffers that escape their layer's span (a layer output read by the
next layer, say) and the buffers of no layer are planned together.  A buffer's
offset is its block's offset plus its level-1 offset.

A layer's span is ``[first start, last start + 1)`` of its buffers: the steps
at which it allocates (with Inductor's step numbering, a temporary freed right
after the layer's last kernel ends at ``last start + 1`` and stays inside),
unless ``layer_spans`` gives it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

from loong_compile.passes.memory_plan.solver.problem import (
    Buffer, LoongPlanError, MemoryPlan, check_buffers, lower_bound, verify,
)
from loong_compile.passes.memory_plan.solver.solve import plan

# The share of the time limit the level-1 solves get together; level 2 gets
# the rest plus whatever level 1 left unused.
LEVEL1_SHARE = 0.4


@dataclasses.dataclass(frozen=True)
class BilevelPlan(MemoryPlan):
    """A :class:`MemoryPlan` plus its parts: the level-1 plan of each distinct layer
    structure, which structure each layer uses, and the level-2 plan."""

    level1: tuple[MemoryPlan, ...] = ()
    layer_structure: Mapping[Hashable, int] = dataclasses.field(default_factory=dict)
    level2: MemoryPlan | None = None


def _layer_parts(buffers: Sequence[Buffer], spans: Mapping[Hashable, tuple[int, int]] | None):
    """Per layer key: (span, inner buffer indices); plus indices that go to level 2 alone."""
    by_layer: dict[Hashable, list[int]] = defaultdict(list)
    alone = []
    for i, b in enumerate(buffers):
        (alone if b.layer is None else by_layer[b.layer]).append(i)
    layers = {}
    for key, members in by_layer.items():
        if spans is not None and key in spans:
            span = spans[key]
        else:
            span = (min(buffers[i].start for i in members),
                    max(buffers[i].start for i in members) + 1)
        # Inner: live inside the span and taking memory (zero-size buffers and
        # empty live ranges are left to level 2, where they get offset 0).
        inner = [i for i in members if span[0] <= buffers[i].start and buffers[i].end <= span[1]
                 and buffers[i].size and buffers[i].end > buffers[i].start]
        inner_set = set(inner)
        alone += [i for i in members if i not in inner_set]
        if inner:
            layers[key] = (span, inner)
    return layers, sorted(alone)


def _structure(buffers: Sequence[Buffer], span: tuple[int, int], inner: list[int], alignment: int):
    """A layer's inner buffers in canonical order, and the key identical layers share."""
    def rel(i):
        b = buffers[i]
        return (b.start - span[0], b.end - span[0], -(-b.size // alignment) * alignment)
    ordered = sorted(inner, key=lambda i: (rel(i), i))
    return ordered, tuple(rel(i) for i in ordered)


def plan_bilevel(buffers: Sequence[Buffer], *, time_limit: float = 30.0, alignment: int = 64,
                 capacity: int | None = None, method: str = "auto",
                 layer_spans: Mapping[Hashable, tuple[int, int]] | None = None) -> BilevelPlan:
    """Plan ``buffers`` bi-level: layers (by ``Buffer.layer``) first, then layers as blocks.

    Same options as :func:`loong_compile.passes.memory_plan.solver.plan`; ``layer_spans`` may
    give a layer's step span ``[first, end)`` explicitly.  The returned plan
    has been verified as a whole.
    """
    t0 = time.monotonic()
    check_buffers(buffers, alignment)
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise LoongPlanError(f"time_limit={time_limit!r}", "the time limit is a positive "
                             "number of seconds", "pass e.g. time_limit=30")
    layers, alone = _layer_parts(buffers, layer_spans)

    # Level 1: one solve per distinct layer structure.
    structures: dict[tuple, int] = {}
    members_of: dict[Hashable, list[int]] = {}
    for key, (span, inner) in layers.items():
        ordered, structure = _structure(buffers, span, inner, alignment)
        members_of[key] = ordered
        structures.setdefault(structure, len(structures))
    layer_structure = {key: structures[_structure(buffers, span, inner, alignment)[1]]
                       for key, (span, inner) in layers.items()}
    level1: list[MemoryPlan] = []
    level1_deadline = t0 + time_limit * LEVEL1_SHARE
    for k, structure in enumerate(structures):
        share = (level1_deadline - time.monotonic()) / (len(structures) - k)
        rebased = [Buffer(size, start, end, name=f"{k}.{pos}")
                   for pos, (start, end, size) in enumerate(structure)]
        level1.append(plan(rebased, time_limit=max(share, 0.05), alignment=alignment,
                           method=method))

    # Level 2: blocks + buffers outside layers.
    blocks, block_of = [], {}
    for key, ordered in members_of.items():
        sub = level1[layer_structure[key]]
        block_of[key] = len(blocks)
        blocks.append(Buffer(sub.arena, min(buffers[i].start for i in ordered),
                             max(buffers[i].end for i in ordered), name=f"layer {key}"))
    level2_buffers = blocks + [buffers[i] for i in alone]
    remaining = time_limit - (time.monotonic() - t0)
    top = plan(level2_buffers, time_limit=max(remaining, 0.05), alignment=alignment,
               capacity=capacity, method=method)

    offsets = [0] * len(buffers)
    for pos, i in enumerate(alone):
        offsets[i] = top.offsets[len(blocks) + pos]
    for key, ordered in members_of.items():
        base = top.offsets[block_of[key]]
        sub = level1[layer_structure[key]]
        for pos, i in enumerate(ordered):
            offsets[i] = base + sub.offsets[pos]
    arena = top.arena
    verify(buffers, offsets, arena, alignment)

    lb = lower_bound(buffers, alignment)
    parts = level1 + [top]
    if arena == lb:
        status = "optimal"
    elif any(p.status == "solver_failed" for p in parts):
        status = "solver_failed"
    elif all(p.status == "optimal" for p in parts):
        status = "level_optimal"
    else:
        status = "time_limit" if method != "greedy" else "heuristic"
    notes = [f"{len(layers)} layers, {len(structures)} distinct layer structure(s) solved at "
             f"level 1; level 2 has {len(level2_buffers)} buffers ({len(blocks)} blocks)"]
    notes += [f"level 1 #{k}: {p.summary()}" for k, p in enumerate(level1)]
    notes += [f"level 2: {top.summary()}"]
    notes += [f"  {note}" for p in parts for note in p.notes if "failed" in note]
    return BilevelPlan(tuple(buffers), tuple(offsets), arena, lb, lb, status, "bilevel",
                       time.monotonic() - t0, alignment, tuple(notes), tuple(level1),
                       layer_structure, top)
