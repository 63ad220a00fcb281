"""Inductor's memory planner with our offsets: the ``MemoryPlanner`` subclass, its
installation on one graph's wrapper and the config patches that scope it to one compile.

Private Inductor APIs (capability ``inductor_pool_planning``; what the planner is shown is
read in ``inductor_pools``).  The callback gets plain data and answers with plain data
(the memory-plan pass builds its request from them).
"""

from __future__ import annotations

import functools

from loong_compile import _compat
from loong_compile._compat.aot import aot_graph_kind
from loong_compile._compat.inductor import KeyedHook, scheduler_pass_base
from loong_compile._compat.inductor_pools import (
    freeable_inputs,
    graph_positions,
    inductor_own_pools,
    module_paths,
    wrapper_events,
)


def _origins(node) -> list:
    """The FX nodes a buffer came from.  A kernel's workspace (``WorkspaceArg``: scratch a
    Triton kernel allocates through the wrapper on CUDA, torch 2.11) has none."""
    get_origins = getattr(node, "get_origins", None)
    return list(get_origins()) if get_origins is not None else []


class _Declined(Exception):
    """The callback declined a graph: it gets Inductor's default allocation."""


@functools.cache
def _pool_planner_class():
    """Build the MemoryPlanner subclass on first use (keeps Inductor's codegen out of import)."""
    import dataclasses

    import sympy
    from torch._inductor.codegen import memory_planning as mp

    @dataclasses.dataclass
    class FixedPlacement(mp.AllocationTreeNode):
        """Allocations at offsets chosen outside Inductor, in an arena of ``size`` bytes."""

        allocations: list
        offsets: list
        size: int

        def get_live_ranges(self):
            return mp.LiveRanges(a.live_range for a in self.allocations)

        def get_size_hint(self):
            return self.size

        def get_symbolic_size(self):
            return sympy.Integer(self.size)

        def finalize(self, pool, offset):
            for a, off in zip(self.allocations, self.offsets):
                a.finalize(pool, offset + off)
            return self

    class LoongMemoryPlanner(mp.MemoryPlanner):
        """Inductor's pool planner with the intermediates placed by ``place(**graph)``."""

        def __init__(self, wrapper, place, is_inference):
            super().__init__(wrapper)
            self.place_graph, self.is_inference = place, is_inference
            self.lines = []

        def compute_live_ranges(self, lines):
            super().compute_live_ranges(lines)
            self.lines = lines  # converted to pool lines: the background replays their events

        def allocate_groups(self):
            for group in self.buffer_groups:
                group.make_allocation()
            outputs = [g.allocation for g in self.buffer_groups if g.is_output]
            # Groups never freed in the graph (live until it returns) are allocated like outputs.
            intermediates = [g for g in self.buffer_groups
                             if not g.is_output and g.live_range.end > g.live_range.begin]
            alone = [g.allocation for g in self.buffer_groups
                     if not g.is_output and g not in intermediates]
            placements = []
            for graph, allocations in self.graphs(intermediates, outputs):
                placement = self.place_graph(**graph)
                if placement is None:
                    raise _Declined(graph["graph_name"])
                if len(placement) != len(allocations):
                    raise RuntimeError(f"memory planner placed {len(placement)} of "
                                       f"{len(allocations)} buffers")
                placements.append((allocations, placement))
            for block in sorted(outputs, key=lambda x: (x.size_hint, -len(x.live_range))):
                self.pools.allocate_output(block)
            for allocations, placement in placements:
                alone += self.place(allocations, placement)
            for block in alone:  # one pool each: a normal allocation
                block.mark_allocated()
                self.pools.get_pools(block).append(
                    mp.AllocationPool(block.device, mp.TemporalSplit([block]), can_expand=False))
            self.pools.finalize()

        def graphs(self, intermediates, outputs):
            """What the callback gets, per device (an empty graph for one without
            intermediates, so that the planner reports on it), with its allocations."""
            inputs = freeable_inputs()
            events = wrapper_events(self.lines, {name for g in intermediates for name in g.names})
            every = [g.allocation for g in self.buffer_groups]
            dynamic = None
            if not all(isinstance(a.symbolic_size, (int, sympy.Integer)) for a in every):
                dynamic = "symbolic buffer sizes (dynamic shapes)"
            elif any(a.get_earliest_available() is not None for a in every):
                dynamic = "unbacked buffer sizes"
            name, kind = aot_graph_kind(self.is_inference)
            positions = graph_positions()
            devices = list({g.allocation.device: None for g in intermediates}) or \
                [every[0].device if every else None]
            for device in devices:
                groups = [g for g in intermediates if g.allocation.device == device]
                allocations = [g.allocation for g in groups]
                device_outputs = [a for a in outputs if a.device == device]
                yield dict(
                    graph_name=name, graph_kind=kind, device=str(device),
                    buffers=[(list(g.names), int(g.allocation.size_hint),
                              int(g.live_range.begin), int(g.live_range.end),
                              sorted(((o.name, module_paths(o)) for o in _origins(g.node)),
                                     key=lambda o: positions.get(o[0], -1)))
                             for g in groups],
                    inputs=inputs, events=events,
                    outputs=[(int(a.size_hint), int(a.live_range.begin), int(a.live_range.end))
                             for a in device_outputs],
                    inductor_pools=inductor_own_pools(allocations, device_outputs),
                    dynamic=dynamic), allocations

        def place(self, allocations, placement) -> list:
            """One pool per pool index of ``placement``; returns the allocations on their own."""
            from torch._inductor.utils import _align

            pools: dict[int, list] = {}
            alone = []
            for a, where in zip(allocations, placement):
                if where is None:
                    alone.append(a)
                else:
                    pools.setdefault(where[0], []).append((a, where[1]))
            for members in pools.values():
                for a, _ in members:
                    a.mark_allocated()
                arena = max(off + _align(a.size_hint) for a, off in members)
                root = mp.TemporalSplit([FixedPlacement([a for a, _ in members],
                                                        [off for _, off in members], arena)])
                device = members[0][0].device
                self.pools.device_to_pools.setdefault(device, []).append(
                    mp.AllocationPool(device, root, can_expand=False))
            return alone

    return LoongMemoryPlanner


def placement_patches(place, cache_key: str) -> dict:
    """Inductor config patches that place every graph's intermediates with ``place``.

    ``place(**graph)`` gets one graph's intermediates on one device as plain data:
    ``graph_name`` (AOTAutograd's, e.g. "0_backward"), ``graph_kind`` ("forward",
    "backward" or "inference"), ``device``, ``buffers`` (per ``BufferGroup``: its names,
    bytes, live range ``start, end`` in planning steps, and origins: ``(fx node name,
    nn.Module paths)`` in graph order), ``inputs`` (``freeable_inputs``), ``events``
    (``wrapper_events``), ``outputs`` and ``inductor_pools`` (``(bytes, start, end)``: the
    outputs' own allocations, the pools Inductor's heuristic would make) and ``dynamic``
    (why sizes are not static, or None).  It returns one ``(pool, offset)`` or ``None`` per
    buffer (a verified plan, offsets aligned to Inductor's 64 bytes), or None to give the
    graph Inductor's default allocation.  Applies to training and inference graphs alike;
    graph inputs and outputs keep their normal allocation.  Hand the dict to
    ``compile_fx(config_patches=...)``.  Without the ``inductor_pool_planning`` capability:
    no patches, and a warning.
    """
    if not _compat.has("inductor_pool_planning"):
        _compat.warn_degraded("inductor_pool_planning")
        return {}
    return {
        "memory_planning": True,
        "memory_pool": "intermediates",
        "_post_fusion_custom_pass": PoolPlanningHook(place, cache_key),
    }


def install_pool_planning(wrapper, place) -> None:
    """Make this one wrapper run pool planning with ``place``, training graphs included.

    Refuses (``LoongUnsupportedError``) a wrapper it cannot hook, e.g. the C++
    wrapper (``cpp_wrapper=True``) or a torch whose Python wrapper changed:
    ``memory_plan=True`` then cannot hold, and silently not planning would hide it.
    """
    import types

    from torch._inductor import config
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen, ReuseLine

    from loong_compile.errors import LoongUnsupportedError

    if getattr(wrapper, "_loong_pool_planning", False):
        return
    # Only the Python wrapper's planner is replaced (the C++ wrappers have their own).
    if (type(wrapper).memory_plan is not PythonWrapperCodegen.memory_plan
            or not hasattr(wrapper, "run_wrapper_ir_passes")):
        raise LoongUnsupportedError(
            f"memory_plan=True met Inductor wrapper {type(wrapper).__name__} (torch "
            f"{_compat.TORCH_VERSION}), whose allocations loong_compile cannot place",
            "the memory plan hooks PythonWrapperCodegen.run_wrapper_ir_passes only",
            "compile with cpp_wrapper=False, or memory_plan=False")
    planner_class = _pool_planner_class()

    def run_wrapper_ir_passes(self, is_inference):
        # Pool planning edits ReuseLines in place: keep what a decline must restore.
        reuse = [(line, line.delete_old) for line in self.lines if isinstance(line, ReuseLine)]
        try:
            self.lines = planner_class(self, place, is_inference).plan(self.lines)
        except _Declined:
            for line, delete_old in reuse:
                line.delete_old = delete_old
            with config.patch(memory_planning=False):  # Inductor's default: no pools
                PythonWrapperCodegen.run_wrapper_ir_passes(self, is_inference)

    wrapper.run_wrapper_ir_passes = types.MethodType(run_wrapper_ir_passes, wrapper)
    wrapper._loong_pool_planning = True


class PoolPlanningHook(KeyedHook, scheduler_pass_base()):
    """``_post_fusion_custom_pass``: leaves the nodes alone, hooks this graph's wrapper.

    Module level (and pickled as its cache key only, see ``KeyedHook``):
    Inductor pickles its config, this entry included, for the FX graph cache key.
    """

    def __call__(self, nodes):
        from torch._inductor.virtualized import V

        install_pool_planning(V.graph.wrapper_code, self.fn)
        return nodes
