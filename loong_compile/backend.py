"""The ``loong`` torch.compile backend: Dynamo graph -> passes -> AOTAutograd -> passes -> Inductor.

Stages (docs/architecture.md has a paragraph on each):

1. ``dynamo``: passes on the Dynamo FX graph (torch IR), e.g. the 2D-Attention rewrite.
2. ``joint`` and ``split``: our partitioner, installed through Inductor's
   ``custom_partitioner_fn`` hook (or AOTAutograd's ``partition_fn`` under
   ``lowering="aot_eager"``), runs the joint-graph passes, PyTorch's min-cut
   partition, then the passes that see the forward and backward graphs together.
3. ``post_grad``: passes on Inductor's post-grad graphs (``post_grad_custom_post_pass``).
4. ``schedule``: passes on Inductor's scheduler nodes before fusion (their order and
   ordering-only holds, ``_compat.inductor.scheduler_patches``), once per compiled graph.
5. Inductor generates the kernels; ``inductor``: passes that place its buffers in memory
   pools (``passes.memory_plan.request.pool_planning_patches``), once per compiled graph.

Every hook is handed to ``compile_fx`` as ``config_patches``, so no global
torch config is changed by a compile.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition

from loong_compile import _compat, shared_lowering
from loong_compile._compat.aot import aot_autograd, rng_state_only_for
from loong_compile._compat.inductor import (
    LoongPartitioner, LoongPostGrad, comm_overlap_patches, compile_fx, inductor_config_value, on_next_output_code,
    scheduler_patches,
)
from loong_compile.checks import inputs as input_checks
from loong_compile.checks import ranks as rank_check
from loong_compile.config import LoongConfig
from loong_compile.errors import LoongConfigError
from loong_compile.hf import versions as transformers_versions
from loong_compile.passes import library_passes, library_source_digest
from loong_compile.passes.attention.input_roles import BALANCED_EXACT, POSITION_INPUTS
from loong_compile.passes.attention.made_positions import MADE_POSITIONS
from loong_compile.passes.fx.aten_ops import is_random
from loong_compile.passes.fx.batch_view import blind_to_the_batch
from loong_compile.passes.loss.sequence_loss import LABELS_SHIFTED, SHIFTED_LABEL_INPUTS
from loong_compile.passes.memory_plan.request import pool_planning_patches
from loong_compile.passes.base import STAGES, GraphPass, PassContext, ScheduleRequest, SplitGraphs, check_contracts
from loong_compile.report import Dumper, GraphReport, PassRecord, overlap

_graph_ids = itertools.count()


class LoongBackend:
    """A Dynamo backend: ``torch.compile(model, backend=LoongBackend(options))``.

    ``backend="loong"`` with ``options=`` builds one of these per compile.  ``passes``
    replaces the library's pass list (tests use it to run small passes of their own);
    ``on_report`` receives each graph's report (``loong_compile.explain`` uses it).
    """

    def __init__(self, options: Mapping[str, Any] | LoongConfig | None = None, *,
                 passes: Sequence[GraphPass] | None = None,
                 on_report: Callable[[GraphReport], None] | None = None):
        self.config = LoongConfig.from_options(options)
        self.passes = list(library_passes() if passes is None else passes)
        self.on_report = on_report
        _check_pass_names(self.passes, self.config)
        self.schedule, self.skipped = _assemble(self.passes, self.config)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with rank_check.compiling():   # a refusal here reaches the other ranks' checks at once
            compile_ = _GraphCompile(self, gm)
            return compile_.run(example_inputs)


def loong_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  options: Mapping[str, Any] | LoongConfig | None = None) -> Callable:
    """The function registered as ``backend="loong"``; ``options`` comes from ``torch.compile``."""
    return LoongBackend(options)(gm, example_inputs)


def _check_pass_names(passes: Sequence[GraphPass], config: LoongConfig) -> None:
    known = {p.name for p in passes}
    for p in passes:
        if p.stage not in STAGES:
            raise LoongConfigError(f"pass {p.name!r} has stage {p.stage!r}",
                                   f"a pass stage is one of {', '.join(STAGES)}",
                                   "set the pass's `stage` attribute to one of those")
    for name in config.disable_passes:
        if name not in known:
            raise LoongConfigError(f"disable_passes names {name!r}",
                                   f"known passes are {', '.join(sorted(known)) or 'none'}",
                                   f"remove {name!r} from disable_passes or fix its spelling")


def _assemble(passes: Sequence[GraphPass], config: LoongConfig) -> tuple[list[GraphPass], list[dict[str, str]]]:
    """The passes that run, in pipeline order, and those skipped with why; checks that each
    running pass's required facts are provided before it (``check_contracts``)."""
    skipped = []
    for p in passes:
        if p.name in config.disable_passes:
            skipped.append({"name": p.name, "stage": p.stage, "reason": "disable_passes"})
        elif not p.enabled(config):
            skipped.append({"name": p.name, "stage": p.stage, "reason": "does not apply to this config"})
    off = {s["name"]: s["reason"] for s in skipped}
    schedule = [p for stage in STAGES for p in passes if p.stage == stage and p.name not in off]
    check_contracts(schedule, off, passes)
    return schedule, skipped


class _GraphCompile:
    """One Dynamo graph through the pipeline: owns its report, dumps and pass context."""

    def __init__(self, backend: LoongBackend, gm: torch.fx.GraphModule):
        self.config = backend.config
        self.gm = gm
        rank_check.announce("options", rank_check.comparable_options(self.config.to_dict()))
        self.mesh = _mesh_for(self.config)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.report = GraphReport(graph_id=next(_graph_ids), rank=rank, config=self.config.to_dict())
        self.dumper = Dumper(self.report, self.config.dump_dir)
        self.on_report = backend.on_report
        self.state: dict[str, Any] = {}
        self._scheduling_kind = "forward"   # the graph Inductor is lowering (set by _post_grad)
        self._post_grad_runs = 0             # lowerings that ran the post_grad stage here
        self._sharing: shared_lowering.SharedLowering | None = None   # set when the ranks agreed
        self.report.skipped.extend(dict(s) for s in backend.skipped)
        self.report.skipped += [{"name": c.name, "stage": "torch", "reason": c.without}
                                for c in _compat.degraded()]
        self.active = {stage: [p for p in backend.schedule if p.stage == stage] for stage in STAGES}
        transformers_versions.warn_if_untested()

    # -- running passes -------------------------------------------------------

    def run_stage(self, stage: str, graph: Any, graph_kind: str) -> None:
        passes = self.active[stage]
        start = time.perf_counter()
        self._dump(stage, graph_kind, "before" if passes else "", graph)
        for p in passes:
            ctx = PassContext(config=self.config, mesh=self.mesh, rank=self.report.rank,
                              graph_id=self.report.graph_id, graph_kind=graph_kind, state=self.state)
            t0 = time.perf_counter()
            summary = p.run(graph, ctx) or {}
            self.report.passes.append(PassRecord(p.name, stage, graph_kind,
                                                 time.perf_counter() - t0, dict(summary)))
        if passes:
            self._dump(stage, graph_kind, "after", graph)
        key = f"{stage}:{graph_kind}"
        self.report.stage_seconds[key] = self.report.stage_seconds.get(key, 0.0) + time.perf_counter() - start
        self._publish()

    def _dump(self, stage: str, graph_kind: str, when: str, graph: Any) -> None:
        if isinstance(graph, SplitGraphs):
            self.dumper.graph(stage, "forward", when, graph.forward)
            self.dumper.graph(stage, "backward", when, graph.backward)
        else:
            self.dumper.graph(stage, graph_kind, when, graph)

    def _publish(self) -> None:
        """Write the report as it grows: the backward graph is compiled lazily, much later."""
        self.dumper.write_report()
        if self.on_report is not None:
            self.on_report(self.report)

    # -- the pipeline ---------------------------------------------------------

    def run(self, example_inputs: Sequence[Any]) -> Callable:
        self.run_stage("dynamo", self.gm, "dynamo")
        self.gm.recompile()
        self._check_ranks_agree()
        facts = input_checks.GraphFacts(
            self.state.get(POSITION_INPUTS, {}), self.state.get(BALANCED_EXACT, False),
            self.state.get(LABELS_SHIFTED, False),
            self.state.get(MADE_POSITIONS, {}).get("inputs", ()),
            self.state.get(SHIFTED_LABEL_INPUTS, ()),
            blind_to_the_batch(self.gm, self.state.get(MADE_POSITIONS, {}).get("inputs", ())))
        compiled, summary = input_checks.checking_inputs(self._lower(example_inputs), self.gm,
                                                         self.mesh, facts)
        if summary is not None:
            self.report.passes.append(PassRecord("input_checks", "dynamo", "dynamo", 0.0, summary))
            self._publish()
        return compiled

    def _lower(self, example_inputs: Sequence[Any]) -> Callable:
        lowering = self.config.lowering
        if lowering == "eager":
            return self.gm.forward
        if lowering == "aot_eager":
            return aot_autograd(
                fw_compiler=self._aot_eager_compiler, bw_compiler=self._aot_eager_compiler,
                partition_fn=self.partition)(self.gm, example_inputs)
        return compile_fx(self.gm, example_inputs, config_patches=self._inductor_patches(),
                          around_lowering=self._around_lowering)

    def _around_lowering(self, kind: str, graph: torch.fx.GraphModule, inputs: Sequence[Any],
                         lower: Callable[[], Any]) -> Any:
        """One graph through Inductor: on its own, or once for the ranks whose graph is equal."""
        if self._sharing is None:
            return lower()

        def lower_and_tell() -> tuple[Any, bool]:
            before = self._post_grad_runs
            return lower(), self._post_grad_runs > before

        compiled = self._sharing.lower(kind, shared_lowering.graph_key(graph, inputs, kind),
                                       lower_and_tell, self.report.passes)
        self._publish()
        return compiled

    def _check_ranks_agree(self) -> None:
        """Before the graph's first collective runs, all ranks confirm they compiled the same."""
        collectives = [_collective_signature(n) for n in self.gm.graph.nodes
                       if n.op == "call_function" and _is_loong_op(n.target)]
        if not collectives or self.mesh is None:  # a single process: no one to agree with
            return
        rank_check.check_agreement(
            "compile", rank_check.compile_fingerprint(self.config.to_dict(), self.gm, collectives),
            self.config.rank_check_timeout, ranks=self.mesh.sp_ranks, per_compile=True)
        if self._shares_lowerings():
            self._sharing = shared_lowering.SharedLowering.start(
                rank_check.current_compile(), self.mesh.sp_ranks, self.mesh.rank,
                self.config.rank_check_timeout)
        self.report.passes.append(PassRecord("rank_check", "dynamo", "dynamo", 0.0, {
            "matched": len(collectives), "changed": 0,
            "result": "all ranks compiled the same graph with the same options"}))
        self._publish()

    def _shares_lowerings(self) -> bool:
        """Ranks lower once for all whose graph is equal (``shared_lowering.py``) when Inductor
        lowers, its FX graph cache is on (the user's Inductor config, ``inductor_options``) and
        can keep every hook of ours (torch >= 2.12), and no dump asks for each rank's stages."""
        cache_on = self.config.inductor_options.get("fx_graph_cache",
                                                    inductor_config_value("fx_graph_cache"))
        return (self.config.lowering == "inductor" and not self.config.dump_dir and bool(cache_on)
                and _compat.has("scheduler_pass_base"))

    @staticmethod
    def _aot_eager_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return make_boxed_func(gm.forward)

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], *,
                  num_fwd_outputs: int, **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """Joint-graph passes, PyTorch's min-cut partition, then the split-graph passes."""
        self.run_stage("joint", joint, "joint")
        joint.recompile()
        kwargs.pop("compiler", None)
        with rng_state_only_for(is_random):   # an attention op without dropout draws nothing
            fw, bw = min_cut_rematerialization_partition(
                joint, joint_inputs, compiler="inductor", num_fwd_outputs=num_fwd_outputs, **kwargs)
        split = SplitGraphs(fw, bw, num_fwd_outputs)
        self.run_stage("split", split, "split")
        split.forward.recompile()
        split.backward.recompile()
        return split.forward, split.backward

    def _inductor_patches(self) -> dict[str, Any]:
        key = self._cache_key()
        patches: dict[str, Any] = {
            "custom_partitioner_fn": LoongPartitioner(self.partition, key),
            "post_grad_custom_post_pass": LoongPostGrad(self._post_grad, key),
            **comm_overlap_patches(),      # every collective's wait as late as its first use
        }
        if self.active["schedule"]:
            # Inductor's scheduler nodes through the schedule stage, before fusion
            patches.update(scheduler_patches(self._schedule, key))
        if self.active["inductor"]:
            patches.update(pool_planning_patches(self._plan_memory, key))
        if (self._sharing is None and self.config.inductor_options.get("fx_graph_cache", True)
                and (self.config.dump_dir or self.active["post_grad"] or self.active["inductor"])):
            # A cache hit skips the passes that run inside Inductor: the dump would miss stages
            # the user asked to see, and their reports (the memory plan's pools, bound and
            # peaks, the overlap read from the generated code) would be missing.  Ranks that
            # share a lowering hit only this compile's entries, and take the leader's records.
            patches["fx_graph_cache"] = False
        taken = sorted(set(self.config.inductor_options) & set(patches))
        if taken:
            raise LoongConfigError(
                f"inductor_options sets {', '.join(map(repr, taken))}",
                "the backend sets these itself for this compile (its passes run through them)",
                f"remove {', '.join(map(repr, taken))} from inductor_options")
        return {**self.config.inductor_options, **patches}

    def _plan_memory(self, request: Any) -> None:
        """One compiled graph's buffers (a ``memory_plan.request.PoolRequest``) through the inductor stage."""
        self.run_stage("inductor", request, request.graph_kind)

    def _post_grad(self, graph: torch.fx.Graph, is_inference: bool) -> None:
        is_backward = any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))
        kind = "inference" if is_inference else ("backward" if is_backward else "forward")
        self._post_grad_runs += 1
        self.run_stage("post_grad", graph, kind)
        self._scheduling_kind = kind
        on_next_output_code(functools.partial(self._record_overlap, kind))

    def _schedule(self, items: list) -> tuple[list[int], list[tuple[int, int]]]:
        """Inductor's scheduler nodes of the graph being lowered, before fusion, through the
        ``schedule`` stage: the order and ordering-only holds its passes chose."""
        request = ScheduleRequest(items)
        self.run_stage("schedule", request, self._scheduling_kind)
        return request.order, request.holds

    def _record_overlap(self, graph_kind: str, code: str) -> None:
        """What Inductor generated for this graph: each async start and the compute kernels
        scheduled before its wait (``loong_compile.report.overlap``)."""
        spans = overlap.overlap_of(code)
        self.dumper.graph("inductor", graph_kind, "code", code)
        self.report.passes.append(PassRecord("overlap", "inductor", graph_kind, 0.0, {
            "matched": len(spans), "changed": 0, "kinds": overlap.summary(spans),
            "spans": [dataclasses.asdict(s) for s in spans]}))
        self._publish()

    def _cache_key(self) -> str:
        """Inductor's caches must see everything our hooks' output depends on: the options,
        the active passes and the library's source (passes, ops, planner, estimator)."""
        h = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode())
        h.update(",".join(p.name for s in STAGES for p in self.active[s]).encode())
        h.update(library_source_digest().encode())
        if self._sharing is not None:   # ranks sharing lowerings: this compile's entries only
            h.update(self._sharing.token.encode())
        return h.hexdigest()


def _is_loong_op(target: Any) -> bool:
    """A call the passes emitted: a function of ``loong_compile.ops`` or a ``loong::`` op."""
    return getattr(target, "__module__", "").startswith("loong_compile.ops") or (
        getattr(target, "namespace", None) == "loong")


def _collective_signature(node: torch.fx.Node) -> dict[str, Any]:
    """What must match across ranks: the op and its sizes (group names differ per rank)."""
    return {"op": node.target.__name__, "node": node.name,
            **{k: v for k, v in node.kwargs.items() if not k.endswith("_group")}}


def _mesh_for(config: LoongConfig) -> Any:
    """The mesh the passes and ops use; None in a single process with hp = cp = 1."""
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized and config.sp == 1:
        return None
    from loong_compile.parallel.mesh import mesh_for_options

    return mesh_for_options(config)
