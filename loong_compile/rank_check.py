"""Ranks agree on what they compiled before the first collective of a graph runs.

A rank that compiled another graph (a different sequence length, a different
option) would issue collectives that no other rank matches: a hang, or worse,
wrong numbers.  So after the graph passes ran, every rank publishes a
fingerprint of its compile (the config, the graph's code and input shapes, the
collectives it will issue) in the process group's key-value store, waits for
everybody else's (with a timeout) and compares.  The store is not a process
group, so this check never interleaves with the model's own collectives, and a
rank that never arrives is reported instead of waited for forever.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from loong_compile import _compat
from loong_compile.errors import LoongRankMismatchError

_checks = itertools.count()


def fingerprint(config: dict[str, Any], gm: torch.fx.GraphModule, collectives: list[dict]) -> dict:
    # str(): a dimension marked dynamic is a SymInt ("s0"), the same symbol on every rank
    shapes = [[str(d) for d in v.shape] if isinstance(v := n.meta.get("example_value"), torch.Tensor)
              else None for n in gm.graph.find_nodes(op="placeholder")]
    graph = hashlib.sha256((_canonical_code(gm.graph) + json.dumps(shapes)).encode()).hexdigest()
    comparable = {k: v for k, v in config.items() if k != "dump_dir"}  # a per-rank path may differ
    return {"config": json.loads(json.dumps(comparable, default=str)), "graph": graph,
            "input_shapes": shapes, "collectives": collectives}


def _canonical_code(graph: torch.fx.Graph) -> str:
    """The graph's nodes, with process-group names left out: those differ by rank by design."""
    lines = []
    for n in graph.nodes:
        kwargs = {k: v for k, v in n.kwargs.items() if not k.endswith("_group")}
        lines.append(f"{n.name}={n.op}:{getattr(n.target, '__name__', n.target)}({n.args}, {kwargs})")
    return "\n".join(lines)


def check_same_compile(mine: dict, timeout: float) -> None:
    """Raise ``LoongRankMismatchError`` on every rank unless all ranks compiled what this one did."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    store = _compat.default_store()
    check_id, rank, world = next(_checks), dist.get_rank(), dist.get_world_size()
    prefix = f"loong_compile/rank_check/{check_id}/"
    store.set(prefix + str(rank), json.dumps(mine))
    keys = [prefix + str(r) for r in range(world)]
    try:
        _compat.store_wait(store, keys, timeout)
    except Exception:  # noqa: BLE001 - a store timeout: some rank did not compile this graph
        arrived = [r for r in range(world) if store.check([prefix + str(r)])]
        missing = sorted(set(range(world)) - set(arrived))
        raise LoongRankMismatchError(
            f"rank {rank} compiled a graph (compile #{check_id}) that ranks {missing} did not "
            f"compile within {timeout:.0f} s",
            "every rank compiles the same graphs in the same order (a recompile, e.g. for a new "
            "sequence length, must happen on all ranks)",
            "feed every rank inputs of the same shapes and the same options; see docs/usage.md "
            "on mark_dynamic") from None
    theirs = {r: json.loads(store.get(prefix + str(r))) for r in range(world)}
    differing = {r: _difference(mine, other) for r, other in theirs.items() if other != mine}
    if differing:
        r, what = next(iter(sorted(differing.items())))
        raise LoongRankMismatchError(
            f"rank {rank} and rank {r} compiled different graphs: {what} "
            f"(ranks that differ from rank {rank}: {sorted(differing)})",
            "all ranks of a job compile the same graph with the same options before the first "
            "collective",
            "pass identical options (and LOONG_* variables) and same-shaped inputs on every rank")


def _difference(mine: dict, other: dict) -> str:
    keys = sorted(set(mine["config"]) | set(other["config"]))
    config = [f"{k}={mine['config'].get(k)!r} here vs {other['config'].get(k)!r}"
              for k in keys if mine["config"].get(k) != other["config"].get(k)]
    if config:
        return "options " + ", ".join(config)
    if mine["input_shapes"] != other["input_shapes"]:
        return f"input shapes {mine['input_shapes']} here vs {other['input_shapes']}"
    if mine["collectives"] != other["collectives"]:
        return f"collectives {mine['collectives']} here vs {other['collectives']}"
    return "the graph code differs"
