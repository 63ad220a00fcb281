"""The longest sequence that fits (``loong plan --max-seq``), and the configuration that gets there.

Per ``dp x cp x hp`` mesh the backend runs, the lengths it accepts are the multiples of the
layout's sequence divisor (``parallel.rules.sequence_divisor``; of its least common multiple with
``seq_multiple`` when the user wants rounder lengths).  On each mesh, "some configuration
passes ``plan``'s memory rules" (``search.screen``: the estimator's verdict, the usable
fraction, the node's host memory) holds up to a length and not beyond, since every memory term
grows with the sequence; an exponential then binary search over the multiples finds that
length.  The longest over meshes is then planned as ``loong plan --seq`` would plan it, so
what is reported is ``plan``'s ranked configurations at that length.  Memory is the
estimator's, never recomputed here: a change of a term changes the answer with it.
"""

from __future__ import annotations

import dataclasses
import math

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.hardware import HardwareProfile
from loong_compile.estimate.models import ModelSpec
from loong_compile.estimate.search import ZERO_STAGES, Ranking, check_search, plan, screen
from loong_compile.parallel.rules import ACTIVATION_POLICIES, PLACEMENTS, divisors, head_violation, sequence_divisor

# Longer than any sequence a GPU holds; a mesh that still fits there has no memory bound.
SEARCH_LIMIT = 2 ** 40


@dataclasses.dataclass(frozen=True)
class MeshReach:
    """How far one mesh goes: ``longest`` tokens (0: not even ``step``), a multiple of ``step``;
    ``configuration``: the one using the least memory there, ``estimate_gib`` its estimate and
    ``host_gib`` what it keeps on the host, per GPU."""

    dp: int
    cp: int
    hp: int
    step: int
    longest: int
    configuration: dict | None
    estimate_gib: float | None
    host_gib: float | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LongestSequence:
    """``seq``: the longest length any mesh reaches (0 if none fits); ``plan``: ``plan`` at it."""

    seq: int
    meshes: tuple[MeshReach, ...]
    plan: Ranking | None

    def to_dict(self, top: int | None = None) -> dict:
        """``plan``'s dict at ``seq`` (``ranked`` empty when nothing fits) with the reach per mesh."""
        planned = {"ranked": []} if self.plan is None else self.plan.to_dict(top=top)
        return {**planned, "max_seq": self.seq, "meshes": [m.to_dict() for m in self.meshes]}


def longest_sequence(model: ModelSpec, gpus: int, hardware: HardwareProfile, *, seq_multiple: int = 1,
                     policies: tuple[str, ...] = ACTIVATION_POLICIES,
                     alphas: tuple[float, ...] = (0.0, 0.5, 1.0), zero_stages: tuple[int, ...] = ZERO_STAGES,
                     micro_batch: int = 1, placements: tuple[str, ...] = PLACEMENTS, memory_options=None,
                     doc_length: int = 0, states_on_host: bool = True) -> LongestSequence:
    """The longest sequence some configuration of ``plan``'s search fits, per mesh and overall.
    The keyword arguments are ``plan``'s; ``seq_multiple``: report multiples of it only."""
    check_search(seq_multiple, gpus, micro_batch, policies, placements)
    search = dict(policies=policies, alphas=alphas, zero_stages=zero_stages, micro_batch=micro_batch,
                  placements=placements, memory_options=memory_options, doc_length=doc_length,
                  states_on_host=states_on_host)
    meshes = []
    for hp in divisors(gpus):
        if head_violation(model.heads, model.kv_heads, hp):
            continue                        # plan prunes it at every length ("heads")
        for cp in divisors(gpus // hp):
            mesh = (gpus // (hp * cp), cp, hp)
            step = math.lcm(sequence_divisor(cp, hp), seq_multiple)
            meshes.append(_reach(model, gpus, hardware, mesh, step, search))
    seq = max((m.longest for m in meshes), default=0)
    return LongestSequence(seq, tuple(meshes), plan(model, seq, gpus, hardware, **search) if seq else None)


def _reach(model, gpus, hardware, mesh, step, search) -> MeshReach:
    def least_memory(multiple: int):
        """The fitting configuration with the least memory at ``multiple * step`` tokens, or None."""
        fitting = screen(model, multiple * step, gpus, hardware, [], meshes={mesh}, **search)
        return min(fitting, key=lambda x: x[-1].estimate_gib, default=None)

    # `fits`: the most multiples of `step` known to fit (0: none yet); `beyond`: the next to try
    # while doubling, then the fewest known not to fit
    best, fits, beyond = None, 0, 1
    while (found := least_memory(beyond)) is not None:
        best, fits, beyond = found, beyond, 2 * beyond
        if beyond * step > SEARCH_LIMIT:
            raise LoongConfigError(f"dp={mesh[0]} cp={mesh[1]} hp={mesh[2]} still fits at {fits * step} tokens",
                                   "the memory estimate must grow with the sequence",
                                   "check the model and hardware profile (capacity, host memory)")
    while beyond - fits > 1:
        middle = (fits + beyond) // 2
        found = least_memory(middle)
        if found is None:
            beyond = middle
        else:
            best, fits = found, middle
    if best is None:
        return MeshReach(*mesh, step, 0, None, None, None)
    config, placement, policy, alpha, zero, options, memory = best
    described = {"placement": placement, "inner_ring": config.inner_ring,
                 "head_groups": config.head_groups, "activations": policy,
                 "alpha": alpha, "zero": zero, "states_on_host": options.states_on_host}
    return MeshReach(*mesh, step, fits * step, described, memory.estimate_gib, memory.host_gib)
