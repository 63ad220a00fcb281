"""Training throughput and memory per rank: 2D-Attention on hp x cp ranks vs one rank, on CPU (gloo).

    python benchmarks/train_step.py [--world 4] [--seq 2048] [--steps 6] [--lowering inductor]

Each configuration runs in its own set of spawned processes (one thread each).
tokens/s counts the global batch (every rank's tokens); the memory figure is the
growth of each rank's peak resident set over the steps (max over ranks), which
on CPU is what the activations and communication buffers add on top of the
process's start-up footprint.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import loong_compile as lc  # noqa: E402
from loong_compile.testing import run_distributed  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(rank: int, world: int, hp: int, cp: int, args: argparse.Namespace) -> dict:
    from llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=2,
                              ffn_dim=int(8 * args.dim / 3) // 8 * 8))
    mesh = lc.init_mesh(hp=hp, cp=cp) if dist.is_initialized() else lc.init_mesh()
    options = {"hp": hp, "cp": cp, "lowering": args.lowering}
    compiled = torch.compile(model, backend="loong", options=options, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    shard = lc.shard_batch(ids, ids, mesh)
    tokens = args.batch * (args.seq - 1)

    def step() -> None:
        logits = compiled(shard.input_ids, position_ids=shard.position_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), shard.labels.flatten(), ignore_index=-100,
                               reduction="sum") / tokens
        loss.backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # compile
    step()
    before = peak_rss_mib()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if dist.is_initialized():
        dist.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    return {"step_s": seconds, "tokens_per_s": args.batch * args.seq / seconds,
            "peak_rss_mib": peak_rss_mib(), "rss_growth_mib": peak_rss_mib() - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lowering", default="inductor")
    args = parser.parse_args()
    configs = [(1, 1, 1)] + [(args.world, hp, args.world // hp)
                             for hp in range(1, args.world + 1) if args.world % hp == 0]
    print(f"Llama dim {args.dim}, {args.layers} layers, 8 heads / 2 KV heads, batch {args.batch} x "
          f"seq {args.seq}, lowering={args.lowering}, {torch.get_num_threads()} threads available")
    print(f"{'ranks':>5} {'hp':>3} {'cp':>3} {'step s':>8} {'tokens/s':>10} {'peak RSS MiB':>13} "
          f"{'RSS growth MiB':>15}")
    for world, hp, cp in configs:
        results = run_distributed(run, world, hp, cp, args, timeout=1800)
        worst = max(results, key=lambda r: r["step_s"])
        print(f"{world:5d} {hp:3d} {cp:3d} {worst['step_s']:8.3f} {worst['tokens_per_s']:10.0f} "
              f"{max(r['peak_rss_mib'] for r in results):13.0f} "
              f"{max(r['rss_growth_mib'] for r in results):15.1f}", flush=True)


if __name__ == "__main__":
    main()
