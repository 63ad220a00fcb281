"""Ranks whose graphs are equal lower them once (loong_compile/shared_lowering.py): rank 0
lowers, the others load its lowering from Inductor's FX graph cache, take its records, and the
entry is gone afterwards; the numbers are those of each rank's own lowering."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import sharded_step, tiny_llama, token_ids
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

OPTIONS = {"hp": 2, "cp": 2, "lowering": "inductor", "memory_plan": True,
           "inductor_options": {"cpp.simdlen": 1}}


def _step(rank: int, world: int) -> dict:
    import loong_compile as lc
    from loong_compile._compat.inductor import fx_graph_cache_entry

    mesh = lc.init_mesh(hp=2, cp=2)
    ids = token_ids(seq=32, batch=2)
    out = {}
    for shared, options in ((True, OPTIONS),
                            (False, {**OPTIONS, "inductor_options": {**OPTIONS["inductor_options"],
                                                                     "fx_graph_cache": False}})):
        torch._dynamo.reset()
        loss, grads, report = sharded_step(tiny_llama(layers=1, dim=32), ids, mesh, options)
        out[shared] = {
            "loss": loss, "grads": grads,
            "sharing": {r.graph_kind: r.summary for r in report.passes if r.name == "shared_lowering"},
            "planned": sorted(r.graph_kind for r in report.passes if r.name == "memory_plan")}
    torch.distributed.barrier()   # every rank has loaded: the entries are removed
    keys = {s["cache_key"] for s in out[True]["sharing"].values()}
    out["entries_left"] = [k for k in keys if k is None or os.path.exists(fx_graph_cache_entry(k))]
    return out


@pytest.mark.timeout(600)
def test_ranks_lower_an_equal_graph_once_and_compute_what_their_own_lowering_does():
    results = run_distributed(_step, 4, timeout=540)
    for rank, out in enumerate(results):
        shared, own = out[True], out[False]
        assert set(shared["sharing"]) == {"forward", "backward"}, (rank, shared["sharing"])
        for kind, summary in shared["sharing"].items():
            assert summary["ranks"] == [0, 1, 2, 3] and summary["lowered_by"] == 0, (rank, kind, summary)
            assert summary["changed"] == (rank != 0), (rank, kind, summary)   # loaded, not lowered
        # the memory plan ran inside rank 0's lowering; the others report it from there
        assert shared["planned"] == own["planned"] == ["backward", "forward"], rank
        assert not own["sharing"], (rank, own["sharing"])   # the cache off: each rank lowers
        assert torch.equal(shared["loss"], own["loss"]), rank
        for name, grad in shared["grads"].items():
            assert torch.equal(grad, own["grads"][name]), (rank, name)
        assert out["entries_left"] == [], (rank, out["entries_left"])
