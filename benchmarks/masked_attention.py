"""Masked 2D-Attention: work and bytes per rank for packed documents and a sliding window.

    torchrun --nproc-per-node 4 benchmarks/masked_attention.py [--seq 4096] [--hp 1]
        [--heads 8] [--kv-heads 8] [--head-dim 64] [--iters 3]

Causal problems at the same S: dense (the Double-Ring), a window of S/8 tokens, and two
mixes of documents of mean length S/8 and S/32 (random lengths, seeded), each in the
contiguous order and in ``shard_batch(balance_documents=True)``'s (every document dealt
head/tail over the CP ranks; the row's last documents dropped to leave the room its padding
needs).  Per
rank: attention FLOPs executed (forward + backward, ``14·B·H·D`` per computed
(query, key) pair: the cropped blocks the kernel runs, or for the ring the
causal-skipping blocks of ops/attention/ring.py), P2P bytes sent (forward + backward,
from the ops' counters), and the ideal of each: the pairs the mask allows and
the KV chunks of this rank that other ranks' allowed pairs read (sent as KV
forward and backward, dK/dV back in the accumulation dtype); the received KV
bytes alive at once (the steps of ops/attention/masked.py: two at most; the Double-Ring's
two chunks), beside what posting every receive at once would hold; and the
busiest rank's allowed work over the mean.  The median fwd+bwd time (slowest
rank) is beside them.  Asserts nothing: a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from loong_compile.parallel.tokens import local_token_indices, mesh_token_indices
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import attention_2d, comm_counters, reset_comm_counters
from loong_compile.ops.attention.kernels import accumulation_dtype
from loong_compile.ops.masks.documents import number_documents
from loong_compile.ops.masks.blocks import key_intervals, mask_plan
from loong_compile.parallel.balance import balanced_order
from loong_compile.ops.attention.ring import block_plan

from attention_2d import timed  # benchmarks/attention_2d.py: median of the slowest rank's times

FLOPS_PER_PAIR = 14  # per (query, key) pair and head dim: 4 forward + 10 backward (recompute)


def packed_documents(seq: int, mean: int, seed: int = 0) -> torch.Tensor:
    """``(1, S)`` ids of documents with lengths uniform in [1, 2·mean-1] (mean ``mean``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(1, 2 * mean, (1,), generator=gen)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:seq].unsqueeze(0)


def balanced(ids: torch.Tensor, cp: int, hp: int) -> torch.Tensor:
    """The ids of ``shard_batch(..., balance_documents=True)``'s order of these documents: the
    row's last documents are dropped until every document padded to a multiple of ``2·cp``
    fits (the data loader's room), then dealt head/tail (parallel/balance.py) and numbered from
    the positions as ``sequence_document_ids`` numbers them."""
    seq = ids.size(1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    used = seq
    while True:
        first = torch.nonzero(starts[0, :used]).flatten().tolist()
        sizes = [b - a for a, b in zip(first, first[1:] + [used])]
        if sum(-(-n // (2 * cp)) * 2 * cp for n in sizes) <= seq:
            break
        used = first[-1]
    real = (torch.arange(seq) < used).expand_as(ids)
    order = balanced_order(starts & real, real, cp)
    return number_documents(order.positions, None, hp, cp)


def ring_pairs(seq: int, cp: int, cp_rank: int) -> int:
    """(query, key) pairs the causal Double-Ring computes on one CP rank (kernel skips above
    the diagonal of its own block)."""
    local, half = seq // cp, seq // (2 * cp)
    pairs = 0
    for owner in range(cp):
        rows, cols, causal = block_plan(True, cp_rank, owner, half)
        n_rows = len(range(local)[rows])
        n_cols = len(range(local)[cols])
        pairs += n_rows * (n_rows + 1) // 2 if causal else n_rows * n_cols
    return pairs


def masked_figures(ids: torch.Tensor, window: int | None, cp: int, cp_rank: int):
    """(pairs computed, pairs allowed, KV columns of this rank sent, ideal KV columns sent,
    KV columns received that are alive at once: now, and if every receive were posted at once)."""
    plan = mask_plan(ids, True, window, cp)
    computed = sum((b.rows[1] - b.rows[0]) * (b.cols[1] - b.cols[0])
                   for b in plan.ranks[cp_rank].blocks) * ids.size(0)
    lo, hi, _ = key_intervals(ids, True, window, cp)
    rows = local_token_indices(ids.size(1), cp, 1, cp_rank, 0).numpy()
    allowed = int((hi[:, rows] - lo[:, rows] + 1).clip(min=0).sum())
    columns = sum(stop - start for ranges in plan.serves(cp_rank).values()
                  for start, stop in ranges)
    chunk = ids.size(1) // (2 * cp)
    chunk_plan = mask_plan(ids, True, window, cp, tiles_per_chunk=1)
    ideal_columns = chunk * sum(len(ranges) for ranges in chunk_plan.serves(cp_rank).values())
    # ops/attention/masked.py's steps: step d receives from rank r + d while step d + 1 travels
    step_columns = [sum(stop - start for start, stop in
                        plan.ranks[cp_rank].needs.get((cp_rank + d) % cp, ()))
                    for d in range(1, cp)] + [0]
    held = max(a + b for a, b in zip(step_columns, step_columns[1:])) if cp > 1 else 0
    return computed, allowed, columns, ideal_columns, held, sum(step_columns)


def run(args, mesh, ids, window):
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    index = mesh_token_indices(args.seq, mesh)
    q, k, v, dout = (torch.randn(s, generator=gen)[:, :, index].contiguous()
                     for s in (shape, kv_shape, kv_shape, shape))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    sent = {}

    def step():
        reset_comm_counters()
        out = attention_2d(*leaves, is_causal=True, document_ids=ids, window=window,
                           **mesh.attention_kwargs())
        torch.autograd.grad(out, leaves, dout)
        sent["p2p"] = comm_counters()["p2p"]

    step()
    return 1e3 * timed(step, args.iters), sent["p2p"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hp", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_mesh(hp=args.hp, cp=world // args.hp)
    cp, cp_rank = mesh.cp, mesh.cp_rank
    heads_per_rank = args.heads // args.hp
    kv_per_rank = max(args.kv_heads, args.hp) // args.hp
    per_pair = FLOPS_PER_PAIR * heads_per_rank * args.head_dim
    elem = 4
    column_bytes = 2 * args.batch * kv_per_rank * args.head_dim  # K and V, per element size
    per_column = column_bytes * (2 * elem + accumulation_dtype(torch.float32).itemsize)
    problems = {"dense causal": (None, None), "window S/8": (None, args.seq // 8)}
    mixes = {}
    for mean in (8, 32):
        documents = packed_documents(args.seq, args.seq // mean).expand(args.batch, -1)
        mixes[mean] = int(documents[0].max()) + 1
        problems[f"documents S/{mean}"] = (documents, None)
        if cp > 1:
            problems[f"documents S/{mean} balanced"] = (balanced(documents, cp, args.hp), None)
    rows = []
    for name, (ids, window) in problems.items():
        ms, sent = run(args, mesh, ids, window)
        full_ids = torch.zeros(args.batch, args.seq, dtype=torch.long) if ids is None else ids
        pairs, allowed, _, ideal_columns, held, all_at_once = masked_figures(full_ids, window,
                                                                             cp, cp_rank)
        held_bytes = (held, all_at_once)
        if ids is None and window is None:  # the Double-Ring ran, not the plan: 2 KV chunks
            pairs = ring_pairs(args.seq, cp, cp_rank) * args.batch
            held_bytes = (2 * args.seq // cp, 2 * args.seq // cp)
        ideal_sent = per_column * ideal_columns
        held_bytes = tuple(column_bytes * elem * c for c in held_bytes)
        rows.append((name, cp_rank, pairs * per_pair, allowed * per_pair, sent, ideal_sent, ms,
                     *held_bytes))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        docs = "; ".join(f"S/{mean}: {n} documents (mean {args.seq / n:.0f} tokens)"
                         for mean, n in mixes.items())
        print(f"world={world} hp={args.hp} cp={cp} gloo S={args.seq} B={args.batch} "
              f"H={args.heads} H_kv={args.kv_heads} D={args.head_dim} float32 causal; "
              f"{docs}; window {args.seq // 8}; median of {args.iters}; balanced: "
              "shard_batch(balance_documents=True)'s order")
        print(f"{'problem':20s} {'rank':>4s} {'GFLOP':>8s} {'ideal':>8s} {'x':>5s} "
              f"{'MB sent':>8s} {'ideal':>8s} {'x':>5s} {'KV MB held':>10s} {'at once':>8s} "
              f"{'fwd+bwd ms':>10s}")
        for rank_rows in zip(*gathered):
            for name, rank, flops, ideal, sent, ideal_sent, ms, held, at_once in rank_rows:
                ratio = sent / ideal_sent if ideal_sent else float("nan")
                print(f"{name:20s} {rank:4d} {flops / 1e9:8.3f} {ideal / 1e9:8.3f} "
                      f"{flops / ideal:5.2f} {sent / 1e6:8.2f} {ideal_sent / 1e6:8.2f} "
                      f"{ratio:5.2f} {held / 1e6:10.2f} {at_once / 1e6:8.2f} {ms:10.1f}")
        for name in dict.fromkeys(row[0] for row in rows):
            work = [row[3] for rank_rows in gathered for row in rank_rows if row[0] == name]
            print(f"{name}: allowed work busiest/mean {max(work) / statistics.mean(work):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
