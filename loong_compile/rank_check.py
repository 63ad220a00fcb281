"""Ranks agree before they communicate: on the mesh they build and on each graph they compile.

A rank that built another mesh or compiled another graph (a different sequence
length, a different option) would issue collectives or create groups that no
other rank matches: a hang, or worse, wrong numbers.  So every rank publishes
what it is about to do in the process group's key-value store, waits for
everybody else's (with a timeout) and compares.  The store is not a process
group, so this never interleaves with the model's own collectives, and a rank
that never arrives is reported instead of waited for forever.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from loong_compile import _compat
from loong_compile.errors import LoongRankMismatchError

DEFAULT_TIMEOUT = 300.0
_rounds: dict[str, itertools.count] = collections.defaultdict(itertools.count)


def check_agreement(topic: str, mine: dict[str, Any], timeout: float = DEFAULT_TIMEOUT) -> None:
    """Raise ``LoongRankMismatchError`` on every rank unless all ranks publish the same ``mine``.

    ``topic`` names what is compared ("mesh", "compile"); each call is one round of it, so
    every rank must make the same calls in the same order.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    store = _compat.default_store()
    round_, rank, world = next(_rounds[topic]), dist.get_rank(), dist.get_world_size()
    prefix = f"loong_compile/{topic}/{round_}/"
    store.set(prefix + str(rank), json.dumps(mine, sort_keys=True, default=str))
    try:
        _compat.store_wait(store, [prefix + str(r) for r in range(world)], timeout)
    except Exception:  # noqa: BLE001 - a store timeout: some rank never got here
        missing = [r for r in range(world) if not store.check([prefix + str(r)])]
        raise LoongRankMismatchError(
            f"rank {rank} reached {topic} #{round_} but ranks {missing} did not within {timeout:.0f} s",
            f"every rank makes the same {topic} calls in the same order (a recompile, e.g. for a "
            "new sequence length, must happen on all ranks)",
            "feed every rank inputs of the same shapes and the same options; see docs/usage.md "
            "(\"Ranks must agree\")") from None
    mine_json = json.loads(json.dumps(mine, sort_keys=True, default=str))
    theirs = {r: json.loads(store.get(prefix + str(r))) for r in range(world)}
    differing = sorted(r for r, other in theirs.items() if other != mine_json)
    if differing:
        other = differing[0]
        raise LoongRankMismatchError(
            f"{topic} #{round_}: rank {rank} and rank {other} differ: "
            f"{_difference(mine_json, theirs[other])} (ranks that differ from rank {rank}: {differing})",
            f"all ranks of a job agree on the {topic} before the first collective",
            "pass identical options (and LOONG_* variables), mesh sizes and same-shaped inputs "
            "on every rank")


def compile_fingerprint(config: dict[str, Any], gm: torch.fx.GraphModule,
                        collectives: list[dict]) -> dict[str, Any]:
    """What ranks compare before a graph runs: options, graph, input shapes, collectives."""
    # str(): a dimension marked dynamic is a SymInt ("s0"), the same symbol on every rank
    shapes = [[str(d) for d in v.shape] if isinstance(v := n.meta.get("example_value"), torch.Tensor)
              else None for n in gm.graph.find_nodes(op="placeholder")]
    comparable = {k: v for k, v in config.items() if k != "dump_dir"}  # a per-rank path may differ
    return {"options": comparable, "input_shapes": shapes, "collectives": collectives,
            "graph": hashlib.sha256(_canonical_code(gm.graph).encode()).hexdigest()}


def _canonical_code(graph: torch.fx.Graph) -> str:
    """The graph's nodes, with process-group names left out: those differ by rank by design."""
    lines = []
    for n in graph.nodes:
        kwargs = {k: v for k, v in n.kwargs.items() if not k.endswith("_group")}
        lines.append(f"{n.name}={n.op}:{getattr(n.target, '__name__', n.target)}({n.args}, {kwargs})")
    return "\n".join(lines)


def _difference(mine: dict, other: dict) -> str:
    """The first field that differs, with both values; nested dicts (options) key by key."""
    for key in sorted(set(mine) | set(other)):
        a, b = mine.get(key), other.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            diffs = [f"{k}={a.get(k)!r} here vs {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if a.get(k) != b.get(k)]
            return f"{key}: " + ", ".join(diffs)
        if key == "graph":
            return "the graph code differs"
        return f"{key}: {a!r} here vs {b!r}"
    return "nothing (equal)"
