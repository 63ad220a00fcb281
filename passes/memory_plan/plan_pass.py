"""Static offsets for the buffers Inductor really allocates, from the bi-level planner.

Stage ``inductor``: runs inside Inductor's wrapper codegen, once per compiled
graph (forward, backward, inference) and device, through the hook
``request.pool_planning_patches`` installs.  The graph handed to
``run`` is a ``request.PoolRequest``: the graph's intermediate buffer groups
with sizes, half-open live ranges in Inductor's planning steps and their
origin nodes' ``nn_module_stack`` paths, plus the bytes everything else holds
at each step (the background: outputs, saved activations, extern buffers)
and the steps where kernels may allocate memory nobody can see.

Matches: every intermediate buffer group (graph inputs and outputs keep their
normal allocation).  Emits: ``request.placement``, per buffer a pool and an
offset in it or its own allocation, from ``solver.plan_pools``: the whole
graph's bi-level plan as one pool when that does not raise the graph's peak,
else pools over time segments chosen so that the peak stays at what
allocating every buffer on its own reaches.  Inductor then creates each pool
with one allocation and carves its buffers out of it (``alloc_from_pool``).

Buffers are grouped by transformer layer: the outermost module on an origin's
path that is a numbered ``ModuleList`` entry (``model.layers.3``); layers of
identical structure share one level-1 solution.  If the solver fails or runs
out of time the best heuristic plan is used; if planning raises, or sizes are
symbolic (dynamic shapes), the graph keeps Inductor's default allocation.  The
compile never fails because of the planner, and the summary says what happened.
"""

from __future__ import annotations

import hashlib
import types
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from loong_compile.passes import library_source_digest
from loong_compile.passes.base import Pass
from loong_compile.passes.fx.module_paths import layer_of_paths
from loong_compile.passes.memory_plan.request import PoolRequest, pool_planning_patches
from loong_compile.passes.memory_plan.solver import Buffer
from loong_compile.passes.memory_plan.solver.pools import PoolPlan, layout_peak, plan_pools

# Inductor aligns pool offsets to 64 bytes (torch/_inductor/utils.py ALIGN_BYTES).
ALIGNMENT = 64


def layer_of_origins(origins: Sequence[tuple[str, Sequence[str]]]) -> str | None:
    """A buffer's layer: the most common layer among its origin nodes, the latest on a tie."""
    layers = [layer for _, paths in origins if (layer := layer_of_paths(paths)) is not None]
    if not layers:
        return None
    counts = Counter(layers)
    top = max(counts.values())
    return [layer for layer in layers if counts[layer] == top][-1]


def request_buffers(request: PoolRequest) -> list[Buffer]:
    """The planner's view of one graph's intermediates."""
    return [Buffer(b.size, b.start, b.end, name=b.names[0], layer=layer_of_origins(b.origins))
            for b in request.buffers]


class MemoryPlanPass(Pass):
    """Place Inductor's intermediates in pools at offsets from the bi-level MIP (``memory_plan=True``).

    ``bilevel=False`` plans each pool flat (for comparison).  The backend runs
    it at stage ``inductor`` through ``request.pool_planning_patches``; outside
    the backend, :func:`inductor_config_patches` does the same for plain Inductor.
    """

    name, stage = "memory_plan", "inductor"

    def __init__(self, bilevel: bool = True):
        self.bilevel = bilevel

    def enabled(self, config: Any) -> bool:
        return bool(getattr(config, "memory_plan", False))

    def run(self, request: PoolRequest, ctx: Any) -> dict[str, Any]:
        buffers = request_buffers(request)
        summary: dict[str, Any] = {"graph": request.graph_name, "device": request.device,
                                   "matched": len(buffers), "changed": 0}
        request.placement = None   # Inductor's default allocation unless a layout is found
        if request.dynamic:
            summary.update(status="inductor_fallback", reason=(
                f"{request.dynamic}: static offsets need concrete sizes, so the graph keeps "
                "Inductor's own allocation"))
            return summary
        if not buffers:
            summary.update(status="nothing_to_plan",
                           reason="no intermediate buffers: Inductor's own allocation")
            return summary
        time_limit = float(getattr(ctx.config, "solver_time_limit", 10.0))
        try:
            layout = plan_pools(buffers, request.backgrounds, request.volatile,
                                time_limit=time_limit, alignment=ALIGNMENT, bilevel=self.bilevel)
        except Exception as exc:  # the compile never fails because of the planner
            summary.update(status="inductor_fallback", reason=(
                f"planner raised {type(exc).__name__}: {exc}; the graph keeps Inductor's "
                "own allocation"))
            return summary
        request.placement = layout.placement()
        summary.update(layout_summary(layout, request))
        return summary


def layout_summary(layout: PoolPlan, request: PoolRequest) -> dict[str, Any]:
    """The report's numbers: the whole-graph arena against the lower bound and Inductor's
    own pools, then the layout used and the peaks (bytes held at once, background included)."""
    whole = layout.whole
    outputs = sum(size for size, _, _ in request.outputs)
    background_without_outputs = [
        bytes_ - sum(size for size, start, end in request.outputs if start <= t < end)
        for t, bytes_ in enumerate(request.backgrounds[0])]
    status = whole.status
    if any(note.startswith("planner raised") for note in layout.notes):
        status = "solver_failed"
    return {
        "changed": sum(len(m) for m in layout.members),
        "lower_bound_bytes": whole.lower_bound,
        "arena_bytes": whole.arena,
        "ratio": round(whole.ratio, 6),
        "inductor_pool_bytes": sum(size for size, _, _ in request.inductor_pools) - outputs,
        "status": status, "method": whole.method, "solve_time_s": round(layout.solve_time, 3),
        "layers": len({b.layer for b in whole.buffers if b.layer is not None}),
        "pools": len(layout.pools), "pool_bytes": [p.arena for p in layout.pools],
        "own_allocations": len(layout.alone),
        "peak_bytes": layout.peak,
        "alone_peak_bytes": layout.bound,
        "single_pool_peak_bytes": layout.single_pool_peak,
        "inductor_pool_peak_bytes": layout_peak(background_without_outputs,
                                                request.inductor_pools, []),
        "notes": list(layout.notes) + list(whole.notes),
    }


def inductor_config_patches(time_limit: float = 10.0, bilevel: bool = True,
                            on_summary: Callable[[dict[str, Any]], None] | None = None
                            ) -> dict[str, Any]:
    """Config patches for a plain ``torch.compile(fn, backend="inductor", options=...)``.

    Runs :class:`MemoryPlanPass` outside the loong backend (tests, benchmarks):
    each graph's summary goes to ``on_summary``.
    """
    memory_pass = MemoryPlanPass(bilevel)
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(solver_time_limit=time_limit),
                                state={})

    def hook(request: PoolRequest) -> None:
        summary = memory_pass.run(request, ctx)
        if on_summary is not None:
            on_summary(summary)

    key = hashlib.sha256(f"{time_limit},{bilevel},{library_source_digest()}".encode())
    return pool_planning_patches(hook, key.hexdigest())
