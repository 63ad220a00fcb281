"""Draw a memory plan: one rectangle per buffer, time (steps) across, address up."""

from __future__ import annotations

import os
from collections.abc import Hashable

from loong_compile.planner.problem import Plan


def draw_plan(plan: Plan, path: str | os.PathLike, *, title: str | None = None,
              color_by_layer: bool = True) -> str:
    """Write ``plan`` as a PNG (or any format matplotlib infers from ``path``); return the path.

    Buffers are rectangles ``[start, end) x [offset, offset + size)``, coloured
    by layer when they carry one.  Dashed lines: the arena and the lower bound.
    Needs matplotlib (the ``plot`` extra).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    layers: dict[Hashable, int] = {}
    cmap = plt.get_cmap("tab20")
    rects, colors = [], []
    for b, off in zip(plan.buffers, plan.offsets):
        if not b.size or b.end <= b.start:
            continue
        rects.append(Rectangle((b.start, off), b.end - b.start, b.size))
        key = b.layer if color_by_layer else None
        color = "lightgray" if key is None else cmap(layers.setdefault(key, len(layers)) % 20)
        colors.append(color)
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.add_collection(PatchCollection(rects, facecolor=colors, edgecolor="black", linewidth=0.3))
    steps = [b.start for b in plan.buffers] + [b.end for b in plan.buffers]
    ax.set_xlim(min(steps, default=0), max(steps, default=1))
    ax.set_ylim(0, max(plan.arena, 1) * 1.05)
    ax.axhline(plan.arena, color="red", linestyle="--", linewidth=1, label=f"arena {plan.arena} B")
    ax.axhline(plan.lower_bound, color="green", linestyle=":", linewidth=1,
               label=f"lower bound {plan.lower_bound} B")
    ax.set_xlabel("step")
    ax.set_ylabel("offset (bytes)")
    ax.set_title(title or f"{len(plan.buffers)} buffers, {plan.status} via {plan.method}")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
