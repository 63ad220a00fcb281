"""Bad inputs raise on every rank, before any collective, naming the fix; nothing hangs.

One spawn of 4 gloo ranks runs every scenario; after each, an all_reduce shows
the ranks are still in step (an error that left one rank inside a collective
would time the test out instead).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loong_compile as lc
from helpers import error_of, still_in_step, tiny_llama
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)


class Attention(torch.nn.Module):
    def __init__(self, with_mask: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.with_mask = with_mask

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        # keys at or after the query: no document/padding/window structure, so never provable
        mask = torch.ones(s, s, dtype=torch.bool).triu() if self.with_mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.with_mask)


def _compile_and_run(options, x, model=None):
    torch._dynamo.reset()
    model = model or Attention()
    return torch.compile(model, backend="loong", options={"lowering": "eager", **options},
                         fullgraph=True)(x)


def scenarios(rank: int, world: int) -> dict[str, tuple[str, bool]]:
    x = torch.randn(2, 4, 16)  # 4 local tokens of a 16-token sequence on hp*cp = 4
    out = {}
    # options differ across ranks: allow_graphs_without_attention on rank 0 only
    out["config_mismatch"] = error_of(lambda: _compile_and_run({"cp": 4, "allow_graphs_without_attention": rank == 0}, x))
    out["config_mismatch_ok"] = still_in_step()
    # the mesh asked for differs across ranks (groups would never match)
    out["mesh_mismatch"] = error_of(lambda: lc.init_mesh(
        hp=2, cp=2, placement="context_first" if rank else "head_first"))
    out["mesh_mismatch_ok"] = still_in_step()
    # a local length no zigzag layout gives: 5 tokens * 4 ranks = 20, not a multiple of 2*cp*hp = 8
    out["seq_not_divisible"] = error_of(lambda: _compile_and_run({"hp": 2, "cp": 2}, torch.randn(2, 5, 16)))
    out["seq_not_divisible_ok"] = still_in_step()
    mesh = lc.init_mesh(hp=2, cp=2)
    out["shard_not_divisible"] = error_of(lambda: lc.shard_batch(torch.zeros(1, 20, dtype=torch.long), None, mesh))
    # a mask the backend cannot prove to be document/padding/window structure: refused
    out["mask"] = error_of(lambda: _compile_and_run({"hp": 2, "cp": 2}, x, Attention(True)))
    out["mask_default"] = error_of(lambda: _compile_and_run({"hp": 2, "cp": 2}, x, Attention(True)))
    out["mask_ok"] = still_in_step()
    # hp*cp does not divide the world
    out["world_not_divisible"] = error_of(lambda: _compile_and_run({"hp": 3}, x))
    out["world_mesh_not_divisible"] = error_of(lambda: lc.init_mesh(hp=3))
    out["world_ok"] = still_in_step()
    # and after all that, a good compile on the same ranks still runs
    out["good"] = tuple(_compile_and_run({"hp": 2, "cp": 2}, x).shape)
    out["dynamic"] = _dynamic_lengths(mesh)
    return out


def _dynamic_lengths(mesh) -> list[tuple[int, float, float]]:
    """mark_dynamic on the sequence: one graph for every length, each exact vs one process."""
    torch._dynamo.reset()
    model = tiny_llama(layers=1, dim=32, ffn=64)
    reports = []
    backend = lc.LoongBackend({"hp": 2, "cp": 2, "lowering": "aot_eager"}, on_report=reports.append)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    results = []
    for seq in (16, 32, 48):
        ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seq))
        shard = lc.shard_batch(ids, ids, mesh)
        torch._dynamo.mark_dynamic(shard.input_ids, 1)
        torch._dynamo.mark_dynamic(shard.position_ids, 1)
        logits = compiled(shard.input_ids, position_ids=shard.position_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), shard.labels.flatten(), ignore_index=-100,
                               reduction="sum") / (2 * (seq - 1))
        dist.all_reduce(loss)
        ref = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        results.append((len({id(r) for r in reports}), loss.item(), ref.item()))
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(scenarios, 4, timeout=600)


EXPECTED = {
    "config_mismatch": ("LoongRankMismatchError", ["options.allow_graphs_without_attention=True on ranks [0]", "fix:"]),
    "mesh_mismatch": ("LoongRankMismatchError", ["placement", "mesh"]),
    "seq_not_divisible": ("LoongShapeError", ["sequence length 20", "multiple of 2*cp*hp = 8", "fix: pad or trim"]),
    "shard_not_divisible": ("LoongShapeError", ["sequence length 20", "e.g. 24"]),
    "mask": ("LoongUnsupportedError", ["attn_mask", "test_rank_safety.py", "fix:"]),
    "mask_default": ("LoongUnsupportedError", ["attn_mask"]),
    "world_not_divisible": ("LoongMeshError", ["world size 4", "multiple of hp*cp", "fix:"]),
    "world_mesh_not_divisible": ("LoongMeshError", ["world size 4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_bad_input_raises_on_every_rank_with_the_fix(results, scenario):
    error_class, fragments = EXPECTED[scenario]
    for rank, out in enumerate(results):
        message = out[scenario]
        assert message.startswith(error_class + ":"), (rank, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)


@pytest.mark.slow
def test_ranks_stay_in_step_and_recover(results):
    for out in results:
        assert all(out[k] is True for k in out if k.endswith("_ok"))
        assert out["good"] == (2, 2, 4, 8)


@pytest.mark.slow
def test_mark_dynamic_sequence_compiles_once_and_stays_exact(results):
    for out in results:
        for graphs, loss, ref in out["dynamic"]:
            assert graphs == 1  # no recompile for a new length
            assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
