"""Ranks agree before they communicate: on the mesh they build and on each graph they compile.

A rank that built another mesh or compiled another graph (a different sequence
length, a different option) would issue collectives or create groups that no
other rank matches: a hang, or worse, wrong numbers.  So every rank publishes
what it is about to do in the process group's key-value store, waits for
everybody else's (with a timeout) and compares.  The store is not a process
group, so this never interleaves with the model's own collectives, and a rank
that never arrives is reported instead of waited for forever.

The mesh is compared across the world (every rank creates every group); a
compiled graph within the ranks that share a sequence (``hp·cp``), whose
collectives it issues: data-parallel replicas may see other lengths.

Inside a backend compile a waiting rank also looks, every ``POLL_S``, for a peer that will
never come: one that refused this compile (``compiling`` publishes the ``LoongError`` it
raised) or one waiting in another check of it (they asked for different meshes).  Either way
it raises within a second, naming the peer and what it said, instead of waiting out
``rank_check_timeout``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from loong_compile._compat.distributed import default_store, store_wait
from loong_compile.errors import LoongError, LoongRankMismatchError

_rounds: dict[tuple[str, str], int] = collections.defaultdict(int)   # the next round of each
# The compile this rank is in (its count of backend compiles, the same on the ranks of a
# sequence: they compile the same graphs), or None outside one.  Refusals and waits are
# published under it, so a rank never reads one of an earlier compile.
_compiles = itertools.count()
_current_compile: int | None = None
# How often a waiting rank looks for a peer's refusal or a wait on another topic.
POLL_S = 0.5
# what each rank last announced (options, mesh request): named in the error when ranks never meet
ANNOUNCED = ("options", "mesh")


def _store_and_rank():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None, 0
    return default_store(), dist.get_rank()


def announce(topic: str, value: dict[str, Any]) -> None:
    """Publish what this rank is about to use for ``topic`` (one of ``ANNOUNCED``); no waiting.

    A rank that takes another path (a cached mesh, an error of its own) never reaches the
    others' agreement round; what it announced lets their timeout error name the difference.
    """
    store, rank = _store_and_rank()
    if store is not None:
        store.set(f"loong_compile/announced/{topic}/{rank}", _dumps(value))


@contextlib.contextmanager
def compiling():
    """Around one backend compile: a ``LoongError`` raised in it is published for the other
    ranks, whose agreement rounds of the same compile raise at once naming it, instead of
    waiting ``rank_check_timeout`` for a rank that will never come."""
    global _current_compile
    _current_compile = next(_compiles)
    try:
        yield
    except LoongError as error:
        store, rank = _store_and_rank()
        if store is not None:
            store.set(_refusal_key(_current_compile, rank), f"{type(error).__name__}: {error}")
        raise
    finally:
        _current_compile = None


def current_compile() -> int | None:
    """The compile this rank is in (the same count on the ranks of a sequence), or None."""
    return _current_compile


def _refusal_key(index: int, rank: int) -> str:
    return f"loong_compile/refused/{index}/{rank}"


def _waiting_key(index: int, rank: int) -> str:
    return f"loong_compile/waiting/{index}/{rank}"


def check_agreement(topic: str, mine: dict[str, Any], timeout: float,
                    ranks: Sequence[int] | None = None, per_compile: bool = False) -> None:
    """Raise ``LoongRankMismatchError`` on every rank of ``ranks`` (default: the world) unless
    they all publish the same ``mine`` within ``timeout`` seconds.

    ``topic`` names what is compared ("mesh", "compile"); each call is one round of it
    within that set of ranks, so those ranks must make the same calls in the same order.
    ``per_compile``: the round is the compile this rank is in (one check per compile), so a
    rank late to it never meets a peer's check of the next compile, which gave up on this
    one (and published why, which the late rank reads and names).
    """
    store, rank = _store_and_rank()
    if store is None:
        return
    ranks = list(range(dist.get_world_size())) if ranks is None else sorted(ranks)
    if len(ranks) == 1:
        return
    members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    counted = not (per_compile and _current_compile is not None)
    round_ = _rounds[topic, members] if counted else _current_compile
    _rounds[topic, members] += counted
    prefix = f"loong_compile/{topic}/{members}/{round_}/"
    store.set(prefix + str(rank), _dumps(mine))
    try:
        _wait(store, prefix, topic, ranks, rank, timeout)
    except LoongError:
        # a peer refused, or waits in another check, and will never enter this round: leave it
        # as if this rank had not either, so the ranks' rounds stay in step for the next compile
        store.delete_key(prefix + str(rank))
        _rounds[topic, members] -= counted
        raise
    except Exception:  # noqa: BLE001 - a store timeout: some rank never got here
        missing = [r for r in ranks if not store.check([prefix + str(r)])]
        raise LoongRankMismatchError(
            f"rank {rank} reached {topic} #{round_} but ranks {missing} did not within "
            f"{timeout:g} s{_announced_differences(store, ranks)}",
            f"every rank makes the same {topic} calls in the same order (a recompile, e.g. for a "
            "new sequence length, must happen on all ranks)",
            "feed every rank inputs of the same shapes and the same options and mesh sizes; see "
            "docs/usage.md (\"Ranks must agree\")") from None
    mine_json = json.loads(_dumps(mine))
    theirs = {r: json.loads(store.get(prefix + str(r))) for r in ranks}
    if any(other != mine_json for other in theirs.values()):
        raise LoongRankMismatchError(
            f"{topic} #{round_}: the ranks differ: {who_has_what(theirs)}",
            f"all ranks of a job agree on the {topic} before the first collective",
            "pass identical options (and LOONG_* variables), mesh sizes and same-shaped inputs "
            "on every rank")


def _wait(store, prefix: str, topic: str, ranks: list[int], rank: int, timeout: float) -> None:
    """Wait for every rank's key under ``prefix``, looking every ``POLL_S`` (inside a compile)
    for a peer's refusal or a peer waiting on another topic: either raises at once."""
    keys = [prefix + str(r) for r in ranks]
    if _current_compile is None:
        store_wait(store, keys, timeout)
        return
    index, peers = _current_compile, [r for r in ranks if r != rank]
    store.set(_waiting_key(index, rank), topic)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                store_wait(store, keys, max(1e-3, min(POLL_S, deadline - time.monotonic())))
                return
            except Exception:  # noqa: BLE001 - a store timeout: look around, then wait on
                if time.monotonic() >= deadline:
                    raise
            _raise_on_peer(store, index, peers, rank, topic)
    finally:
        store.set(_waiting_key(index, rank), "")   # no longer waiting: no one reads a stale topic


def _raise_on_peer(store, index: int, peers: list[int], rank: int, topic: str) -> None:
    """Raise ``LoongRankMismatchError`` if a peer refused this compile or waits on another
    topic of it (they would never meet)."""
    for r in peers:
        if store.check([_refusal_key(index, r)]):
            refusal = store.get(_refusal_key(index, r)).decode()
            raise LoongRankMismatchError(
                f"rank {rank} waits in the {topic} check, but rank {r} refused this compile: "
                f"{refusal}",
                "a rank that refuses tells the others instead of leaving them waiting",
                f"fix what rank {r} reports (the same error is raised there)")
        key = _waiting_key(index, r)
        if store.check([key]) and (theirs := store.get(key).decode()) not in ("", topic):
            raise LoongRankMismatchError(
                f"rank {rank} waits in the {topic} check and rank {r} in the {theirs} check of the "
                f"same compile{_announced_differences(store, sorted({rank, r}))}",
                "every rank asks for the same mesh with the same options",
                "pass identical options (hp, cp, ...) and mesh sizes on every rank")


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _announced_differences(store, ranks: list[int]) -> str:
    """What ``ranks`` last announced, where they differ (ranks that announced nothing are
    left out): ``"; options: cp=1 on ranks [0], cp=2 on ranks [1]"``."""
    parts = []
    for topic in ANNOUNCED:
        keys = {r: f"loong_compile/announced/{topic}/{r}" for r in ranks}
        values = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
        if who := who_has_what(values):
            parts.append(f"; {topic}: {who}")
    return "".join(parts)


def who_has_what(values: dict[int, dict[str, Any]]) -> str:
    """Each field (nested ones too) on which the ranks differ, with the ranks that have each
    value: ``"hp=2 on ranks [0], hp=4 on ranks [1, 2, 3]"``."""
    flat = {r: dict(_flatten(v)) for r, v in values.items()}
    parts = []
    for field in sorted({f for v in flat.values() for f in v}):
        ranks_of: dict[str, list[int]] = {}
        for r in sorted(flat):
            ranks_of.setdefault(repr(flat[r].get(field)), []).append(r)
        if len(ranks_of) > 1:
            parts.append(", ".join(f"{field}={_short(v)} on ranks {rs}" for v, rs in ranks_of.items()))
    return "; ".join(parts)


def _flatten(value: Any, name: str = ""):
    """``(name, leaf)`` pairs: dicts by key, lists of dicts or lists by index (``shapes[3]``)."""
    if isinstance(value, dict):
        for key, v in value.items():
            yield from _flatten(v, f"{name}.{key}" if name else str(key))
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        for i, v in enumerate(value):
            yield from _flatten(v, f"{name}[{i}]")
    else:
        yield name, value


def _short(text: str, most: int = 40) -> str:
    return text if len(text) <= most else text[:most - 3] + "..."


def compile_fingerprint(config: dict[str, Any], gm: torch.fx.GraphModule,
                        collectives: list[dict]) -> dict[str, Any]:
    """What ranks compare before a graph runs: options, graph, input shapes, collectives."""
    # str(): a dimension marked dynamic is a SymInt ("s0"), the same symbol on every rank
    shapes = [[str(d) for d in v.shape] if isinstance(v := n.meta.get("example_value"), torch.Tensor)
              else None for n in gm.graph.find_nodes(op="placeholder")]
    return {"options": comparable_options(config), "input_shapes": shapes, "collectives": collectives,
            "graph": hashlib.sha256(_canonical_code(gm.graph).encode()).hexdigest()}


def comparable_options(config: dict[str, Any]) -> dict[str, Any]:
    """The options all ranks must share: all but ``dump_dir`` (a per-rank path may differ)."""
    return {k: v for k, v in config.items() if k != "dump_dir"}


def _canonical_code(graph: torch.fx.Graph) -> str:
    """The graph's nodes, with process-group names left out: those differ by rank by design."""
    lines = []
    for n in graph.nodes:
        kwargs = {k: v for k, v in n.kwargs.items() if not k.endswith("_group")}
        lines.append(f"{n.name}={n.op}:{getattr(n.target, '__name__', n.target)}({n.args}, {kwargs})")
    return "\n".join(lines)
