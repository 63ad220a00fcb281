"""One call of a transformers function, as Dynamo traced it: found by its stack trace, run at
compile time on real tensors against a candidate op, replaced by one call of it.  What the scans
stage's passes that match a whole torch fallback share (``gated_delta.py``, ``mamba2.py``: each
a ``FunctionRegionPass`` with its own ``rewrite``), and when they run (``scans_apply``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from loong_compile._compat.aot import real_tensors
from loong_compile.ops.scans.exchange import group_runs
from loong_compile.config import LoongConfig
from loong_compile.parallel.mesh import one_process_mesh
from loong_compile.passes.base import POSITION_INPUTS, SCAN_SITES, Pass, PassContext, add_exact_mixers
from loong_compile.passes.fx.emit import copy_source_meta
from loong_compile.passes.fx.module_paths import module_path
from loong_compile.passes.fx.nodes import example_value
from loong_compile.passes.fx.subgraphs import graph_scopes
from loong_compile.passes.fx.walks import only_returned
from loong_compile.passes.scans.documents import documents_for

# the scans' regions compute in float32 (transformers casts), their ops too: what differs is the
# order of the sums (chunks of other lengths), well inside this; another recurrence is off by O(1)
PROOF_TOLERANCE = 1e-4


# on one rank a scan is rewritten only to reset at documents: where the graph has none, the
# model's own computation is already one process's
ONE_RANK_WITHOUT_DOCUMENTS = "one process and no documents: the model's own scan computes the same"


class NotMatched(Exception):
    """Why a region is left for the token analysis (a sentence)."""


class ScanPass(Pass):
    """The scans stage's passes: under ``hp·cp > 1`` every scan they match is rewritten (the
    exchange between the ranks, and a reset at each document start); on one rank too, where the
    graph has positions (its scans then reset at documents as under hp·cp > 1 and as the kernels
    users run with ``cu_seqlens`` / ``seq_idx``, which transformers' torch fallbacks do not)."""
    stage = "dynamo"
    provides = (SCAN_SITES,)
    uses = (POSITION_INPUTS,)

    def enabled(self, config: LoongConfig) -> bool:
        return True


def scan_mesh(ctx: PassContext) -> Any:
    """The mesh the scans' ops run over (one process's where there is none)."""
    return ctx.mesh if ctx.mesh is not None else one_process_mesh(ctx.config.placement)


class FunctionRegionPass(ScanPass):
    """Each call of ``function`` in the graph and its inline higher-order-op bodies through
    ``rewrite`` into a call of ``op``: its report entry under ``changed``, or why it was left
    under ``kept``."""
    function: str
    op: Callable

    def rewrite(self, graph: torch.fx.Graph, region: list[torch.fx.Node], mesh: Any,
                documents: torch.fx.Node | None) -> dict[str, Any]:
        raise NotImplementedError

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        add_exact_mixers(ctx, SCAN_SITES, (self.op,))
        changed, kept = [], []
        scopes = graph_scopes(gm)
        for scope in scopes:
            regions = function_regions(scope.module.graph, self.function) if scope.inline else []
            for region in regions:
                documents, how = documents_for(gm, ctx, scope, scopes, region[-1])
                if documents is None and ctx.config.sp == 1:
                    kept.append({"module": module_path(region[0]), "reason": ONE_RANK_WITHOUT_DOCUMENTS})
                    continue
                try:
                    changed.append(self.rewrite(scope.module.graph, region, scan_mesh(ctx), documents)
                                   | {"documents": how})
                except NotMatched as why:
                    kept.append({"module": module_path(region[0]), "reason": str(why)})
            if regions:
                scope.module.recompile()
        return {"matched": len(changed) + len(kept), "changed": changed, "kept": kept}


def runs_per_rank(tokens: int, mesh: Any) -> int:
    """The most runs of consecutive tokens a rank scans (its CP shard after the head
    all-to-all): what the state exchange's bytes count."""
    return max(len(r) for r in group_runs(tokens * mesh.hp * mesh.cp, 1, mesh.cp,
                                          [(c, 0) for c in range(mesh.cp)]))


def function_regions(graph: torch.fx.Graph, function: str) -> list[list[torch.fx.Node]]:
    """The nodes of each call of ``function``, in graph order: consecutive nodes of one module
    whose stack trace passes through it."""
    regions, current, path = [], [], None
    for node in graph.nodes:
        # (a placeholder's stack trace is where it was first read: an input, never a member)
        inside = node.op.startswith("call_") and f"in {function}" in (node.meta.get("stack_trace") or "")
        if inside and current and module_path(node) == path:
            current.append(node)
            continue
        if current:
            regions.append(current)
        current, path = ([node], module_path(node)) if inside else ([], None)
    return regions + ([current] if current else [])


def region_inputs(region: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The values a region reads from outside it, in the order it first reads them."""
    members = set(region)
    return list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in members))


def region_exits(region: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The region's nodes that something outside it reads."""
    members = set(region)
    return [n for n in region if any(u not in members for u in n.users)]


def random_values(inputs: list[torch.fx.Node], roles: tuple[str, ...],
                  shaped: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A random value for each input, by role: of its shape, drawn in float64 and shaped by role
    (``shaped``: a decay's sign, a rate's range), then in the input's dtype (the region's own
    casts are constants of its graph: a bf16 model's region casts to bf16)."""
    gen = torch.Generator().manual_seed(0)
    values = {}
    for role, node in zip(roles, inputs):
        like = example_value(node)
        x = torch.randn(like.shape, generator=gen, dtype=torch.float64)
        values[role] = shaped.get(role, lambda v: v)(x).to(like.dtype)
    return values


def run_region(region: list[torch.fx.Node], inputs: dict[torch.fx.Node, Any],
               exit_node: torch.fx.Node) -> Any:
    """The value of ``exit_node`` when the region runs on ``inputs`` (real tensors, no grad)."""
    with real_tensors(), torch.no_grad():
        env = dict(inputs)
        for node in region:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = (getattr(args[0], node.target)(*args[1:], **kwargs)
                         if node.op == "call_method" else node.target(*args, **kwargs))
        return env[exit_node]


def best_reading(got: torch.Tensor, readings: dict[Any, Callable[[], torch.Tensor]],
                 what: str) -> tuple[Any, float]:
    """Which of the candidate computations (a reading of the region's constants each) gives the
    region's value ``got``: ``(key, relative error)`` of the closest, or ``NotMatched`` (the
    region is not ``what``) where none is within ``PROOF_TOLERANCE``."""
    errors = {}
    with real_tensors(), torch.no_grad():
        for key, compute in readings.items():
            want = compute()
            errors[key] = (float((got.double() - want.double()).norm() / want.double().norm())
                           if got.shape == want.shape else float("inf"))
    key = min(errors, key=errors.get)
    if errors[key] > PROOF_TOLERANCE:
        raise NotMatched(f"run on random inputs it is not {what} (relative error {errors[key]:.1e})")
    return key, errors[key]


def replace_region(graph: torch.fx.Graph, region: list[torch.fx.Node], exit_node: torch.fx.Node,
                   target: Any, args: tuple, kwargs: dict) -> torch.fx.Node:
    """``target(*args, **kwargs)`` in the place of ``exit_node``, and the region erased."""
    with graph.inserting_before(exit_node):
        call = graph.call_function(target, args, kwargs)
    # its value is the exit's (the op is not run at compile time: it would exchange with the ranks)
    copy_source_meta(exit_node, call, also=("example_value",))
    exit_node.replace_all_uses_with(call)
    for node in reversed(region):
        graph.erase_node(node)
    return call


CACHE_STATE = "zeros (the recurrent state a cache keeps is for generation, at hp=cp=1)"


def output_and_cached_states(region: list[torch.fx.Node], output_shape: torch.Size
                             ) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The region's one output (the value of ``output_shape``) and the final states it leaves
    only into a cache, or ``NotMatched``."""
    members, exits = set(region), region_exits(region)
    outputs = [n for n in exits if example_value(n).shape == output_shape]
    states = [n for n in exits if n not in outputs]
    if len(outputs) != 1 or not all(_into_cache_only(n, members) for n in states):
        raise NotMatched(f"{len(exits)} values leave it (expected its output, and the final "
                         "state at most into a cache)")
    return outputs[0], states


def zero_cached_states(graph: torch.fx.Graph, region: list[torch.fx.Node],
                       states: list[torch.fx.Node]) -> None:
    """The cache gets zeros for each final state (``CACHE_STATE``)."""
    members = set(region)
    for state in states:
        with graph.inserting_before(state):
            like = example_value(state)
            zeros = graph.call_function(torch.zeros, (tuple(like.shape),),
                                        {"dtype": like.dtype, "device": like.device})
        zeros.meta["example_value"] = like
        for use in [u for u in state.users if u not in members]:
            use.replace_input_with(state, zeros)


def _into_cache_only(state: torch.fx.Node, members: set) -> bool:
    """The final state leaves the region only to be copied into a cache's fresh buffer
    (transformers' ``update_recurrent_state``: ``zeros_like(state).copy_(state)``), which only
    the graph's outputs read."""
    for use in (u for u in state.users if u not in members):
        buffer = use if use.target is torch.zeros_like else (
            use.args[0] if use.op == "call_method" and use.target == "copy_" else None)
        if buffer is None or buffer.target is not torch.zeros_like or not all(
                u.op == "output" or (u.op == "call_method" and u.target == "copy_" and u.args[0] is buffer)
                or only_returned(u, u.graph) for u in buffer.users):
            return False
    return True
