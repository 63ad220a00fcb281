"""Host time of the step's mask plan (ops/masks/blocks.py) at long sequences, one process.

    python benchmarks/mask_plan_time.py [--seq 1048576] [--cp 8] [--mean 16384] [--repeats 3]

The plan is made once per step on the host from one copy of the document ids
(ops/masks/step.py): this is that host work, for documents of random lengths (mean
``--mean``, seeded, as benchmarks/masked_attention.py draws them) in the contiguous order and
in ``shard_batch(balance_documents=True)``'s, where every document spans every layout chunk
and the tiles are also cut where documents meet.  Median of ``--repeats``.  Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loong_compile.ops.masks.blocks import key_intervals, mask_plan

from masked_attention import balanced, packed_documents  # benchmarks/masked_attention.py


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1 << 20)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--mean", type=int, default=1 << 14)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    contiguous = packed_documents(args.seq, args.mean)
    orders = {"contiguous": contiguous, "balanced": balanced(contiguous, args.cp, 1)}
    print(f"S={args.seq} cp={args.cp} {int(contiguous.max()) + 1} documents (mean {args.mean}), "
          f"causal, median of {args.repeats}")
    print(f"{'order':12s} {'plan s':>8s} {'of it: key intervals s':>24s} {'tiles':>6s}")
    for name, ids in orders.items():
        host = ids.numpy()
        plan = mask_plan(host, True, None, args.cp)
        whole = median_seconds(lambda: mask_plan(host, True, None, args.cp), args.repeats)
        part = median_seconds(lambda: key_intervals(host, True, None, args.cp), args.repeats)
        print(f"{name:12s} {whole:8.2f} {part:24.2f} {len(plan.edges) - 1:6d}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
