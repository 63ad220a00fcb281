"""The examples run as documented: torchrun trains, losses fall, dumps show the rewrite, FSDP2 is exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--dim", "64", "--layers", "2", "--seq", "64", "--batch", "2", "--text-bytes", "200000"]


@pytest.mark.slow
def test_torchrun_hf_llama_trains_and_dumps_the_rewrite(tmp_path):
    dump = tmp_path / "dump"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_hf_llama.py"), *SMALL, "--steps", "8", "--lr", "1e-2",
           "--lowering", "aot_eager", "--dump-dir", str(dump)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.stdout.splitlines() if "loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.5, losses
    for rank in range(4):
        graph_dir = dump / f"rank{rank}" / "graph0"
        rewritten = next(graph_dir.glob("*_dynamo_after.py")).read_text()
        assert rewritten.count("loong_compile_ops_attention_attention_2d_attention_2d(") == 2
        assert "= torch._C._nn.scaled_dot_product_attention(" not in rewritten  # no SDPA left
        report = json.loads((graph_dir / "report.json").read_text())
        (attention,) = [p for p in report["passes"] if p["name"] == "attention_2d"]
        sites = attention["summary"]["changed"]
        assert [s["module"].split(".")[-2:] for s in sites] == [["0", "self_attn"], ["1", "self_attn"]]
        for site in sites:
            assert (site["hp"], site["cp"], site["inner_ring"], site["placement"]) == (2, 2, 1, "head_first")
            assert site["heads"] == 8 and site["kv_heads"] == 2 and site["is_causal"] is True


def _example_losses(rank, world, argv):
    sys.path.insert(0, str(ROOT / "examples"))
    import train_llama

    return train_llama.main(argv)


def _fsdp_example_losses_and_states(rank, world, argv):
    """The example's losses under --fsdp, and what FSDP2 was told about the states' place: the
    number of units it shards, their offload policies, and each parameter's offload flag (what
    FSDP2 reads before each host-to-device and device-to-host copy).  On CPU the shards lie on
    the host either way, so the policy, not a tensor's device, shows --offload-states arrived."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_llama
    import training
    from torch.distributed.fsdp import FSDPModule

    units = []
    shard_with_fsdp2 = training.shard_with_fsdp2

    def recording(*args, **kwargs):
        step = shard_with_fsdp2(*args, **kwargs)
        units.extend(m for m in step.modules() if isinstance(m, FSDPModule))
        return step

    training.shard_with_fsdp2 = recording
    try:   # the ranks are kept for later tests: they get the example back as it was
        losses = train_llama.main(argv)
    finally:
        training.shard_with_fsdp2 = shard_with_fsdp2
    groups = [g for unit in units for g in unit._get_fsdp_state()._fsdp_param_groups]
    policies = {type(g.offload_policy).__name__ for g in groups}
    offloaded = {p.offload_to_cpu for g in groups for p in g.fsdp_params}
    return losses, (len(units), policies, offloaded)


@pytest.mark.slow
@pytest.mark.parametrize("offload", [[], ["--offload-states", "--activations", "full_offload",
                                          "--head-groups", "2"]],
                         ids=["states_on_device", "states_on_host_inputs_on_host"])
def test_fsdp2_on_four_ranks_equals_one_process(monkeypatch, tmp_path, offload):
    """--fsdp: parameters, gradients and optimizer states sharded over dp x cp x hp = 4 ranks;
    the MLPs token-tiled (issue 52: FSDP2's gathered weights are the tiled op's inputs, read by
    every tile, recomputed in the backward after FSDP2 gathered them again).  With
    --offload-states the sharded states are on the host (CPUOffloadPolicy) and the optimizer
    steps there; on CPU its copies are no-ops, and the losses are exact all the same.  With
    them, ``full_offload`` and head groups (the planner's longest-sequence rows, their launch
    line in small): each block, compiled on its own, keeps its input alone and puts it on the
    host, and runs its attention two groups of heads at a time."""
    monkeypatch.setenv("LOONG_TILE_TOKENS", "16")   # the ranks it spawns inherit it
    argv = [*SMALL, "--steps", "4", "--lowering", "aot_eager"]
    reference = run_distributed(_example_losses, 1, argv, timeout=600)[0]
    sharded = run_distributed(_fsdp_example_losses_and_states, 4,
                              [*argv, "--hp", "2", "--cp", "2", "--fsdp", *offload,
                               "--dump-dir", str(tmp_path)], timeout=900)
    losses = [rank_losses for rank_losses, _ in sharded]
    assert all(rank_losses == losses[0] for rank_losses in losses)  # every rank: the same loss
    assert len(reference) == 4
    for got, want in zip(losses[0], reference):
        assert abs(got - want) <= 1e-5 * abs(want), (losses[0], reference)
    # 4 units (2 blocks, the head with the loss, the rest), every one with the policy asked for
    policy = ("CPUOffloadPolicy", True) if offload else ("OffloadPolicy", False)
    for _, (units, policies, offloaded) in sharded:
        assert (units, policies, offloaded) == (4, {policy[0]}, {policy[1]})
    if offload:   # every rank's block graph: one layer, its input alone saved, on the host
        for rank in range(4):
            blocks = [r for r in _reports(tmp_path / f"rank{rank}")
                      if (_summary(r, "activations") or {}).get("layers")]
            assert len(blocks) == 1, [r["graph_id"] for r in blocks]
            (row,) = _summary(blocks[0], "activations")["layers"]
            assert row["input"]["count"] == 1 and row["attention"]["count"] == row["other"]["count"] == 0, row
            offload = _summary(blocks[0], "offload")
            assert offload["host_bytes"] == row["input"]["bytes"] > 0 and offload["device_bytes"] == 0, offload
            (attention,) = _summary(blocks[0], "attention_2d")["changed"]
            assert attention["head_groups"] == 2, attention


def _reports(rank_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(rank_dir.glob("graph*/report.json"))]


def _summary(report: dict, pass_name: str) -> dict | None:
    return next((p["summary"] for p in report["passes"] if p["name"] == pass_name), None)


def test_offload_states_without_fsdp_is_refused():
    """--offload-states places FSDP2's sharded states: alone it would do nothing, so it is refused
    before the mesh, the compilation or the data."""
    import train_llama

    with pytest.raises(ValueError, match="needs --fsdp: add --fsdp or drop --offload-states"):
        train_llama.main([*SMALL, "--steps", "1", "--offload-states"])
