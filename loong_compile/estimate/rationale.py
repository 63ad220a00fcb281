"""Why a configuration of a plan ranks where it does (``loong plan --explain N``).

The rank is the order of predicted throughput (tokens per GPU per second; ties: less memory,
then the placement order).  The explanation lists the step time by part for configuration N
and, part by part, what it gains or loses against its neighbours and against #1.
"""

from __future__ import annotations

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.search import Candidate, Ranking


def step_parts(c: Candidate, layers: int) -> dict[str, float]:
    """Seconds per step by part (they sum to ``c.step_s``) of a model with ``layers`` layers."""
    a = c.cost.attention
    return {
        "attention compute + ring (fwd+bwd)": layers * (a.ring_fwd_s + a.ring_bwd_s),
        "SeqAlltoAll (fwd+bwd)": layers * (a.alltoall_fwd_s + a.alltoall_bwd_s),
        "projections (fwd+bwd)": layers * 3 * c.cost.dense_fwd_s,
        "elementwise ops (fwd+bwd)": layers * 3 * c.cost.elementwise_fwd_s,
        "recompute": layers * c.cost.recompute_s,
        "host transfer stalls": layers * c.cost.transfer_stall_s,
        "LM head": c.step.lm_head_s,
        # one key for every stage: a row compares candidates of different ZeRO stages
        "ZeRO collectives not hidden": c.step.exposed_comm_s,
    }


def _label(c: Candidate) -> str:
    d = c.describe()
    alpha = f" alpha={d['alpha']:g}" if d["activations"] == "memo" else ""
    groups = f" head_groups={d['head_groups']}" if d["head_groups"] > 1 else ""
    return (f"dp={d['dp']} cp={d['cp']} hp={d['hp']} {d['placement']} ring={d['inner_ring']}"
            f"{groups} {d['activations']}{alpha} {c.model_states}")


def _versus(c: Candidate, other: Candidate, name: str, layers: int) -> list[str]:
    mine, theirs = step_parts(c, layers), step_parts(other, layers)
    lines = [f"against {name} ({_label(other)}): step {other.step_s:.3f} s, MFU {other.mfu:.1%}; "
             f"difference {c.step_s - other.step_s:+.3f} s, memory {c.memory.estimate_gib - other.memory.estimate_gib:+.2f} GiB"]
    diffs = sorted(((mine[k] - theirs[k], k) for k in mine), key=lambda x: -abs(x[0]))
    lines += [f"    {k}: {d:+.3f} s" for d, k in diffs if abs(d) > 1e-6 * max(c.step_s, 1e-9)][:4]
    if abs(c.step_s - other.step_s) <= 1e-9 * c.step_s:
        lines.append("    same predicted time: ranked by memory, then placement order")
    return lines


def explain_rank(result: Ranking, n: int) -> list[str]:
    """Lines explaining configuration ``n`` (1-based) of ``result.ranked``."""
    if not 1 <= n <= len(result.ranked):
        raise LoongConfigError(f"--explain {n}", f"a rank between 1 and {len(result.ranked)} "
                               "(the configurations that fit)", "pick a row number of the table")
    c = result.ranked[n - 1]
    lines = [f"#{n}: {_label(c)}",
             f"  predicted step {c.step_s:.3f} s (one micro-batch per replica), MFU {c.mfu:.1%}, "
             f"{c.tokens_per_gpu_s:,.0f} tokens/GPU/s",
             f"  memory {c.memory.estimate_gib:.2f} GiB of {c.memory.limit_gib:.2f} usable "
             f"(headroom {c.memory.headroom_gib:.2f} GiB)" + (f"; host {c.memory.host_gib:.2f} GiB per GPU"
                                                              if c.memory.host_gib else ""),
             "  step by part:"]
    layers = result.model.layers
    lines += [f"    {k}: {v:.3f} s" for k, v in step_parts(c, layers).items() if v]
    neighbours = [(0, "#1")] if n > 1 else []
    neighbours += [(n - 2, f"#{n - 1}")] if n > 2 else []
    neighbours += [(n, f"#{n + 1}")] if n < len(result.ranked) else []
    for index, name in neighbours:
        lines += ["  " + x for x in _versus(c, result.ranked[index], name, layers)]
    return lines
