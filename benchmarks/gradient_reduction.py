"""Gradient reduction after backward: ``lc.reduce_gradients`` (coalesced buckets, async) vs one
all-reduce per parameter, on gloo ranks (CPU), with the example Llama's parameters.

    python benchmarks/gradient_reduction.py [--world 4] [--hp 2] [--dim 512] [--layers 8] [--reps 20]

Each rank's gradients are random; the time is the median over ``--reps`` of the reduction
alone (after a barrier), the max over ranks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import loong_compile as lc  # noqa: E402
from loong_compile.testing import run_distributed  # noqa: E402


def per_parameter(model, mesh) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= mesh.dp


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=2,
                              ffn_dim=int(8 * args.dim / 3) // 8 * 8))
    mesh = lc.init_mesh(hp=args.hp, cp=world // args.hp // args.dp, dp=args.dp)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ways = {
        "per parameter": lambda: per_parameter(model, mesh),
        "reduce_gradients (25 MiB buckets)": lambda: lc.reduce_gradients(model, mesh),
        "reduce_gradients, check_ranks=False": lambda: lc.reduce_gradients(model, mesh, check_ranks=False),
        "reduce_gradients (1 MiB buckets)": lambda: lc.reduce_gradients(model, mesh, bucket_bytes=2 ** 20),
    }
    times = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, way in ways.items():
            dist.barrier()
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    params = list(model.parameters())
    return {"params": len(params), "mib": sum(p.numel() * 4 for p in params) / 2 ** 20,
            **{name: statistics.median(t) for name, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    results = run_distributed(run, args.world, args, timeout=1200)
    first = results[0]
    print(f"{args.world} ranks (dp={args.dp}, hp={args.hp}), {first['params']} parameters, "
          f"{first['mib']:.1f} MiB of fp32 gradients; median of {args.reps}, max over ranks:")
    print("| reduction | ms |\n|---|---:|")
    for name in results[0]:
        if name not in ("params", "mib"):
            print(f"| {name} | {max(r[name] for r in results) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
