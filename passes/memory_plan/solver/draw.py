"""Draw a memory plan: one rectangle per buffer, time (steps) across, address up."""

from __future__ import annotations

import os
from collections.abc import Hashable

from loong_compile.passes.memory_plan.solver.pools import PoolPlan
from loong_compile.passes.memory_plan.solver.problem import Buffer, MemoryPlan


def _rectangles(plan: MemoryPlan | PoolPlan) -> tuple[list[tuple[Buffer, int, bool]], int]:
    """``(buffer, offset, on its own)`` per buffer that takes memory, and the height drawn.

    A :class:`PoolPlan`'s pools never overlap in time, so they share the
    address axis; the buffers allocated on their own are stacked above them
    (first fit), as the allocator would hand them out anywhere.
    """
    if isinstance(plan, MemoryPlan):
        return [(b, off, False) for b, off in zip(plan.buffers, plan.offsets)], plan.arena
    out = [(plan.buffers[i], off, False)
           for p, members in zip(plan.pools, plan.members) for i, off in zip(members, p.offsets)]
    base = max((p.arena for p in plan.pools), default=0)
    top = base
    placed: list[tuple[Buffer, int]] = []
    for i in plan.alone:
        b = plan.buffers[i]
        off = base
        for other, other_off in sorted(placed, key=lambda x: x[1]):
            if other.start < b.end and b.start < other.end and other_off < off + b.size \
                    and off < other_off + other.size:
                off = other_off + other.size
        placed.append((b, off))
        out.append((b, off, True))
        top = max(top, off + b.size)
    return out, top


def draw_plan(plan: MemoryPlan | PoolPlan, path: str | os.PathLike, *, title: str | None = None,
              color_by_layer: bool = True) -> str:
    """Write ``plan`` as a PNG (or any format matplotlib infers from ``path``); return the path.

    Buffers are rectangles ``[start, end) x [offset, offset + size)``, coloured
    by layer when they carry one; for a :class:`PoolPlan` (what the memory-plan
    pass uses) the buffers allocated on their own are hatched, above the pools.
    Dashed lines: the arena (or tallest pool) and the lower bound.  Needs
    matplotlib (the ``plot`` extra).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rectangles, height = _rectangles(plan)
    layers: dict[Hashable, int] = {}
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(10, 5))
    for b, off, alone in rectangles:
        if not b.size or b.end <= b.start:
            continue
        key = b.layer if color_by_layer else None
        color = "lightgray" if key is None else cmap(layers.setdefault(key, len(layers)) % 20)
        ax.add_patch(Rectangle((b.start, off), b.end - b.start, b.size, facecolor=color,
                               edgecolor="black", linewidth=0.3, hatch="//" if alone else None))
    steps = [b.start for b in plan.buffers] + [b.end for b in plan.buffers]
    ax.set_xlim(min(steps, default=0), max(steps, default=1))
    ax.set_ylim(0, max(height, 1) * 1.05)
    if isinstance(plan, PoolPlan):
        whole, top = plan.whole, max((p.arena for p in plan.pools), default=0)
        label = f"tallest pool {top} B"
    else:
        whole, top, label = plan, plan.arena, f"arena {plan.arena} B"
    ax.axhline(top, color="red", linestyle="--", linewidth=1, label=label)
    ax.axhline(whole.lower_bound, color="green", linestyle=":", linewidth=1,
               label=f"lower bound {whole.lower_bound} B")
    ax.set_xlabel("step")
    ax.set_ylabel("offset (bytes)")
    default_title = (f"{len(plan.buffers)} buffers, {len(plan.pools)} pools, "
                     f"{len(plan.alone)} on their own" if isinstance(plan, PoolPlan) else
                     f"{len(plan.buffers)} buffers, {plan.status} via {plan.method}")
    ax.set_title(title or default_title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
