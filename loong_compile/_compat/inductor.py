"""Inductor shims: ``compile_fx``, the hook classes Inductor hashes into its cache key, the
scheduler nodes handed to the ``schedule`` stage, and the code Inductor generated (backend,
report/, tests)."""

from __future__ import annotations

import functools

import torch

from loong_compile._compat import has, warn_degraded
from loong_compile._compat.aot import aot_graph_kind


def compile_fx(gm, example_inputs, config_patches, around_lowering=None):
    """Inductor's entry point, with config patches scoped to this compile.

    ``around_lowering(graph_kind, graph, inputs, lower)``, if given, is called for each graph
    Inductor lowers ("forward", "backward" or "inference": the graph after partitioning, before
    the post-grad passes) and must return ``lower()``'s result (a compiled graph, see
    ``fx_graph_cache_key``).  AOTAutograd's own cache stays off for this compile:
    a hit there would skip the joint and split stages, whose passes must run on every rank.
    Checked against torch 2.11-2.15."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    from torch._inductor.compile_fx import compile_fx_inner

    def inner_compile(graph, inputs, **kwargs):
        kind = ("backward" if kwargs.get("is_backward")
                else "inference" if kwargs.get("is_inference") else "forward")
        return around_lowering(kind, graph, inputs, lambda: compile_fx_inner(graph, inputs, **kwargs))

    with functorch_config.patch(enable_autograd_cache=False):
        if around_lowering is None:
            return _compile_fx(gm, example_inputs, config_patches=config_patches)
        return _compile_fx(gm, example_inputs, inner_compile=inner_compile,
                           config_patches=config_patches)


def inductor_config_value(name: str):
    """Inductor's global config value ``name`` (as ``torch._inductor.list_options()`` names it)."""
    import torch._inductor.config as inductor_config

    return getattr(inductor_config, name)


def fx_graph_cache_key(compiled) -> str | None:
    """The key Inductor's FX graph cache stored (or found) a lowered graph under; None when the
    lowering bypassed the cache.  Checked against torch 2.11-2.15."""
    return getattr(compiled, "_fx_graph_cache_key", None)


def fx_graph_cache_entry(key: str | None = None) -> str:
    """The directory Inductor's FX graph cache keeps ``key``'s entry in on this machine (without
    ``key``: the cache's own directory).  Checked against torch 2.11-2.15."""
    from torch._inductor.codecache import FxGraphCache

    return FxGraphCache._get_tmp_dir() if key is None else FxGraphCache._get_tmp_dir_for_key(key)


def drop_fx_graph_cache_entry(key: str) -> None:
    """Remove what Inductor's FX graph cache keeps under ``key`` (the compiled kernels it points
    to stay in the kernel cache)."""
    import shutil

    shutil.rmtree(fx_graph_cache_entry(key), ignore_errors=True)


@functools.cache
def inductor_option_names() -> frozenset[str]:
    """The names ``compile_fx``'s config patches accept (``cpp.simdlen``, ``max_autotune``, ...)."""
    import torch._inductor

    return frozenset(torch._inductor.list_options())


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


def scheduler_pass_base():
    """Inductor's base class of ``_post_fusion_custom_pass`` hooks (``object`` without the
    ``scheduler_pass_base`` capability)."""
    return _custom_graph_pass("CustomSchedulerPass") if has("scheduler_pass_base") else object


def comm_overlap_patches() -> dict:
    """Inductor options, scoped to one compile: after fusion, Inductor's ``sink_waits`` puts
    each functional collective's wait at its first use.  Without them the generated code keeps
    a collective's wait wherever the graph put it.  Checked against torch 2.11-2.15."""
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}


SCHEDULE_ITEM_KINDS = ("start", "wait", "nop", "kernel")


def scheduler_patches(order_nodes, cache_key: str) -> dict:
    """Inductor options, scoped to one compile, that hand its scheduler nodes, before fusion,
    to ``order_nodes(items) -> (order, holds)`` and apply the answer.

    ``items``: one ``(name, kind, op, inputs)`` per scheduler node in Inductor's order;
    ``kind`` one of ``SCHEDULE_ITEM_KINDS``: "start" (a collective), "wait" (its wait), "nop"
    or "kernel"; ``op`` the fallback op's qualified name ("" for generated kernels);
    ``inputs`` the positions of the nodes it depends on (a start's on the start before it is
    Inductor's chaining of collectives).  The answer: the new order (positions) and pairs
    ``(node, other)``: ``node`` must run after ``other``, an ordering-only dependency (a
    ``WeakDep``) that fusion respects.  Checked against torch 2.11-2.15."""
    return {"_pre_fusion_custom_pass": OrderSchedulerNodes(
        functools.partial(_order_scheduler_nodes, order_nodes), cache_key)}


class OrderSchedulerNodes(KeyedHook, scheduler_pass_base()):
    """Inductor's ``_pre_fusion_custom_pass``, keyed so that its FX graph cache keeps the graphs
    it ordered (on torch < 2.12, without the base class, Inductor bypasses its cache for them)."""

    def __call__(self, snodes):
        return self.fn(snodes)


def _order_scheduler_nodes(order_nodes, snodes: list) -> list:
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
    order, holds = order_nodes(items)
    if not holds and order == list(range(len(snodes))):
        return snodes
    for node, other in holds:
        waiting = next(iter(snodes[node].get_buffer_names()), snodes[node].get_name())
        for buf in snodes[other].get_buffer_names():
            snodes[node].add_fake_dep(WeakDep(buf, mutating_buf=waiting, is_fake=True))
    scheduler = snodes[0].scheduler
    scheduler.nodes = [snodes[p] for p in order]
    # fusion reads the ancestors to refuse a merge that would cycle, and the order for proximity
    for position, snode in enumerate(scheduler.nodes):
        snode.min_order = snode.max_order = position
    _add_held_ancestors(scheduler, [(snodes[node], snodes[other]) for node, other in holds])
    return scheduler.nodes


def _add_held_ancestors(scheduler, holds: list) -> None:
    """The ancestors ``Scheduler.compute_ancestors`` would give once ``holds`` (``(node, other)``:
    ``node`` after ``other``) are dependencies, by adding what is new instead of making them
    all again (quadratic in the nodes: seconds for an 80-layer backward).  One pass in schedule
    order: a held node gains the nodes it now waits for and their ancestors it lacks (a walk
    up that stops at what it has), and every node what its dependencies gained, less what it
    has; what it has, its descendants have too, so only the rest travels on."""
    if not holds:
        return                          # a new order alone leaves every ancestor set as it is
    if len({id(snode.ancestors) for snode in scheduler.nodes}) < len(scheduler.nodes):
        scheduler.compute_ancestors()   # a set shared between nodes must not be updated in place
        return
    by_name = {snode.get_name(): snode for snode in scheduler.nodes}

    def producers(snode) -> list[str]:
        return [scheduler.name_to_buf[dep.name].defining_op_name() for dep in snode.unmet_dependencies]

    added: dict = {}
    for node, other in holds:
        added.setdefault(node, []).append(other.get_name())
    gained: dict[str, list[str]] = {}
    for snode in scheduler.nodes:
        new = {}        # ordered, as compute_ancestors' sets are
        stack = list(reversed(added.get(snode, ())))
        while stack:
            name = stack.pop()
            if name not in snode.ancestors and name not in new:
                new[name] = None
                stack.extend(producers(by_name[name]))
        for producer in producers(snode):
            new.update(dict.fromkeys(n for n in gained.get(producer, ()) if n not in snode.ancestors))
        if new:
            snode.ancestors |= new
            gained[snode.get_name()] = list(new)


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
