"""How one compiled graph's buffers reach the memory-plan pass: ``PoolRequest``.

``pool_planning_patches`` hooks Inductor's memory planner (``_compat.pool_planner``, which
hands over plain data), builds a ``PoolRequest`` from what Inductor's wrapper shows (the
background replayed in ``background``), hands it to the planner callback (the backend's
``inductor`` stage) and gives Inductor back the placement the callback set.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from loong_compile._compat.pool_planner import placement_patches
from loong_compile.passes.memory_plan.background import backgrounds


class PoolBuffer:
    """One Inductor ``BufferGroup`` of intermediates, as the planner sees it."""

    __slots__ = ("names", "size", "start", "end", "origins")

    def __init__(self, names, size, start, end, origins):
        self.names = names        # the group's buffer names (in-place reuses share a group)
        self.size = size          # bytes (Inductor's size hint)
        self.start = start        # half-open live range [start, end) in planning steps
        self.end = end
        self.origins = origins    # [(fx node name, [nn.Module paths outer->inner])] in graph order

    def __repr__(self):
        return f"PoolBuffer({self.names}, {self.size} B, [{self.start}, {self.end}))"


class PoolRequest:
    """One graph's intermediates on one device, what the ``inductor`` stage's passes see.

    ``backgrounds[s][t]``: bytes held at step ``t`` (``0 <= t < steps``) by
    everything the planner does not place: graph outputs, buffers extern
    kernels allocate, and the inputs the graph frees (saved activations,
    incoming gradients) until it frees them (scenario 0: the usual case,
    ``loss.backward()``) or to the end (scenario 1, present when the graph
    frees inputs: the caller keeps them, e.g. ``retain_graph=True`` or
    gradients the caller holds).  Parameters and the forward's inputs are
    left out: the caller keeps them, whatever the plan.  ``volatile[t]``: a
    kernel of step ``t`` may allocate memory the wrapper does not show (a
    fallback kernel or custom op, whose temporaries nobody can size), so a
    pool must not hold unused bytes there.  ``outputs`` and
    ``inductor_pools`` are ``(bytes, start, end)`` triples: the outputs' own
    allocations, and the pools Inductor's own heuristic would create (outputs'
    pools included).  ``dynamic`` names why
    the graph cannot be planned statically (symbolic or unbacked sizes), or is
    None.  A pass answers with ``placement``: per buffer ``(pool,
    offset)`` or ``None`` (allocated on its own), or leaves it None to decline.
    """

    __slots__ = ("graph_name", "graph_kind", "device", "buffers", "steps", "backgrounds",
                 "volatile", "outputs", "inductor_pools", "dynamic", "placement")

    def __init__(self, graph_name, graph_kind, device, buffers, steps, backgrounds, volatile,
                 outputs, inductor_pools, dynamic=None):
        self.graph_name = graph_name            # AOTAutograd's name, e.g. "0_backward"
        self.graph_kind = graph_kind            # "forward", "backward" or "inference"
        self.device = device
        self.buffers = buffers                  # list[PoolBuffer]: the intermediates
        self.steps = steps
        self.backgrounds = backgrounds
        self.volatile = volatile
        self.outputs = outputs
        self.inductor_pools = inductor_pools
        self.dynamic = dynamic
        self.placement = None

    def __str__(self):
        """A readable dump (the ``inductor`` stage's "graph"): one line per buffer."""
        head = (f"# {self.graph_name} ({self.graph_kind}) on {self.device}: "
                f"{len(self.buffers)} intermediates, {len(self.outputs)} outputs, "
                f"{self.steps} steps" + (f"; dynamic: {self.dynamic}" if self.dynamic else ""))
        lines = [head, "# name            bytes  [start, end)  placement"]
        placement = self.placement or [None] * len(self.buffers)
        for b, where in zip(self.buffers, placement):
            at = ("own allocation" if where is None else f"pool {where[0]} + {where[1]}"
                  ) if self.placement is not None else "-"
            lines.append(f"{b.names[0]:<12} {b.size:>12}  [{b.start}, {b.end})  {at}")
        return "\n".join(lines) + "\n"


def request_of(graph_name: str, graph_kind: str, device: str, buffers: Sequence[tuple],
               inputs: Sequence[tuple[str, int]], events: Sequence[tuple],
               outputs: list[tuple[int, int, int]], inductor_pools: list[tuple[int, int, int]],
               dynamic: str | None) -> PoolRequest:
    """The request for one graph and device, from the plain data of
    ``_compat.pool_planner.placement_patches``."""
    scenarios, volatile = backgrounds(inputs, events)
    return PoolRequest(graph_name, graph_kind, device, [PoolBuffer(*b) for b in buffers],
                       len(scenarios[0]), scenarios, volatile, outputs, inductor_pools, dynamic)


def _placement(planner: Callable[[PoolRequest], None], **graph):
    request = request_of(**graph)
    planner(request)
    return request.placement


def pool_planning_patches(planner: Callable[[PoolRequest], None], cache_key: str) -> dict:
    """Inductor config patches that place every graph's intermediates with ``planner``.

    ``planner(request)`` sets ``request.placement`` (one ``(pool, offset)`` or ``None`` per
    ``request.buffers`` entry: a verified plan, offsets aligned to Inductor's 64 bytes) or
    leaves it None to give the graph Inductor's default allocation.  Applies to training and
    inference graphs alike; graph inputs and outputs keep their normal allocation.  Hand the
    dict to ``compile_fx(config_patches=...)``.  Without the ``inductor_pool_planning``
    capability: no patches, and a warning.
    """
    return placement_patches(functools.partial(_placement, planner), cache_key)
