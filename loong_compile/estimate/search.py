"""Configuration search: which (dp, cp, hp, placement, inner ring, activation policy, ZeRO
stage) fit, and which is fastest.

Only what ``torch.compile(backend="loong")`` runs is searched: every ``dp x cp x hp = gpus``
grid (tp = pp = 1: the backend's mesh; tensor and pipeline parallelism stay in ``loong
estimate``) with both placements and every inner-ring size, the backend's activation
policies (MEMO on a grid of ``alpha`` values) and ZeRO stages 0-3 over ``dp * cp * hp``
(FSDP2, ``step.py``), ZeRO-3 also with its states on the host.  Each is estimated for memory
(the 80% rule: ``MemoryBreakdown.verdict``) and host memory (memo's offloaded activations and
the states on the host, summed over the GPUs of a node, within the same usable fraction of the
node's host memory).  What fits is ranked by predicted
throughput (``step_cost``); what does not is kept with the reason.  Which grids the backend
refuses (sequence, heads, sliding windows shorter than the sequence under ``hp·cp > 1``)
comes from ``loong_compile/parallel/rules.py``, the rules the backend applies.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.cost import LayerCost, layer_cost
from loong_compile.estimate.hardware import HardwareProfile
from loong_compile.estimate.memory import (
    MemoryBreakdown, MemoryOptions, ParallelConfig, category_bytes, estimate_memory,
)
from loong_compile.estimate.models import ModelSpec
from loong_compile.estimate.step import StepCost, step_cost
from loong_compile.parallel.rules import (
    ACTIVATION_POLICIES, PLACEMENTS, divisors, head_group_choices, head_violation,
    sequence_violation,
)

ZERO_STAGES = (0, 1, 2, 3)
# How each ZeRO stage is run around the compiled blocks (examples/training.py runs 0 and 3).
ZERO_LAUNCH = {
    0: "gradients all-reduced over all ranks (examples/training.py without --fsdp)",
    1: "torch.distributed.optim.ZeroRedundancyOptimizer over all ranks, gradients all-reduced",
    2: "fully_shard(block, mesh=world, reshard_after_forward=False) per block",
    3: "fully_shard(block, mesh=world) per block (examples/training.py --fsdp)",
}
HOST_LAUNCH = ("fully_shard(unit, mesh=world, offload_policy=CPUOffloadPolicy()) per block, head and root "
               "(examples/training.py --fsdp --offload-states)")


def model_states_label(zero: int, states_on_host: bool) -> str:
    """How the tables name a ZeRO stage: ``ZeRO-3``, or ``ZeRO-3 + host`` with the states on the host."""
    return f"ZeRO-{zero}" + (" + host" if states_on_host else "")


def model_state_choices(zero_stages: tuple[int, ...], states_on_host: bool):
    """(ZeRO stage, states on the host) pairs searched: every stage on the device and, with
    ``states_on_host``, ZeRO-3 with its shards on the host (the example offloads FSDP2's shards:
    ``--fsdp --offload-states``)."""
    for zero in zero_stages:
        yield zero, False
        if zero == 3 and states_on_host:
            yield zero, True


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A configuration that fits, with its memory and predicted time."""

    config: ParallelConfig
    placement: str
    activations: str
    alpha: float | None
    zero: int
    states_on_host: bool
    memory: MemoryBreakdown
    cost: LayerCost
    step: StepCost

    @property
    def step_s(self) -> float:
        """One micro-batch per DP replica: every layer, the LM head, exposed ZeRO collectives."""
        return self.step.total_s

    @property
    def mfu(self) -> float:
        return self.step.mfu

    @property
    def tokens_per_gpu_s(self) -> float:
        return self.config.micro_batch * self.config.seq / self.config.sp / self.step_s

    @property
    def options(self) -> dict:
        """What to pass as ``torch.compile(..., backend="loong", options=...)``."""
        out = {"hp": self.config.hp, "cp": self.config.cp, "placement": self.placement,
               "inner_ring": self.config.inner_ring, "activations": self.activations}
        if self.config.head_groups > 1:
            out["head_groups"] = self.config.head_groups
        if self.activations == "memo":
            out["alpha"] = self.alpha
        return out

    def launch(self, model_flag: str = "examples/train_llama.py") -> str:
        """A torchrun line for the examples' trainer with these options (flags are the
        LoongConfig keys), and how the ZeRO stage is run."""
        gpus = self.config.gpus
        nodes = f"--nnodes {gpus // 8} --nproc-per-node 8" if gpus > 8 and gpus % 8 == 0 else \
            f"--nproc-per-node {gpus}"
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.options.items())
        fsdp = (" --fsdp" if self.zero == 3 else "") + (" --offload-states" if self.states_on_host else "")
        how = HOST_LAUNCH if self.states_on_host else ZERO_LAUNCH[self.zero]
        return (f"torchrun {nodes} {model_flag} --seq {self.config.seq} --batch {self.config.micro_batch} "
                f"{flags}{fsdp}  # {self.model_states}: {how}")

    @property
    def model_states(self) -> str:
        """``ZeRO-N``, or ``ZeRO-3 + host``."""
        return model_states_label(self.zero, self.states_on_host)

    def describe(self) -> dict:
        return _described(self.config, self.placement, self.activations, self.alpha, self.zero,
                          self.states_on_host)

    def to_dict(self) -> dict:
        return {**self.describe(), "memory": self.memory.to_dict(), "cost": self.cost.to_dict(),
                "step": self.step.to_dict(), "step_s": self.step_s, "mfu": self.mfu,
                "tokens_per_gpu_s": self.tokens_per_gpu_s, "options": self.options, "launch": self.launch()}


def _described(config: ParallelConfig, placement: str, activations: str, alpha: float | None, zero: int,
               states_on_host: bool) -> dict:
    """One searched configuration as ``Candidate.describe`` and ``Pruned.config`` give it."""
    return {"dp": config.dp, "cp": config.cp, "hp": config.hp, "placement": placement,
            "inner_ring": config.inner_ring, "head_groups": config.head_groups,
            "activations": activations, "alpha": alpha, "zero": zero,
            "states_on_host": states_on_host}


@dataclasses.dataclass(frozen=True)
class Pruned:
    """A configuration left out, and why."""

    config: dict
    reason: str


@dataclasses.dataclass(frozen=True)
class Ranking:
    """What ``plan`` found for one model, sequence and GPU count: the configurations that fit,
    fastest first (``ranked``), and those left out with their reasons (``pruned``)."""

    model: ModelSpec
    seq: int
    gpus: int
    hardware: HardwareProfile
    ranked: tuple[Candidate, ...]
    pruned: tuple[Pruned, ...]

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def pruned_reasons(self) -> Counter:
        """How many configurations each kind of reason pruned (the reason's text before ':')."""
        return Counter(p.reason.split(":")[0] for p in self.pruned)

    def to_dict(self, top: int | None = None) -> dict:
        return {"model": self.model.as_dict(), "seq": self.seq, "gpus": self.gpus,
                "hardware": self.hardware.as_dict(),
                "ranked": [c.to_dict() for c in self.ranked[:top]],
                "pruned": [dataclasses.asdict(p) for p in self.pruned],
                "pruned_reasons": dict(self.pruned_reasons())}


def _grids(model: ModelSpec, seq: int, gpus: int, placements, pruned: list[Pruned],
           doc_length: int = 0, meshes=None):
    """Valid (config without policy, placement) pairs; invalid grids go to ``pruned``.
    ``meshes``: only these ``(dp, cp, hp)`` (default: every ``dp x cp x hp = gpus``)."""
    for hp in divisors(gpus):
        for cp in divisors(gpus // hp):
            dp = gpus // (hp * cp)
            if meshes is not None and (dp, cp, hp) not in meshes:
                continue
            grid = {"dp": dp, "cp": cp, "hp": hp}
            # the backend's rules (loong_compile.parallel.rules), as torch.compile(backend="loong") applies them
            refused = [(kind, violation) for kind, violation in (
                ("sequence", sequence_violation(seq, cp, hp)),
                ("heads", head_violation(model.heads, model.kv_heads, hp))) if violation]
            if refused:
                kind, violation = refused[0]
                pruned.append(Pruned(grid, f"{kind}: {violation.what}; rule: {violation.rule}"))
                continue
            # w = cp is the same single ring as w = 1; with hp = 1 or cp = 1 both placements coincide.
            rings = [w for w in divisors(cp) if w < cp] or [1]
            for placement in placements if hp > 1 and cp > 1 else placements[:1]:
                for w in rings:
                    yield ParallelConfig(seq=seq, dp=dp, cp=cp, hp=hp, inner_ring=w,
                                         doc_length=doc_length), placement


def check_search(seq: int, gpus: int, micro_batch: int, policies: tuple[str, ...],
                 placements: tuple[str, ...]) -> None:
    """Raise ``LoongConfigError`` naming the first search argument out of range."""
    for name, value in (("seq", seq), ("gpus", gpus), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LoongConfigError(f"{name}={value!r}", f"{name} must be a positive integer",
                                   f"pass a positive {name}")
    unknown = [x for x in policies if x not in ACTIVATION_POLICIES]
    if unknown or not policies:
        raise LoongConfigError(f"activations={','.join(policies)!r}",
                               f"the backend's policies are {', '.join(ACTIVATION_POLICIES)}",
                               "pass a comma-separated subset of them")
    bad_placements = [x for x in placements if x not in PLACEMENTS]
    if bad_placements or not placements:
        raise LoongConfigError(f"placements={','.join(placements)!r}",
                               f"placements are {', '.join(PLACEMENTS)}", "pass a subset of them")


def screen(model: ModelSpec, seq: int, gpus: int, hardware: HardwareProfile, pruned: list[Pruned], *,
           policies: tuple[str, ...] = ACTIVATION_POLICIES, alphas: tuple[float, ...] = (0.0, 0.5, 1.0),
           zero_stages: tuple[int, ...] = ZERO_STAGES, micro_batch: int = 1,
           placements: tuple[str, ...] = PLACEMENTS, memory_options: MemoryOptions | None = None,
           doc_length: int = 0, meshes=None, states_on_host: bool = True):
    """Every configuration ``plan`` searches at ``seq`` that passes the layout rules and the
    memory rules, as ``(config, placement, policy, alpha, zero, options, memory)``; the others
    go to ``pruned`` with their reason.  ``plan`` ranks what this yields; ``longest_sequence``
    asks it whether anything fits."""
    base = memory_options or MemoryOptions.loongtrain()
    node_gpus = hardware.gpus_in_node(gpus)
    for grid, placement in _grids(model, seq, gpus, placements, pruned, doc_length, meshes):
        config = dataclasses.replace(grid, micro_batch=micro_batch)
        for zero, on_host in model_state_choices(zero_stages, states_on_host):
            for policy in policies:
                for alpha in alphas if policy == "memo" else (None,):
                    options = dataclasses.replace(base, activations=policy, zero=zero, states_on_host=on_host,
                                                  alpha=1.0 if alpha is None else alpha)
                    # the fewest head groups that fit: more run more rounds of collectives (on
                    # one GPU none: attention without a mask stays SDPA there, passes/attention)
                    for groups in (head_group_choices(model.heads, model.kv_heads, config.hp)
                                   if config.sp > 1 else [1]):
                        grouped = dataclasses.replace(config, head_groups=groups)
                        memory = estimate_memory(model, grouped, options, hardware.memory_gib)
                        reason = _memory_reason(memory, node_gpus, hardware.host_memory_gib)
                        if not reason:
                            break
                    if reason:
                        pruned.append(Pruned(_described(grouped, placement, policy, alpha, zero, on_host),
                                             reason))
                        continue
                    yield grouped, placement, policy, alpha, zero, options, memory


def plan(model: ModelSpec, seq: int, gpus: int, hardware: HardwareProfile, *,
         policies: tuple[str, ...] = ACTIVATION_POLICIES, alphas: tuple[float, ...] = (0.0, 0.5, 1.0),
         zero_stages: tuple[int, ...] = ZERO_STAGES, micro_batch: int = 1,
         placements: tuple[str, ...] = PLACEMENTS,
         memory_options: MemoryOptions | None = None, doc_length: int = 0,
         states_on_host: bool = True) -> Ranking:
    """Enumerate, prune and rank.  ``memory_options`` supplies the switches and overheads
    (default ``MemoryOptions.loongtrain()``); its policy, alpha and ZeRO stage are searched.
    ``doc_length``: mean packed document length (0: one document per sequence).
    ``states_on_host``: with ZeRO-3 searched, search it with the states on the host too."""
    check_search(seq, gpus, micro_batch, policies, placements)
    ranked, pruned = [], []
    for config, placement, policy, alpha, zero, options, memory in screen(
            model, seq, gpus, hardware, pruned, policies=policies, alphas=alphas, zero_stages=zero_stages,
            micro_batch=micro_batch, placements=placements, memory_options=memory_options,
            doc_length=doc_length, states_on_host=states_on_host):
        offload = 0.0
        if policy == "memo":
            sizes = category_bytes(model, config, options)
            offload = sizes["input"] + sizes["attention"] + alpha * sizes["other"]
        elif policy == "full_offload":
            offload = category_bytes(model, config, options)["input"]
        cost = layer_cost(model, config, placement, hardware, policy, alpha or 0.0,
                          offload, options.dtype_bytes)
        step = step_cost(model, config, cost, zero, hardware, options.states_on_host)
        ranked.append(Candidate(config, placement, policy, alpha, zero, options.states_on_host, memory,
                                cost, step))
    ranked = _drop_dominated_rings(ranked, pruned)
    ranked.sort(key=lambda x: (-x.tokens_per_gpu_s, x.memory.estimate_gib, placements.index(x.placement)))
    return Ranking(model, seq, gpus, hardware, tuple(ranked), tuple(pruned))


def _drop_dominated_rings(ranked: list[Candidate], pruned: list[Pruned]) -> list[Candidate]:
    """A larger inner ring that is no faster than a smaller one (both hide behind compute) is
    left out in favour of the smaller, simpler one."""
    kept, fastest = [], {}
    for c in sorted(ranked, key=lambda x: x.config.inner_ring):
        key = tuple(v for k, v in c.describe().items() if k != "inner_ring")
        best = fastest.get(key)
        if best is not None and c.step_s >= best.step_s * (1 - 1e-9):
            pruned.append(Pruned(c.describe(), f"dominated: no faster than inner_ring={best.config.inner_ring}"))
            continue
        fastest[key] = c
        kept.append(c)
    return kept


def _memory_reason(memory: MemoryBreakdown, node_gpus: int, host_memory_gib: float) -> str | None:
    """Why ``memory`` does not fit, or None: the GPU's memory rules, then the host's: what the
    ``node_gpus`` GPUs of a node keep on the host within the same usable fraction of its memory."""
    if memory.verdict == "exceeds":
        return (f"memory: {memory.estimate_gib:.2f} GiB estimate, {memory.total_gib:.2f} GiB with "
                f"overheads, over the {memory.capacity_gib:g} GiB GPU")
    if memory.verdict == "near limit":
        return (f"memory (headroom rule): {memory.estimate_gib:.2f} GiB estimate > {memory.limit_gib:.2f} GiB "
                f"= {memory.usable_fraction:g} x {memory.capacity_gib:g} GiB")
    node_host_gib = node_gpus * memory.host_gib
    if node_host_gib > memory.usable_fraction * host_memory_gib:
        return (f"host memory: {node_host_gib:.2f} GiB per node ({node_gpus} GPUs x {memory.host_gib:.2f} GiB "
                f"on the host) > {memory.usable_fraction * host_memory_gib:.2f} GiB "
                f"= {memory.usable_fraction:g} x {host_memory_gib:g} GiB host memory per node")
    return None
