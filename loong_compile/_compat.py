"""Every use of a private torch API lives here, so a torch upgrade touches one file.

Sections are grouped by the part of loong_compile that needs them.  Each
function documents which torch versions it was checked against.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass, CustomPartitionerFn

TORCH_VERSION = torch.__version__

# --- distributed: process groups by name (ops/, mesh.py) ---------------------

def resolve_process_group(group_name: str):
    """The ProcessGroup registered under ``group_name`` (``ProcessGroup.group_name``).

    Custom-op schemas can only carry primitives, so the 2D-Attention ops take
    group names as strings and resolve them here at run time, the same way
    torch's functional collectives do.  Checked against torch 2.13.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# --- Dynamo: the module being compiled (passes/model_facts.py) -------------------

def dynamo_frame_self():
    """The ``self`` of the frame Dynamo is compiling when a backend is called, or None.

    Model code decides some things from Python values Dynamo never puts in the graph (a
    sliding window it skips because the local sequence is short, a RoPE variant chosen by
    length); the attention pass reads them from the module.  Dynamo's instruction
    translator of the current frame is a private API.  Checked against torch 2.13.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError, AssertionError, IndexError):
        return None
    frame_self = getattr(tx, "f_locals", {}).get("self") if tx is not None else None
    return frame_self if isinstance(frame_self, torch.nn.Module) else None


# PyTorch's flash-attention kernels (ops/kernels.py): the only aten ops that
# return the log-sum-exp that ring attention merges on.  Checked: torch 2.13
# (the CPU kernel takes float64/float32/bfloat16 and fewer KV heads than Q heads).

def sdpa_flash_cpu(q, k, v, is_causal: bool, scale: float):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention_for_cpu`` (no dropout)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale)


def sdpa_flash_cpu_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """``(dq, dk, dv)`` of the CPU flash kernel, given the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)


def sdpa_flash_cuda(q, k, v, is_causal: bool, scale: float):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention`` (CUDA, fp16/bf16)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


def sdpa_flash_cuda_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """``(dq, dk, dv)`` of the CUDA flash kernel.  Without dropout the philox state is
    unused; ``None`` sequence offsets mean dense (not nested) inputs."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, is_causal, seed, offset,
        scale=scale)


# --- custom-op tags (ops/) ----------------------------------------------------

def cudagraph_unsafe_tags() -> tuple:
    """``(torch.Tag.cudagraph_unsafe,)``, or ``()`` on a torch without the tag.

    Ops that communicate or copy to the host carry it, so Inductor's CUDA graphs
    split around them instead of capturing them.  Checked: torch 2.13 has the tag.
    """
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return () if tag is None else (tag,)


# --- dynamo backend registry (backend.py) ------------------------------------

def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Register ``name`` unless Dynamo has it already (an earlier import, a reload).

    Checked against torch 2.13, where ``register_backend`` raises "duplicate name".
    """
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


# --- rank check (rank_check.py) ----------------------------------------------

def default_store():
    """The key-value store of the default process group (torch 2.13: ``_get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def store_wait(store, keys: list[str], timeout_s: float) -> None:
    """Wait until every key is set; raise (a store error) after ``timeout_s`` seconds."""
    from datetime import timedelta

    store.wait(keys, timedelta(seconds=timeout_s))


# --- run-time input checks (input_checks.py) ---------------------------------

def placeholder_sources(gm) -> list[str | None]:
    """Where Dynamo read each graph input of ``gm`` from (``"L['position_ids']"``), or None.

    Checked against torch 2.13: a Dynamo placeholder's ``meta["grapharg"]`` is a
    ``GraphArg`` whose ``source.name`` is a string property.
    """
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        names.append(None if source is None else source.name)
    return names


# --- AOTAutograd / partitioner (backend.py, passes/activations.py) ----------

def aot_autograd(**kwargs):
    """AOTAutograd as a Dynamo backend (``lowering="aot_eager"``)."""
    from torch._dynamo.backends.common import aot_autograd as _aot_autograd

    return _aot_autograd(**kwargs)


def eager_backward_compile():
    """A context in which AOTAutograd compiles the backward at once, not at its first call."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def fake_mode_of(values):
    """The FakeTensorMode the tensors in ``values`` (nested lists/tuples) belong to, or None.

    The activation passes (passes/activations.py, recompute.py, offload.py) add nodes to
    the partitioned graphs and compute their ``meta["val"]`` under the graphs' own fake
    mode.  Checked against torch 2.13 (``torch._guards.detect_fake_mode``).
    """
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def real_tensors():
    """A context in which tensors are real even inside the partitioner (which runs under
    AOTAutograd's FakeTensorMode): for MEMO's measurements (copy bandwidth, matmul rate)
    and the all-reduce that makes ranks agree on them.  Checked against torch 2.13."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def compile_fx(gm, example_inputs, config_patches):
    """Inductor's entry point, with config patches scoped to this compile."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, config_patches=config_patches)


class _KeyedHook:
    """A hook object Inductor can hash: it pickles as its cache key alone.

    Checked against torch 2.13: Inductor pickles its whole config for the FX
    graph cache key, ``custom_partitioner_fn`` included (it is missing from
    ``_cache_config_ignore_prefix``), so the hook must not drag the compile's
    state (graphs, closures) into that pickle.
    """

    def __init__(self, fn, cache_key: str):
        self.fn, self.cache_key = fn, cache_key

    def __getstate__(self):
        return {"cache_key": self.cache_key}

    def uuid(self):
        return self.cache_key


class LoongPartitioner(_KeyedHook, CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: calls ``fn(joint, inputs, num_fwd_outputs=..., **kw)``."""

    def __call__(self, gm, joint_inputs, **kwargs):
        return self.fn(gm, joint_inputs, **kwargs)


class LoongPostGrad(_KeyedHook, CustomInferenceAwareGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: calls ``fn(graph, is_inference)``."""

    def __call__(self, graph, is_inference):
        self.fn(graph, is_inference)


# --- structured trace logging (inspect.py) -----------------------------------

def trace_artifact(name: str, payload: str, encoding: str = "string") -> None:
    """Emit ``payload`` as a structured-trace artifact (``TORCH_TRACE`` / tlparse)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=lambda: payload)


# --- Inductor memory planning (passes/memory_plan.py) ------------------------
#
# How our offsets reach Inductor (checked against torch 2.13):
# * ``config.memory_planning=True`` makes the wrapper codegen pass its
#   allocation lines through ``codegen.memory_planning.MemoryPlanner``, which
#   joins in-place reuses into ``BufferGroup``s, numbers the steps (a step is
#   one run of allocation/free lines between kernels; live ranges are
#   half-open ``[alloc step, free step)``; within a run frees come before
#   allocations), places the groups in ``AllocationPool``s (one
#   ``torch.empty`` each, created at its first member's allocation and deleted
#   after its last member's free) and emits ``alloc_from_pool(pool, offset, ...)``.
# * ``PythonWrapperCodegen.run_wrapper_ir_passes(is_inference)`` only runs that
#   planner for inference graphs.  Our ``_post_fusion_custom_pass`` (a config
#   entry, so scoped to one ``compile_fx`` and part of the FX-graph cache key
#   through ``uuid()``) runs after fusion, when ``V.graph.wrapper_code`` already
#   exists, and replaces ``run_wrapper_ir_passes`` on that one wrapper object.
# * Our ``MemoryPlanner`` subclass keeps Inductor's handling of graph outputs
#   (each its own pool: a normal allocation, freed with the output) and hands
#   the intermediates of each device to the planner callback, with the bytes
#   everything else holds at each step (the "background": outputs, buffers
#   extern kernels allocate themselves, saved activations and gradients the
#   backward frees, or keeps if the caller holds them: two scenarios) and the
#   steps whose kernels may allocate memory no line shows (fallback kernels
#   and custom ops: their temporaries).  The callback puts each intermediate
#   in one of its pools at an offset, or on its own (its own pool: a normal
#   allocation), or declines; a decline gives the whole graph Inductor's
#   default allocation (no pools at all).

import functools  # noqa: E402 - this section's imports, kept with it

from torch._inductor.custom_graph_pass import CustomSchedulerPass  # noqa: E402


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


def _module_paths(fx_node) -> list[str]:
    """``nn_module_stack`` paths of an fx node; backward nodes carry the forward's stack."""
    stack = fx_node.meta.get("nn_module_stack") or fx_node.meta.get("fwd_nn_module_stack") or {}
    return [path for path, _cls in stack.values()]


def _graph_identity(is_inference: bool) -> tuple[str, str]:
    """AOTAutograd's name for the graph being compiled (``0_forward``) and its kind."""
    context = torch._guards.TracingContext.try_get()
    names = getattr(context, "aot_graph_name", None) if context is not None else None
    name = "_".join(names) if names else ("inference" if is_inference else "graph")
    kind = "inference" if is_inference else ("backward" if "backward" in name else "forward")
    return name, kind


def _graph_positions():
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


def _background_bytes(lines, groups, caller_keeps_inputs: bool) -> tuple[list[int], list[bool]]:
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


def _inductor_own_pools(allocations, output_allocations) -> list[tuple[int, int, int]]:
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


class _Declined(Exception):
    """The planner callback declined a graph: it gets Inductor's default allocation."""


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
        """Inductor's pool planner with the intermediates placed by ``planner(request)``."""

        def __init__(self, wrapper, planner, is_inference):
            super().__init__(wrapper)
            self.planner, self.is_inference = planner, is_inference
            self.lines = []

        def compute_live_ranges(self, lines):
            super().compute_live_ranges(lines)
            self.lines = lines  # converted to pool lines: the background replays them

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
            for request, allocations in self.requests(intermediates, outputs):
                self.planner(request)
                if request.placement is None:
                    raise _Declined(request.graph_name)
                if len(request.placement) != len(allocations):
                    raise RuntimeError(f"memory planner placed {len(request.placement)} of "
                                       f"{len(allocations)} buffers")
                placements.append((allocations, request.placement))
            for block in sorted(outputs, key=lambda x: (x.size_hint, -len(x.live_range))):
                self.pools.allocate_output(block)
            for allocations, placement in placements:
                alone += self.place(allocations, placement)
            for block in alone:  # one pool each: a normal allocation
                block.mark_allocated()
                self.pools.get_pools(block).append(
                    mp.AllocationPool(block.device, mp.TemporalSplit([block]), can_expand=False))
            self.pools.finalize()

        def requests(self, intermediates, outputs):
            """One ``PoolRequest`` per device (an empty one for a graph without
            intermediates, so that the planner reports on it), with its allocations."""
            backgrounds = []
            for caller_keeps_inputs in (False, True):
                background, volatile = _background_bytes(self.lines, intermediates,
                                                         caller_keeps_inputs)
                if background not in backgrounds:
                    backgrounds.append(background)
            every = [g.allocation for g in self.buffer_groups]
            dynamic = None
            if not all(isinstance(a.symbolic_size, (int, sympy.Integer)) for a in every):
                dynamic = "symbolic buffer sizes (dynamic shapes)"
            elif any(a.get_earliest_available() is not None for a in every):
                dynamic = "unbacked buffer sizes"
            name, kind = _graph_identity(self.is_inference)
            positions = _graph_positions()
            devices = list({g.allocation.device: None for g in intermediates}) or \
                [every[0].device if every else None]
            for device in devices:
                groups = [g for g in intermediates if g.allocation.device == device]
                allocations = [g.allocation for g in groups]
                device_outputs = [a for a in outputs if a.device == device]
                yield PoolRequest(
                    graph_name=name, graph_kind=kind, device=str(device),
                    buffers=[PoolBuffer(list(g.names), int(g.allocation.size_hint),
                                        int(g.live_range.begin), int(g.live_range.end),
                                        sorted(((o.name, _module_paths(o))
                                                for o in g.node.get_origins()),
                                               key=lambda o: positions.get(o[0], -1)))
                             for g in groups],
                    steps=len(background), backgrounds=backgrounds, volatile=volatile,
                    outputs=[(int(a.size_hint), int(a.live_range.begin), int(a.live_range.end))
                             for a in device_outputs],
                    inductor_pools=_inductor_own_pools(allocations, device_outputs),
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


def pool_planning_patches(planner, cache_key: str) -> dict:
    """Inductor config patches that place every graph's intermediates with ``planner``.

    ``planner(request: PoolRequest)`` sets ``request.placement`` (one
    ``(pool, offset)`` or ``None`` per ``request.buffers`` entry: a verified
    plan, offsets aligned to Inductor's 64 bytes) or leaves it None to give the
    graph Inductor's default allocation.  Applies to training and inference
    graphs alike; graph inputs and outputs keep their normal allocation.
    Hand the dict to ``compile_fx(config_patches=...)``.
    """
    return {
        "memory_planning": True,
        "memory_pool": "intermediates",
        "_post_fusion_custom_pass": PoolPlanningHook(planner, cache_key),
    }


def _install_pool_planning(wrapper, planner) -> None:
    """Make this one wrapper run pool planning with ``planner``, training graphs included."""
    import types

    from torch._inductor import config
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen, ReuseLine

    if getattr(wrapper, "_loong_pool_planning", False):
        return
    # Only the Python wrapper's planner is replaced (the C++ wrappers have their own).
    if type(wrapper).memory_plan is not PythonWrapperCodegen.memory_plan:
        return
    planner_class = _pool_planner_class()

    def run_wrapper_ir_passes(self, is_inference):
        # Pool planning edits ReuseLines in place: keep what a decline must restore.
        reuse = [(line, line.delete_old) for line in self.lines if isinstance(line, ReuseLine)]
        try:
            self.lines = planner_class(self, planner, is_inference).plan(self.lines)
        except _Declined:
            for line, delete_old in reuse:
                line.delete_old = delete_old
            with config.patch(memory_planning=False):  # Inductor's default: no pools
                PythonWrapperCodegen.run_wrapper_ir_passes(self, is_inference)

    wrapper.run_wrapper_ir_passes = types.MethodType(run_wrapper_ir_passes, wrapper)
    wrapper._loong_pool_planning = True


class PoolPlanningHook(_KeyedHook, CustomSchedulerPass):
    """``_post_fusion_custom_pass``: leaves the nodes alone, hooks this graph's wrapper.

    Module level (and pickled as its cache key only, see ``_KeyedHook``):
    Inductor pickles its config, this entry included, for the FX graph cache key.
    """

    def __call__(self, nodes):
        from torch._inductor.virtualized import V

        _install_pool_planning(V.graph.wrapper_code, self.fn)
        return nodes


def generated_code(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), [source of every graph Inductor generated meanwhile])``."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args, **kwargs)


def measure_peak_bytes(fn):
    """``(fn(), peak)``: the most bytes the CPU allocator held during ``fn`` above what it
    held when ``fn`` started, from the profiler's allocation events (tests, benchmarks)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag.name == "Allocation":
            events.append(node)
    if not events:
        return result, 0
    events.sort(key=lambda n: n.start_time_ns)
    start = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return result, max(n.extra_fields.total_allocated for n in events) - start
