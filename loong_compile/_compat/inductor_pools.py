"""What Inductor's wrapper shows the memory planner (private Inductor APIs, see _compat).

The request types (``PoolBuffer``, ``PoolRequest``) and the replay of the
wrapper's allocation lines that gives the background bytes, the volatile steps
and the pools Inductor's own heuristic would make.  The planner class that
answers with offsets lives in ``loong_compile._compat.pool_planner``.

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
  the intermediates of each device to the planner callback, with the bytes
  everything else holds at each step (the "background": outputs, buffers
  extern kernels allocate themselves, saved activations and gradients the
  backward frees, or keeps if the caller holds them: two scenarios) and the
  steps whose kernels may allocate memory no line shows (fallback kernels
  and custom ops: their temporaries).  The callback puts each intermediate
  in one of its pools at an offset, or on its own (its own pool: a normal
  allocation), or declines; a decline gives the whole graph Inductor's
  default allocation (no pools at all).
"""

from __future__ import annotations

import torch


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
    """What one graph's pool planning hands to the planner callback (per device).

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
    None.  The callback answers with ``placement``: per buffer ``(pool,
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


def background_bytes(lines, groups, caller_keeps_inputs: bool) -> tuple[list[int], list[bool]]:
    """Bytes held at each step (``0 .. last step``) by all but the ``groups``' storage,
    and whether a kernel of the step is an extern kernel that allocates its outputs.

    Replays the wrapper lines (already converted to pool lines, steps numbered
    as ``MemoryPlanner.compute_live_ranges`` does) tracking which names keep
    which storage alive: outputs from their allocation on; the inputs a
    backward may free (saved activations AOTAutograd donates, incoming
    gradients ``tangents_*``) until their last name is deleted, or for ever if
    ``caller_keeps_inputs``; storage that extern kernels allocate themselves
    (fallback ops, multi-output ops) until their last name, tuple element or
    alias is deleted.  Each step's value is
    the most held at a kernel of that step (memory peaks while kernels run).
    Such extern kernels (fallback ops, custom ops) may also allocate temporaries
    that no line shows: their steps are flagged volatile.
    """
    from torch._inductor import ir
    from torch._inductor.codegen import memory_planning as mp
    from torch._inductor.codegen import wrapper as w
    from torch._inductor.virtualized import V

    planned = {name for g in groups for name in g.names}
    size: dict[int, int] = {}
    refs: dict[int, int] = {}
    held: dict[str, list[int]] = {}
    pending: dict[str, int] = {}          # multi-output element name -> its storage
    live = 0

    def new(name, nbytes):
        nonlocal live
        sid = len(size)
        size[sid], refs[sid] = nbytes, 0
        live += nbytes
        hold(name, [sid])
        return sid

    def hold(name, sids):
        for sid in sids:
            refs[sid] += 1
        held.setdefault(name, []).extend(sids)

    def drop(name):
        nonlocal live
        for sid in held.pop(name, ()):
            refs[sid] -= 1
            if refs[sid] == 0:
                live -= size[sid]

    for name, value in V.graph.graph_inputs.items():
        buffer = getattr(getattr(value, "data", None), "data", None)
        # Other inputs (parameters, the forward's inputs) stay alive in the caller.
        if isinstance(buffer, ir.DonatedBuffer) or name.startswith("tangents"):
            sid = new(name, _storage_bytes(buffer))
            if caller_keeps_inputs:
                refs[sid] += 1  # the caller's own reference: never released
    background, volatile = [live], [False]
    in_run = False
    for line in lines:
        if isinstance(line, w.MemoryPlanningLine):
            if not in_run:  # a new step: its value is taken at its kernels
                background.append(0)
                volatile.append(False)
                in_run = True
            if isinstance(line, mp.AllocFromPoolLine) and line.group.names[0] not in planned:
                new(line.group.names[0], line.group.allocation.size_hint)
            elif isinstance(line, w.ReuseLine) and line.node.get_name() in held:
                old, new_name = line.node.get_name(), line.reused_as.get_name()
                hold(new_name, held[old])
                if line.delete_old:
                    drop(old)
            elif isinstance(line, w.ReinterpretLine) and line.node.get_name() in held:
                hold(line.reused_as.get_name(), held[line.node.get_name()])
            elif isinstance(line, w.FreeIfNotReusedLine) and line.node.get_name() not in planned:
                drop(line.node.get_name())
            continue
        in_run = False
        background[-1] = max(background[-1], live)   # the state kernels of this step start in
        if isinstance(line, w.FreeLine):
            drop(line.node.get_name())
        elif isinstance(line, w.ExternKernelAllocLine):
            volatile[-1] = True
            node = line.node
            if isinstance(node.layout, ir.MultiOutputLayout):
                for element in _flat_buffers(node.outputs):
                    pending[element.get_name()] = new(node.get_name(), _storage_bytes(element))
            else:
                new(node.get_name(), _storage_bytes(node))
        elif isinstance(line, w.MultiOutputLine) and line.result_name in pending:
            hold(line.result_name, [pending.pop(line.result_name)])
        background[-1] = max(background[-1], live)
    background[-1] = max(background[-1], live)
    return background, volatile


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
