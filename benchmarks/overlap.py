"""Overlap in Inductor's generated code, and step time, of the example Llama per policy and mesh.

    python benchmarks/overlap.py [--seq 1024] [--steps 5] [--alpha 0.5]

The example Llama (examples/llama.py, its defaults: dim 128, 4 layers, 4 heads, 2 KV heads),
one sequence of ``--seq`` tokens, compiled by Inductor through the ``loong`` backend with
``dump_dir`` set (so the backend reads each graph's generated code: ``loong_compile.report.overlap``).
Configurations: ``none``, ``sc++`` and ``memo`` on one rank, then ``memo`` on 4 gloo ranks at
hp x cp = 2x2, 4x1 and 1x4 (``memo``: the given alpha, every layer swapped), and ``none`` at
2x2 (the all-to-alls without host copies).

For every kind of asynchronous start (offload, reload, a functional collective) in the
forward (fw) and backward (bw) code: how many starts, how many have no compute kernel
between start and wait ("exposed"), and the fewest / median kernels between; for reloads,
how many start after their layer's backward has begun ("late").  Step: the
median over ``--steps`` timed steps (forward + backward + gradient all-reduce), the slowest
rank's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import loong_compile as lc  # noqa: E402
from loong_compile.testing import run_distributed  # noqa: E402

BUDGET = {"host_bandwidth": 1e12, "host_memory": 1e12, "layer_time": 1.0}   # no measuring


def run(rank: int, world: int, hp: int, cp: int, options: dict, args: argparse.Namespace) -> dict:
    from llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    mesh = lc.init_mesh(hp=hp, cp=cp)
    reports = []
    with tempfile.TemporaryDirectory() as dump:
        backend = lc.LoongBackend({"hp": hp, "cp": cp, "dump_dir": dump, **BUDGET, **options},
                                  on_report=reports.append)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(0))
        shard = lc.shard_batch(ids, ids, mesh)

        def step() -> None:
            logits = compiled(shard.input_ids, position_ids=shard.position_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), shard.labels.flatten(), ignore_index=-100,
                                   reduction="sum") / (args.seq - 1)
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            model.zero_grad(set_to_none=True)

        step()   # compiles both graphs
        times = []
        for _ in range(args.steps):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    overlap = {r.graph_kind: r.summary["kinds"] for r in reports[-1].passes if r.name == "overlap"}
    return {"step_s": statistics.median(times), "overlap": overlap}


def rows(overlap: dict) -> list[str]:
    out = []
    for graph_kind, short in (("forward", "fw"), ("backward", "bw")):
        for kind, row in sorted(overlap.get(graph_kind, {}).items()):
            between = row["kernels_between"]
            median = statistics.median(between) if between else "-"
            out.append(f"{short} {kind}: {row['starts']} starts, {row['exposed']} exposed, "
                       f"kernels between min {row['min_kernels_between']} median {median}"
                       + (f", {row['unwaited']} unwaited" if row["unwaited"] else "")
                       + (f", {row['late_prefetches']} late" if "late_prefetches" in row else ""))
    return out or ["no async start"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--only", nargs="*", help="run only these configuration labels")
    args = parser.parse_args()
    memo = {"activations": "memo", "alpha": args.alpha, "resident_layers": 0}
    configs = [("none", 1, 1, 1, {"activations": "none"}), ("sc++", 1, 1, 1, {"activations": "sc++"}),
               ("memo", 1, 1, 1, memo), ("memo 2x2", 4, 2, 2, memo), ("memo 4x1", 4, 4, 1, memo),
               ("memo 1x4", 4, 1, 4, memo), ("none 2x2", 4, 2, 2, {"activations": "none"})]
    print(f"example Llama (dim 128, 4 layers, 4/2 heads), seq {args.seq}, memo alpha {args.alpha} "
          f"with every layer swapped, Inductor, {args.steps} timed steps")
    for label, world, hp, cp, options in configs:
        if args.only and label not in args.only:
            continue
        results = run_distributed(run, world, hp, cp, options, args, timeout=1800)
        step = max(r["step_s"] for r in results)
        print(f"{label:9s} ranks {world}  step {step * 1e3:8.1f} ms  (rank 0) "
              + "; ".join(rows(results[0]["overlap"])), flush=True)


if __name__ == "__main__":
    main()
