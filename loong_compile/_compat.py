"""Every use of a private torch API and every torch version difference lives here.

Supported: torch 2.11 to 2.15 (docs/compat.md).  A difference between those
versions is a named ``Capability`` in ``CAPABILITIES`` (what it is, the versions
that have it, what loong_compile does without it), detected by probing torch,
never by comparing version numbers elsewhere.  A missing capability is reported:
``warn_degraded`` warns once per process naming the feature that is off, and the
compile report lists it.  Inductor's memory-pool planning, the largest private
surface, lives in ``_inductor_pools`` and ``_inductor_pool_planner``; its public
names are re-exported at the end of this module.

Longer than most modules (~480 lines) on purpose: one file to read when torch changes.
The capability table and the thin shims are all it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable

import torch

TORCH_VERSION = torch.__version__


# --- capabilities: what differs between the supported torch versions ----------

@dataclasses.dataclass(frozen=True)
class Capability:
    """One torch feature loong_compile uses that not every supported version has."""

    name: str
    what: str             # the torch feature
    versions: str         # the supported versions that have it (a PEP 440 specifier)
    without: str          # what loong_compile does where it is missing (the user sees this)
    probe: Callable[[], bool] = dataclasses.field(repr=False, compare=False)
    degrades: bool = True  # whether a user loses something without it (then it is reported)

    @functools.cached_property
    def available(self) -> bool:
        return bool(self.probe())

    def expected(self, version: str = TORCH_VERSION) -> bool:
        """Whether ``version`` should have it, by the documented range."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(Version(version).base_version) in SpecifierSet(self.versions)


def _has_attr(module: str, *names: str) -> Callable[[], bool]:
    def probe() -> bool:
        import importlib

        try:
            obj = importlib.import_module(module)
        except ImportError:
            return False
        return all(hasattr(obj, n) for n in names)
    return probe


def _inductor_pool_planning_probe() -> bool:
    from torch._inductor import config
    from torch._inductor.codegen import memory_planning, wrapper

    return (hasattr(config, "_post_fusion_custom_pass") and hasattr(config, "memory_pool")
            and hasattr(wrapper.PythonWrapperCodegen, "run_wrapper_ir_passes")
            and hasattr(memory_planning, "MemoryPlanner"))


CAPABILITIES: dict[str, Capability] = {c.name: c for c in [
    Capability(
        "inference_aware_post_grad_pass",
        "torch._inductor.custom_graph_pass.CustomInferenceAwareGraphPass: Inductor tells the "
        "post-grad custom pass whether the graph is an inference graph",
        ">=2.12",
        "the post_grad stage learns the graph's kind from AOTAutograd's graph name "
        "(inference graphs are named so); the stage still runs",
        _has_attr("torch._inductor.custom_graph_pass", "CustomInferenceAwareGraphPass")),
    Capability(
        "inductor_pool_planning",
        "Inductor's wrapper-level memory planner (codegen.memory_planning.MemoryPlanner), "
        "PythonWrapperCodegen.run_wrapper_ir_passes and config._post_fusion_custom_pass",
        ">=2.11",
        "memory_plan=True is off: Inductor allocates as usual; a warning names it and the "
        "compile report lists the inductor stage as skipped",
        _inductor_pool_planning_probe),
    Capability(
        "scheduler_pass_base",
        "torch._inductor.custom_graph_pass.CustomSchedulerPass: the base class of "
        "_post_fusion_custom_pass hooks",
        ">=2.12",
        "nothing a user sees: the memory-plan hook is a plain callable with the same uuid() "
        "(torch 2.11 calls _post_fusion_custom_pass the same way)",
        _has_attr("torch._inductor.custom_graph_pass", "CustomSchedulerPass"),
        degrades=False),
    Capability(
        "unsorted_process_groups",
        "torch.distributed.new_group(ranks, sort_ranks=False): a group keeps the given rank "
        "order, so a ring's neighbours are its list neighbours",
        ">=2.12",
        "groups are built in sorted rank order; a mesh whose rings are not in ascending rank "
        "order (some context_first / inner-ring layouts) is refused with LoongMeshError",
        lambda: "sort_ranks" in inspect.signature(torch.distributed.new_group).parameters,
        degrades=False),
    Capability(
        "dynamo_traces_is_exporting",
        "Dynamo traces torch.compiler.is_exporting() as False under torch.compile "
        "(pytorch#176499); transformers then lets SDPA's is_causal replace its causal mask",
        ">=2.13",
        "transformers builds a causal mask over each rank's tokens under torch.compile; the "
        "attention pass runs it only if passes/mask_proof.py proves it, which is untested on "
        "this torch: use torch >= 2.13 for Hugging Face models at hp*cp > 1; models that call "
        "SDPA with is_causal=True are unaffected",
        lambda: _is_exporting_traced_false(), degrades=False),
    Capability(
        "symbolic_optimization_hint",
        "torch.fx.experimental.symbolic_shapes.optimization_hint: a symbolic size's example "
        "value without adding a guard",
        ">=2.12",
        "nothing a user sees: size_hint reads the same example value (symbolic_shapes.size_hint)",
        _has_attr("torch.fx.experimental.symbolic_shapes", "optimization_hint"),
        degrades=False),
]}


def _is_exporting_traced_false() -> bool:
    def probe(x):
        return x + (1 if torch.compiler.is_exporting() else 0)

    return bool(torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(1)) == 0)


def has(name: str) -> bool:
    """Whether the installed torch has capability ``name`` (a key of ``CAPABILITIES``)."""
    return CAPABILITIES[name].available


def degraded() -> list[Capability]:
    """The capabilities the installed torch lacks that take something from the user."""
    return [c for c in CAPABILITIES.values() if c.degrades and not c.available]


@functools.cache
def warn_degraded(name: str) -> str:
    """Warn (once per process) that capability ``name`` is missing; return the message."""
    c = CAPABILITIES[name]
    message = (f"loong_compile: torch {TORCH_VERSION} lacks {c.name} ({c.what}; torch "
               f"{c.versions} has it): {c.without}. See docs/compat.md.")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message

# --- distributed: process groups by name (ops/, mesh.py) ---------------------

def resolve_process_group(group_name: str):
    """The ProcessGroup registered under ``group_name`` (``ProcessGroup.group_name``).

    Custom-op schemas can only carry primitives, so the 2D-Attention ops take
    group names as strings and resolve them here at run time, the same way
    torch's functional collectives do.  Checked against torch 2.13.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# --- functional collectives (ops/alltoall.py, backend.py) ------------------------

def all_to_all_start(x, group_name: str, group_size: int):
    """``_c10d_functional.all_to_all_single`` of equal splits along dim 0: the exchange in
    flight, to be finished by ``collective_wait``.  In a compiled graph Inductor sees the
    start and the wait as two nodes it can schedule apart.  Checked against torch 2.11-2.15."""
    splits = [x.size(0) // group_size] * group_size
    return torch.ops._c10d_functional.all_to_all_single(x, splits, splits, group_name)


def collective_wait(x):
    """``_c10d_functional.wait_tensor``: the finished result of a functional collective."""
    return torch.ops._c10d_functional.wait_tensor.default(x)


@contextlib.contextmanager
def timed_collective_waits(wrap):
    """Inside, every ``_c10d_functional.wait_tensor`` that generated code (or
    ``collective_wait``) calls runs as ``wrap(wait, tensor)``: Inductor's wrapper looks the op up
    as ``torch.ops._c10d_functional.wait_tensor.default`` at each call, so replacing that
    attribute of the op packet reaches compiled graphs.  Restored on exit.  Checked against
    torch 2.11-2.15."""
    packet = torch.ops._c10d_functional.wait_tensor
    wait = packet.default
    packet.default = functools.partial(wrap, wait)
    try:
        yield
    finally:
        packet.default = wait


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a compiled backward
    graph runs inside it).  Checked against torch 2.11-2.15."""
    return torch._C._current_graph_task_id() != -1


def is_tracing() -> bool:
    """Whether ops run under a tracer (Dynamo, AOTAutograd's fake or proxy modes) rather than
    on real tensors: the functional collectives' own test, so byte counters count only real
    traffic.  Checked against torch 2.13."""
    from torch.distributed._functional_collectives import _are_we_tracing

    return _are_we_tracing()


def comm_overlap_patches(order_schedule=None) -> dict:
    """Inductor options, scoped to one compile: before fusion, ``order_schedule`` (when given)
    orders the scheduler nodes and holds some after others; after it, Inductor's
    ``sink_waits`` puts each functional collective's wait at its first use.  Without them the
    generated code keeps a collective's wait wherever the graph put it.  Checked against
    torch 2.11-2.15.

    ``order_schedule(items) -> (positions, holds)``: ``items`` is one ``(name, kind, op,
    inputs)`` per scheduler node in Inductor's order, ``kind`` "start" (a collective), "wait"
    (its wait), "nop" or "kernel", ``op`` the fallback op's qualified name ("" for generated
    kernels), ``inputs`` the positions of the nodes it depends on (a start's on the start
    before it is Inductor's chaining of collectives); it returns the new order and pairs
    ``(node, other)``: ``node`` must run after ``other`` (an ordering-only dependency, so
    fusion cannot merge across it)."""
    patches: dict = {"reorder_for_compute_comm_overlap": True,
                     "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}
    if order_schedule is not None:
        patches["_pre_fusion_custom_pass"] = functools.partial(_order_scheduler_nodes, order_schedule)
    return patches


def _order_scheduler_nodes(order_schedule, snodes: list) -> list:
    from torch._inductor import ir
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.scheduler import NopKernelSchedulerNode

    if not snodes:
        return snodes
    owner = {buf: i for i, snode in enumerate(snodes) for buf in snode.get_buffer_names()}
    items = []
    for i, snode in enumerate(snodes):
        node = snode.node
        if isinstance(node, ir._WaitKernel):
            kind = "wait"
        elif isinstance(node, ir._CollectiveKernel):
            kind = "start"
        elif isinstance(snode, NopKernelSchedulerNode):
            kind = "nop"
        else:
            kind = "kernel"
        op = getattr(node, "op_overload", None)
        op = str(op).rsplit(".", 1)[0] if isinstance(op, torch._ops.OpOverload) else ""
        inputs = sorted({owner[d.name] for d in snode.unmet_dependencies if owner.get(d.name, i) < i})
        items.append((snode.get_name(), kind, op, tuple(inputs)))
    order, holds = order_schedule(items)
    if not holds and order == list(range(len(snodes))):
        return snodes
    for node, other in holds:
        waiting = next(iter(snodes[node].get_buffer_names()), snodes[node].get_name())
        for buf in snodes[other].get_buffer_names():
            snodes[node].add_fake_dep(WeakDep(buf, mutating_buf=waiting, is_fake=True))
    scheduler = snodes[0].scheduler
    scheduler.nodes = [snodes[p] for p in order]
    scheduler.compute_ancestors()       # fusion reads them to refuse a merge that would cycle
    return scheduler.nodes


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

def sdpa_flash_cpu(q, k, v, is_causal: bool, scale: float, attn_mask=None):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention_for_cpu`` (no dropout);
    ``attn_mask`` is additive, of q's dtype."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def sdpa_flash_cpu_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float,
                            attn_mask=None):
    """``(dq, dk, dv)`` of the CPU flash kernel, given the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


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


# --- process groups in ring order (mesh.py) ----------------------------------

def new_group_in_order(ranks: list[int], desc: str):
    """A process group of ``ranks`` that keeps their order, or one in sorted order where torch
    cannot keep it (``unsorted_process_groups``); the caller checks the order it got."""
    import torch.distributed as dist

    if has("unsorted_process_groups"):
        return dist.new_group(ranks, sort_ranks=False, group_desc=desc)
    return dist.new_group(sorted(ranks), group_desc=desc)


# --- symbolic sizes (passes/activations.py) ----------------------------------

def size_hint(value) -> int:
    """The example value of an int or SymInt, read without adding a guard (a dimension
    marked dynamic stays dynamic)."""
    from torch.fx.experimental import symbolic_shapes

    if has("symbolic_optimization_hint"):
        return symbolic_shapes.optimization_hint(value)
    return symbolic_shapes.size_hint(value)


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


class KeyedHook:
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


def _custom_graph_pass(name: str):
    import torch._inductor.custom_graph_pass as custom_graph_pass

    return getattr(custom_graph_pass, name)


class LoongPartitioner(KeyedHook, _custom_graph_pass("CustomPartitionerFn")):
    """Inductor's ``custom_partitioner_fn``: calls ``fn(joint, inputs, num_fwd_outputs=..., **kw)``."""

    def __call__(self, gm, joint_inputs, **kwargs):
        return self.fn(gm, joint_inputs, **kwargs)


if has("inference_aware_post_grad_pass"):
    class LoongPostGrad(KeyedHook, _custom_graph_pass("CustomInferenceAwareGraphPass")):
        """Inductor's ``post_grad_custom_post_pass``: calls ``fn(graph, is_inference)``."""

        def __call__(self, graph, is_inference):
            self.fn(graph, is_inference)
else:
    class LoongPostGrad(KeyedHook, _custom_graph_pass("CustomGraphPass")):
        """Inductor's ``post_grad_custom_post_pass`` where Inductor does not say whether the
        graph is an inference graph: AOTAutograd's name for it does."""

        def __call__(self, graph):
            warn_degraded("inference_aware_post_grad_pass")
            self.fn(graph, aot_graph_kind(is_inference=False)[1] == "inference")


def aot_graph_kind(is_inference: bool) -> tuple[str, str]:
    """AOTAutograd's name for the graph being compiled (``0_forward``) and its kind
    (``forward``, ``backward`` or ``inference``)."""
    context = torch._guards.TracingContext.try_get()
    names = getattr(context, "aot_graph_name", None) if context is not None else None
    name = "_".join(names) if names else ("inference" if is_inference else "graph")
    inference = is_inference or "inference" in name
    kind = "inference" if inference else ("backward" if "backward" in name else "forward")
    return name, kind


def scheduler_pass_base():
    """Inductor's base class of ``_post_fusion_custom_pass`` hooks (``object`` without the
    ``scheduler_pass_base`` capability)."""
    return _custom_graph_pass("CustomSchedulerPass") if has("scheduler_pass_base") else object


# --- structured trace logging (inspect.py) -----------------------------------

def trace_artifact(name: str, payload: str, encoding: str = "string") -> None:
    """Emit ``payload`` as a structured-trace artifact (``TORCH_TRACE`` / tlparse)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=lambda: payload)


def generated_code(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), [source of every graph Inductor generated meanwhile])``."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args, **kwargs)


def on_next_output_code(callback) -> None:
    """Call ``callback(source)`` with the wrapper code of the next graph Inductor generates
    in this compile, then restore Inductor's hook as it was.  Chains to a hook already set
    (``run_and_get_code``'s), so both see the code.  Checked against torch 2.13:
    ``GraphLowering.save_output_code`` is called once per generated graph (and on an FX graph
    cache hit, with the cached code)."""
    from torch._inductor.graph import GraphLowering

    previous = GraphLowering.__dict__.get("save_output_code")

    def save(code: str) -> None:
        GraphLowering.save_output_code = previous
        if previous is not None:
            previous(code)
        callback(code)

    GraphLowering.save_output_code = save


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


# --- Inductor memory planning (passes/memory_plan.py): re-exported ------------
# Imported last: the planner module subclasses KeyedHook and reads the capabilities.

from loong_compile._inductor_pool_planner import (  # noqa: E402
    PoolPlanningHook,
    install_pool_planning,
    pool_planning_patches,
)
from loong_compile._inductor_pools import PoolBuffer, PoolRequest  # noqa: E402
