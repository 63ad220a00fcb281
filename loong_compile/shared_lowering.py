"""Ranks that lower the same graph lower it once: the lowest of them runs Inductor, the others
load its result from Inductor's FX graph cache and take the records of its passes.

Every rank of a sequence compiles the same graph (``checks/ranks.py`` makes sure), and with
the mesh's group names the same on every rank (``parallel/mesh.py``) the graphs Inductor
lowers are equal too, except where a rank's own data is baked in (a scan's first chunk).
Ranks that share a machine's cores (CPU runs, the test suite, a node with fewer spare cores
than ranks) otherwise each pay the whole lowering: four ranks on two cores, twice its time.

For each graph Inductor lowers (the forward; the backward when it first runs; an inference
graph), among the ranks that agreed on the compile:

1. each rank publishes its graph's key: the graph's code, its inputs, the host and the FX
   graph cache's directory (ranks on other machines never wait for one another);
2. the lowest rank of each key lowers; the cache key holds a token of this compile
   (``SharedLowering.token``), so that no other compile, before or after, can load its entry;
3. the others wait for it, then lower: a cache hit, or a lowering of their own when its
   result was not cached (then their own passes ran and their records are their own);
4. the last rank to load it removes the entry (a leader without followers, at once).

A rank whose peers never publish, or whose leader takes longer than ``rank_check_timeout``,
lowers on its own: slower, never wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loong_compile._compat.aot import real_tensors
from loong_compile._compat.distributed import default_store, store_wait
from loong_compile._compat.inductor import drop_fx_graph_cache_entry, fx_graph_cache_entry, fx_graph_cache_key
from loong_compile.report import PassRecord

_PREFIX = "loong_compile/lowering"


def graph_key(graph: torch.fx.GraphModule, inputs: Sequence[Any], kind: str) -> str:
    """What must be equal for one rank's lowering to serve another: the code, the inputs'
    sizes, strides and dtypes, the graph's kind, the machine and the cache directory."""
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return [list(map(str, x.shape)), list(map(str, x.stride())), str(x.dtype), str(x.device)]
        return repr(x)

    text = json.dumps([graph.code, [describe(x) for x in inputs], kind, socket.gethostname(),
                       fx_graph_cache_entry()])
    digest = hashlib.sha256(text.encode())
    # constants the graph holds (a rank's own indices, a mask): equal code, other values
    with real_tensors():        # Inductor lowers under AOTAutograd's fake mode
        for node in graph.graph.find_nodes(op="get_attr"):
            value = getattr(graph, node.target, None)
            if isinstance(value, torch.Tensor):
                digest.update(repr(describe(value)).encode())
                digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclasses.dataclass
class SharedLowering:
    """The ranks of one compile (``index``: ``checks/ranks.py``'s count, the same on each)."""

    index: int
    ranks: list[int]
    rank: int
    timeout: float
    token: str     # in Inductor's cache key: no other compile can load this one's entries

    @classmethod
    def start(cls, index: int, ranks: Sequence[int], rank: int, timeout: float) -> SharedLowering:
        """The ranks' lowerings of compile ``index``; the lowest rank draws the token, the
        others read it from the store."""
        store = default_store()
        key = f"{_PREFIX}/{index}/token"
        if rank == min(ranks):
            store.set(key, uuid.uuid4().hex)
        store_wait(store, [key], timeout)
        return cls(index, list(ranks), rank, timeout, store.get(key).decode())

    def lower(self, kind: str, key: str, lower: Callable[[], tuple[Any, bool]],
              records: list[PassRecord]) -> Any:
        """The compiled graph of ``lower() -> (compiled graph, whether this rank's passes ran)``;
        ``records`` (the report's) gains the leader's records when this rank loaded its
        lowering instead of running the passes, and one ``shared_lowering`` record either way."""
        store = default_store()
        prefix = f"{_PREFIX}/{self.index}/{kind}/"
        store.set(f"{prefix}key/{self.rank}", key)
        try:
            store_wait(store, [f"{prefix}key/{r}" for r in self.ranks], self.timeout)
        except Exception:  # noqa: BLE001 - a store timeout: a rank never lowers this graph
            return self._alone(kind, lower, records, "a rank did not publish its graph")
        same = [r for r in self.ranks if store.get(f"{prefix}key/{r}").decode() == key]
        leader = same[0]
        if leader == self.rank:
            return self._lead(kind, prefix, same, lower, records)
        try:
            store_wait(store, [f"{prefix}done/{leader}"], self.timeout)
        except Exception:  # noqa: BLE001 - a store timeout: the leader is still lowering
            return self._alone(kind, lower, records, f"rank {leader} took longer than {self.timeout:g} s")
        theirs = json.loads(store.get(f"{prefix}done/{leader}").decode())
        compiled, passes_ran = lower()
        loaded = not passes_ran and theirs["key"] is not None
        if loaded:
            records.extend(PassRecord(**r) for r in theirs["records"])
        else:
            _drop(compiled)   # this rank's own entry: no one will load it
        if store.add(f"{prefix}loaded/{leader}", 1) == len(same) - 1 and theirs["key"] is not None:
            drop_fx_graph_cache_entry(theirs["key"])
        records.append(_record(kind, same, leader, loaded, "loaded from Inductor's FX graph cache"
                               if loaded else "lowered here: the leader's lowering was not cached",
                               theirs["key"]))
        return compiled

    def _lead(self, kind: str, prefix: str, same: list[int], lower: Callable[[], tuple[Any, bool]],
              records: list[PassRecord]) -> Any:
        first = len(records)
        done: dict[str, Any] = {"key": None, "records": []}
        try:
            compiled, _ = lower()
            done["key"] = fx_graph_cache_key(compiled)
            done["records"] = [dataclasses.asdict(r) for r in records[first:]]
        finally:
            default_store().set(f"{prefix}done/{self.rank}", json.dumps(done, default=str))
        if len(same) == 1:
            _drop(compiled)   # no one else will load it
        records.append(_record(kind, same, self.rank, False, "lowered here"
                               + (f" for ranks {same[1:]}" if len(same) > 1 else ""), done["key"]))
        return compiled

    def _alone(self, kind: str, lower: Callable[[], tuple[Any, bool]], records: list[PassRecord],
               why: str) -> Any:
        compiled, _ = lower()
        _drop(compiled)
        records.append(_record(kind, [self.rank], self.rank, False, f"lowered here: {why}", None))
        return compiled


def _drop(compiled: Any) -> None:
    key = fx_graph_cache_key(compiled)
    if key is not None:
        drop_fx_graph_cache_entry(key)


def _record(kind: str, same: list[int], leader: int, loaded: bool, result: str,
            cache_key: str | None) -> PassRecord:
    """What the report says: the ranks whose graph was equal, who lowered it, whether this rank
    loaded it, and the (removed) FX graph cache entry it went through."""
    return PassRecord("shared_lowering", "inductor", kind, 0.0, {
        "matched": len(same), "changed": int(loaded), "ranks": same, "lowered_by": leader,
        "result": result, "cache_key": cache_key})
