"""What Inductor's wrapper shows the memory planner, as plain data (private Inductor APIs, see _compat).

Capability ``inductor_pool_planning``.  The wrapper's allocation lines become events
(``wrapper_events``) that ``loong_compile.passes.memory_plan.background`` replays into the
bytes held at each step; the inputs a graph may free, its buffers' origins, and the pools
Inductor's own heuristic would make are read here too.  The planner class that answers with
offsets lives in ``loong_compile._compat.pool_planner``.

How our offsets reach Inductor (checked against torch 2.13):
* ``config.memory_planning=True`` makes the wrapper codegen pass its
  allocation lines through ``codegen.memory_planning.MemoryPlanner``, which
  joins in-place reuses into ``BufferGroup``s, numbers the steps (a step is
  one run of allocation/free lines between kernels; live ranges are
  half-open ``[alloc step, free step)``; within a run frees come before
  allocations), places the groups in ``AllocationPool``s (one
  ``torch.empty`` each, created at its first member's allocation and deleted
  after its last member's free) and emits ``alloc_from_pool(pool, offset, ...)``.
* ``PythonWrapperCodegen.run_wrapper_ir_passes(is_inference)`` only runs that
  planner for inference graphs.  Our ``_post_fusion_custom_pass`` (a config
  entry, so scoped to one ``compile_fx`` and part of the FX-graph cache key
  through ``uuid()``) runs after fusion, when ``V.graph.wrapper_code`` already
  exists, and replaces ``run_wrapper_ir_passes`` on that one wrapper object.
* Our ``MemoryPlanner`` subclass keeps Inductor's handling of graph outputs
  (each its own pool: a normal allocation, freed with the output) and hands
  the intermediates of each device to the planner callback, with what decides
  the bytes everything else holds at each step (the "background": outputs,
  buffers extern kernels allocate themselves, saved activations and gradients
  the backward frees) and the steps whose kernels may allocate memory no line
  shows (fallback kernels and custom ops: their temporaries).  The callback
  puts each intermediate in one of its pools at an offset, or on its own (its
  own pool: a normal allocation), or declines; a decline gives the whole graph
  Inductor's default allocation (no pools at all).
"""

from __future__ import annotations


def module_paths(fx_node) -> list[str]:
    """``nn_module_stack`` paths of an fx node; backward nodes carry the forward's stack."""
    stack = fx_node.meta.get("nn_module_stack") or fx_node.meta.get("fwd_nn_module_stack") or {}
    return [path for path, _cls in stack.values()]


def graph_positions():
    from torch._inductor.virtualized import V

    gm = getattr(V.graph, "module", None)
    return {n.name: k for k, n in enumerate(gm.graph.nodes)} if gm is not None else {}


def _storage_bytes(node) -> int:
    """Bytes of a buffer's storage (size hint); 0 for what has no tensor layout."""
    from torch._inductor.virtualized import V

    try:
        nbytes = node.get_layout().storage_size() * node.get_dtype().itemsize
    except (AttributeError, NotImplementedError):
        return 0
    return int(V.graph.sizevars.optimization_hint(nbytes, fallback=0))


def _flat_buffers(outputs) -> list:
    out = []
    for item in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
        if isinstance(item, (list, tuple)):
            out += _flat_buffers(item)
        elif item is not None and hasattr(item, "get_name"):
            out.append(item)
    return out


def freeable_inputs() -> list[tuple[str, int]]:
    """The graph's inputs it may free, with their bytes: saved activations AOTAutograd
    donates and incoming gradients ``tangents_*``.  Other inputs (parameters, the
    forward's inputs) stay alive in the caller."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    out = []
    for name, value in V.graph.graph_inputs.items():
        buffer = getattr(getattr(value, "data", None), "data", None)
        if isinstance(buffer, ir.DonatedBuffer) or name.startswith("tangents"):
            out.append((name, _storage_bytes(buffer)))
    return out


def wrapper_events(lines, planned: set[str]) -> list[tuple]:
    """The wrapper lines (already converted to pool lines, steps numbered as
    ``MemoryPlanner.compute_live_ranges`` does) as the events that change which names hold
    storage the planner does not place (``planned``: the names it places).

    Allocation lines (a run of them is one step): ``("alloc", name, bytes)``,
    ``("reuse", old, new, delete_old)``, ``("alias", old, new)``, ``("release", name)``, or
    ``("plan",)`` for one that changes none of that storage.  Kernel lines:
    ``("free", name)``; ``("extern", name, [(element or None, bytes), ...])`` for an extern
    kernel that allocates its outputs (a multi-output one names each element); ``("element",
    name)`` where a multi-output's element is taken; ``("kernel",)`` for any other.
    """
    from torch._inductor import ir
    from torch._inductor.codegen import memory_planning as mp
    from torch._inductor.codegen import wrapper as w

    events: list[tuple] = []
    for line in lines:
        if isinstance(line, w.MemoryPlanningLine):
            if isinstance(line, mp.AllocFromPoolLine) and line.group.names[0] not in planned:
                events.append(("alloc", line.group.names[0], line.group.allocation.size_hint))
            elif isinstance(line, w.ReuseLine):
                events.append(("reuse", line.node.get_name(), line.reused_as.get_name(),
                               line.delete_old))
            elif isinstance(line, w.ReinterpretLine):
                events.append(("alias", line.node.get_name(), line.reused_as.get_name()))
            elif isinstance(line, w.FreeIfNotReusedLine) and line.node.get_name() not in planned:
                events.append(("release", line.node.get_name()))
            else:
                events.append(("plan",))
        elif isinstance(line, w.FreeLine):
            events.append(("free", line.node.get_name()))
        elif isinstance(line, w.ExternKernelAllocLine):
            node = line.node
            if isinstance(node.layout, ir.MultiOutputLayout):
                parts = [(e.get_name(), _storage_bytes(e)) for e in _flat_buffers(node.outputs)]
            else:
                parts = [(None, _storage_bytes(node))]
            events.append(("extern", node.get_name(), parts))
        elif isinstance(line, w.MultiOutputLine):
            events.append(("element", line.result_name))
        else:
            events.append(("kernel",))
    return events


def inductor_own_pools(allocations, output_allocations) -> list[tuple[int, int, int]]:
    """The pools Inductor's own heuristic makes for these allocations: (bytes, start, end).

    Run on fresh ``Allocation`` copies so that the real ones stay untouched.
    """
    from torch._inductor.codegen.memory_planning import Allocation, AllocationPools

    def copy(a):
        return Allocation(a.node, a.live_range, size_hint=a.size_hint,
                          symbolic_size=a.symbolic_size)

    pools = AllocationPools()
    for block in sorted((copy(a) for a in output_allocations),
                        key=lambda x: (x.size_hint, -len(x.live_range))):
        pools.allocate_output(block)
    for block in sorted((copy(a) for a in allocations),
                        key=lambda x: (-x.size_hint, -len(x.live_range))):
        pools.allocate(block)
    out = []
    for pool in (p for ps in pools.device_to_pools.values() for p in ps):
        live = pool.root.get_live_ranges()
        out.append((int(pool.root.get_size_hint()), int(live.begin), int(live.end)))
    return out
