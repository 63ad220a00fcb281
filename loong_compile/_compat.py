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
#   joins in-place reuses into ``BufferGroup``s, numbers the steps (live ranges
#   are half-open ``[alloc step, free step)``), places the groups in
#   ``AllocationPool``s and emits ``alloc_from_pool(pool, offset, ...)``.
# * ``PythonWrapperCodegen.run_wrapper_ir_passes(is_inference)`` only runs that
#   planner for inference graphs.  Our ``_post_fusion_custom_pass`` (a config
#   entry, so scoped to one ``compile_fx`` and part of the FX-graph cache key
#   through ``uuid()``) runs after fusion, when ``V.graph.wrapper_code`` already
#   exists, and replaces ``run_wrapper_ir_passes`` on that one wrapper object.
# * Our ``MemoryPlanner`` subclass keeps Inductor's handling of graph outputs
#   (each its own pool: normal allocation, freed with the output) and puts all
#   intermediates of a device in one pool at the offsets the planner returns.

import functools  # noqa: E402 - this section's imports, kept with it

from torch._inductor.custom_graph_pass import CustomSchedulerPass  # noqa: E402


class PoolBuffer:
    """One Inductor ``BufferGroup`` of intermediates, as the planner sees it."""

    __slots__ = ("names", "size", "start", "end", "origins", "device")

    def __init__(self, names, size, start, end, origins, device):
        self.names = names        # the group's buffer names (in-place reuses share a group)
        self.size = size          # bytes (Inductor's size hint)
        self.start = start        # half-open live range [start, end) in planning steps
        self.end = end
        self.origins = origins    # [(fx node name, [nn.Module paths outer->inner])] in graph order
        self.device = device

    def __repr__(self):
        return f"PoolBuffer({self.names}, {self.size} B, [{self.start}, {self.end}))"


class PoolRequest:
    """What one graph's pool planning hands to the planner callback.

    ``outputs`` and ``inductor_pools`` are ``(bytes, start, end)`` triples: the
    graph outputs' own allocations, and the pools Inductor's own heuristic
    would create (outputs' pools included), live from first to last use.
    """

    __slots__ = ("graph_name", "is_inference", "device", "buffers", "outputs",
                 "inductor_pools", "offsets")

    def __init__(self, graph_name, is_inference, device, buffers, outputs, inductor_pools):
        self.graph_name = graph_name
        self.is_inference = is_inference
        self.device = device
        self.buffers = buffers                  # list[PoolBuffer]: the intermediates
        self.outputs = outputs
        self.inductor_pools = inductor_pools
        self.offsets = None                     # the planner's answer, per buffer


def _module_paths(fx_node) -> list[str]:
    """``nn_module_stack`` paths of an fx node; backward nodes carry the forward's stack."""
    stack = fx_node.meta.get("nn_module_stack") or fx_node.meta.get("fwd_nn_module_stack") or {}
    return [path for path, _cls in stack.values()]


def _graph_name(is_inference: bool) -> str:
    """AOTAutograd's name for the graph being compiled (``0_forward``), if any."""
    context = torch._guards.TracingContext.try_get()
    names = getattr(context, "aot_graph_name", None) if context is not None else None
    return "_".join(names) if names else ("inference" if is_inference else "graph")


def _graph_positions():
    from torch._inductor.virtualized import V

    gm = getattr(V.graph, "module", None)
    return {n.name: k for k, n in enumerate(gm.graph.nodes)} if gm is not None else {}


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

        def allocate_groups(self):
            from torch._inductor.utils import _align
            from torch._inductor.virtualized import V

            for group in self.buffer_groups:
                group.make_allocation()
            outputs = [g.allocation for g in self.buffer_groups if g.is_output]
            for block in sorted(outputs, key=lambda x: (x.size_hint, -len(x.live_range))):
                self.pools.allocate_output(block)
            by_device = {}
            for group in self.buffer_groups:
                if not group.is_output:
                    by_device.setdefault(group.allocation.device, []).append(group)
            positions = _graph_positions()
            for device, groups in by_device.items():
                allocations = [g.allocation for g in groups]
                static = all(isinstance(a.symbolic_size, (int, sympy.Integer))
                             and a.get_earliest_available() is None for a in allocations)
                offsets = None
                if static:
                    request = PoolRequest(
                        graph_name=_graph_name(self.is_inference),
                        is_inference=self.is_inference, device=str(device),
                        buffers=[PoolBuffer(list(g.names), int(g.allocation.size_hint),
                                            int(g.live_range.begin),
                                            # a group never freed still lives through the
                                            # kernel after its allocation
                                            max(int(g.live_range.end), int(g.live_range.begin) + 1),
                                            sorted(((o.name, _module_paths(o))
                                                    for o in g.node.get_origins()),
                                                   key=lambda o: positions.get(o[0], -1)),
                                            str(device))
                                 for g in groups],
                        outputs=[(int(a.size_hint), int(a.live_range.begin), int(a.live_range.end))
                                 for a in outputs if a.device == device],
                        inductor_pools=_inductor_own_pools(
                            allocations, [a for a in outputs if a.device == device]))
                    offsets = self.planner(request)
                    if offsets is not None and len(offsets) != len(allocations):
                        raise RuntimeError(f"memory planner returned {len(offsets)} offsets "
                                           f"for {len(allocations)} buffers")
                if offsets is None:  # dynamic sizes, or the planner declined: Inductor's own plan
                    for block in sorted(allocations, key=lambda x: (-x.size_hint, -len(x.live_range))):
                        self.pools.allocate(block)
                    continue
                arena = max(off + _align(a.size_hint) for a, off in zip(allocations, offsets))
                for a in allocations:
                    a.mark_allocated()
                root = mp.TemporalSplit([FixedPlacement(allocations, list(offsets), arena)])
                self.pools.device_to_pools.setdefault(device, []).append(
                    mp.AllocationPool(device, root, can_expand=False))
            self.pools.finalize()

    return LoongMemoryPlanner


def pool_planning_patches(planner, cache_key: str) -> dict:
    """Inductor config patches that place every graph's intermediates with ``planner``.

    ``planner(request: PoolRequest) -> list[int] | None`` returns one byte
    offset per ``request.buffers`` entry (a verified plan; offsets aligned to
    Inductor's 64 bytes) or None to keep Inductor's own pool plan.  Applies to
    training and inference graphs alike; graph inputs and outputs keep their
    normal allocation.  Hand the dict to ``compile_fx(config_patches=...)``.
    """
    return {
        "memory_planning": True,
        "memory_pool": "intermediates",
        "_post_fusion_custom_pass": PoolPlanningHook(planner, cache_key),
    }


def _install_pool_planning(wrapper, planner) -> None:
    """Make this one wrapper run pool planning with ``planner``, training graphs included."""
    import types

    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    if getattr(wrapper, "_loong_pool_planning", False):
        return
    # Only the Python wrapper's planner is replaced (the C++ wrappers have their own).
    if type(wrapper).memory_plan is not PythonWrapperCodegen.memory_plan:
        return
    planner_class = _pool_planner_class()

    def run_wrapper_ir_passes(self, is_inference):
        self.lines = planner_class(self, planner, is_inference).plan(self.lines)

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
