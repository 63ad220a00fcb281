"""Static offsets for the buffers Inductor really allocates, from the bi-level planner.

Stage ``inductor``: runs inside Inductor's wrapper codegen, once per compiled
graph (forward, backward, inference) and device, through the hook in
``loong_compile._compat`` (``pool_planning_patches``).  The graph handed to
``run`` is a ``_compat.PoolRequest``: the graph's intermediate buffer groups
with sizes, half-open live ranges in Inductor's planning steps and their
origin nodes' ``nn_module_stack`` paths.

Matches: every intermediate buffer group (graph inputs and outputs keep their
normal allocation).  Emits: ``request.offsets``, one byte offset per group, a
plan that has passed ``planner.verify``; Inductor then allocates one pool per
device and carves every intermediate out of it (``alloc_from_pool``).

Buffers are grouped by transformer layer: the outermost module on an origin's
path that is a numbered ``ModuleList`` entry (``model.layers.3``); layers of
identical structure share one level-1 solution.  If planning raises, the
greedy plan is used; if that raises too, Inductor's own pool plan; the compile
never fails because of the planner, and the summary says what happened.
"""

from __future__ import annotations

import hashlib
import re
import types
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import loong_compile.planner as planner_package
from loong_compile import _compat
from loong_compile.planner import Buffer, Plan, lower_bound, plan, plan_bilevel

# Inductor aligns pool offsets to 64 bytes (torch/_inductor/utils.py ALIGN_BYTES).
ALIGNMENT = 64

_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]|\[(\d+)\]")


def normalize_module_path(path: str) -> str:
    """Dynamo's module path (``L['self'].layers[3]._modules['mlp']``) as ``layers.3.mlp``."""
    path = _DYNAMO_ROOT.sub("", path)
    return _MODULES_ITEM.sub(lambda m: "." + (m.group(1) or m.group(2)), path).strip(".")


def layer_of_paths(paths: Sequence[str]) -> str | None:
    """The transformer layer on one module stack (outer to inner): its first numbered entry."""
    for path in paths:
        normalized = normalize_module_path(path)
        if normalized.rsplit(".", 1)[-1].isdigit():
            return normalized
    return None


def layer_of_origins(origins: Sequence[tuple[str, Sequence[str]]]) -> str | None:
    """A buffer's layer: the most common layer among its origin nodes, the latest on a tie."""
    layers = [layer for _, paths in origins if (layer := layer_of_paths(paths)) is not None]
    if not layers:
        return None
    counts = Counter(layers)
    top = max(counts.values())
    return [layer for layer in layers if counts[layer] == top][-1]


def request_buffers(request: _compat.PoolRequest) -> list[Buffer]:
    """The planner's view of one graph's intermediates."""
    return [Buffer(b.size, b.start, b.end, name=b.names[0], layer=layer_of_origins(b.origins))
            for b in request.buffers]


def plan_buffers(buffers: Sequence[Buffer], *, time_limit: float, bilevel: bool = True,
                 alignment: int = ALIGNMENT) -> tuple[Plan, list[str]]:
    """Plan one graph's buffers, falling back to the greedy plan if the planner raises.

    Returns the plan and the fallback notes (empty when nothing went wrong).
    Errors from the greedy plan itself propagate.
    """
    try:
        if bilevel and any(b.layer is not None for b in buffers):
            return plan_bilevel(buffers, time_limit=time_limit, alignment=alignment), []
        return plan(buffers, time_limit=time_limit, alignment=alignment), []
    except Exception as exc:  # the compile never fails because of the solver
        return (plan(buffers, time_limit=time_limit, alignment=alignment, method="greedy"),
                [f"planner raised {type(exc).__name__}: {exc}; using the greedy plan"])


class MemoryPlanPass:
    """Place Inductor's intermediates at offsets from the bi-level MIP (``memory_plan=True``).

    ``bilevel=False`` plans each graph flat (for comparison).  The lead's
    backend installs it with ``_compat.pool_planning_patches(hook, cache_key)``
    where ``hook(request)`` calls ``run(request, ctx)`` and returns
    ``request.offsets``.
    """

    name: ClassVar[str] = "memory_plan"
    stage: ClassVar[str] = "inductor"

    def __init__(self, bilevel: bool = True):
        self.bilevel = bilevel

    def enabled(self, config: Any) -> bool:
        return bool(getattr(config, "memory_plan", False))

    def run(self, request: _compat.PoolRequest, ctx: Any) -> dict[str, Any]:
        time_limit = float(getattr(ctx.config, "solver_time_limit", 10.0))
        buffers = request_buffers(request)
        summary: dict[str, Any] = {
            "graph": request.graph_name, "device": request.device, "matched": len(buffers),
            "changed": 0, **inductor_baselines(request, buffers),
        }
        try:
            result, fallback = plan_buffers(buffers, time_limit=time_limit, bilevel=self.bilevel)
        except Exception as exc:  # even greedy failed: Inductor's own pool plan stays
            request.offsets = None
            summary.update(status="inductor_fallback",
                           notes=[f"planner raised {type(exc).__name__}: {exc}; using "
                                  "Inductor's own pool plan"])
            return summary
        request.offsets = list(result.offsets)
        ctx.state.setdefault(self.name, []).append(result)  # for inspect's drawing
        summary.update(
            changed=len(buffers), arena_bytes=result.arena, lower_bound_bytes=result.lower_bound,
            ratio=round(result.ratio, 6), peak_bytes=planned_peak(result.arena, buffers, request),
            layers=len({b.layer for b in buffers if b.layer is not None}),
            status=result.status if not fallback else "solver_failed", method=result.method,
            solve_time_s=round(result.solve_time, 3), notes=list(fallback) + list(result.notes))
        return summary


def _triples(triples: Sequence[tuple[int, int, int]]) -> list[Buffer]:
    return [Buffer(size, start, end) for size, start, end in triples]


def planned_peak(arena: int, buffers: Sequence[Buffer], request: _compat.PoolRequest) -> int:
    """The most bytes held at once with our pool: the arena, from the first intermediate's
    allocation to the last one's free, plus the outputs live at that step."""
    if not buffers:
        return lower_bound(_triples(request.outputs))
    pool = Buffer(arena, min(b.start for b in buffers), max(b.end for b in buffers))
    return lower_bound([pool] + _triples(request.outputs))


def inductor_baselines(request: _compat.PoolRequest, buffers: Sequence[Buffer]) -> dict[str, int]:
    """What Inductor would need without our plan, in bytes.

    ``inductor_pool_bytes``: its own pools minus the outputs' storage (what its
    heuristic adds for the intermediates); ``inductor_pool_peak_bytes``: the
    most bytes its pools hold at once; ``live_peak_bytes``: the most bytes of
    intermediates and outputs live at once (what allocating each buffer on its
    own, Inductor's default for training graphs, needs at best).
    """
    outputs = _triples(request.outputs)
    pools = _triples(request.inductor_pools)
    return {
        "inductor_pool_bytes": sum(b.size for b in pools) - sum(b.size for b in outputs),
        "inductor_pool_peak_bytes": lower_bound(pools),
        "live_peak_bytes": lower_bound(list(buffers) + outputs),
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

    def hook(request: _compat.PoolRequest) -> list[int] | None:
        summary = memory_pass.run(request, ctx)
        if on_summary is not None:
            on_summary(summary)
        return request.offsets

    # The generated code depends on the planner's sources and options.
    key = hashlib.sha256(f"{time_limit},{bilevel}".encode())
    for path in sorted(Path(planner_package.__file__).parent.glob("*.py")):
        key.update(path.read_bytes())
    key.update(Path(__file__).read_bytes())
    return _compat.pool_planning_patches(hook, key.hexdigest())
