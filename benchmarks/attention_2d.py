"""2D-Attention forward+backward time and bytes sent per rank, beside PyTorch's context parallel.

    torchrun --nproc-per-node 4 benchmarks/attention_2d.py [--seq 4096] [--heads 8]
        [--kv-heads 8 2] [--head-dim 64] [--iters 5] [--json out.json]

For every (hp, cp) factorisation of the world and every inner ring size w,
for MHA and GQA: the median time of one causal forward + backward (slowest
rank), and the bytes this rank sent (all-to-all and P2P, from the ops'
counters).  GQA rows also run with K/V repeated to H heads before the call,
the traffic of any scheme that replicates KV inside the ring (PyTorch's CP
has to: its SDPA kernels take as many KV heads as Q heads).

PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` runs on
the same problem (hp=1, cp=world) where it can; where it cannot (CPU/gloo),
the exact error is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from loong_compile.parallel.tokens import mesh_token_indices
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import attention_2d, comm_counters, reset_comm_counters
from loong_compile.ops.attention.kernels import kernel_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def full_inputs(args, heads, kv_heads, device):
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, heads, args.seq, args.head_dim)
    kv_shape = (args.batch, kv_heads, args.seq, args.head_dim)
    tensors = [torch.randn(s, generator=gen) for s in (shape, kv_shape, kv_shape, shape)]
    return [t.to(device=device, dtype=DTYPES[args.dtype]) for t in tensors]


def timed(step, iters):
    """Median over iterations of the slowest rank's time for ``step()``."""
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def run_2d(args, mesh, heads, kv_heads, repeat_kv, device):
    q, k, v, dout = full_inputs(args, heads, kv_heads, device)
    if repeat_kv:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    index = mesh_token_indices(args.seq, mesh).to(device)
    q, k, v, dout = (t[:, :, index].contiguous() for t in (q, k, v, dout))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kwargs = mesh.attention_kwargs()
    sent = {}

    def step():
        reset_comm_counters()
        out = attention_2d(*leaves, is_causal=True, scale=None, **kwargs)
        sent["fwd"] = comm_counters()
        reset_comm_counters()
        torch.autograd.grad(out, leaves, dout)
        sent["bwd"] = comm_counters()

    step()  # warm-up
    seconds = timed(step, args.iters)
    return {"ms": 1e3 * seconds, **{f"{kind}_{phase}": sent[phase][kind]
                                   for phase in ("fwd", "bwd") for kind in ("all_to_all", "p2p")}}


def run_pytorch_cp(args, heads, kv_heads, device, sdpa_backend):
    """PyTorch's context parallel on the same problem (KV repeated to H heads); or its error.

    ``sdpa_backend``: None lets SDPA choose its kernel, else e.g. SDPBackend.MATH.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    world = dist.get_world_size()
    cp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    q, k, v, dout = full_inputs(args, heads, kv_heads, device)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))

    def step():
        kernel = sdpa_kernel(sdpa_backend) if sdpa_backend is not None else contextlib.nullcontext()
        with kernel, context_parallel(cp_mesh, buffers=[q, k, v, dout],
                                      buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            torch.autograd.grad(out, leaves, dout)

    try:
        step()
    except Exception as e:  # noqa: BLE001 - reported as the benchmark's result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    return {"ms": 1e3 * timed(step, args.iters)}


def configurations(world, inner_rings):
    for hp in (h for h in range(1, world + 1) if world % h == 0):
        cp = world // hp
        for w in range(1, cp + 1):
            if cp % w == 0 and (not inner_rings or w in inner_rings):
                yield hp, cp, w


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--placement", default="head_first")
    parser.add_argument("--inner-rings", type=int, nargs="*", default=[],
                        help="inner ring sizes to run (default: every divisor of cp)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file (rank 0)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for kv_heads in args.kv_heads:
        variants = [False, True] if kv_heads < args.heads else [False]
        for hp, cp, w in configurations(world, args.inner_rings):
            mesh = init_mesh(hp=hp, cp=cp, placement=args.placement, inner_ring=w)
            for repeat_kv in variants:
                result = run_2d(args, mesh, args.heads, kv_heads, repeat_kv, device)
                rows.append({"impl": "loong 2D" + (" (KV repeated to H)" if repeat_kv else ""),
                             "hp": hp, "cp": cp, "w": w, "kv_heads": kv_heads, **result})
        for name, sdpa_backend in (("", None), (" (SDPA math)", SDPBackend.MATH)):
            rows.append({"impl": "torch context_parallel" + name, "hp": 1, "cp": world, "w": world,
                         "kv_heads": kv_heads,
                         **run_pytorch_cp(args, args.heads, kv_heads, device, sdpa_backend)})
    if rank == 0:
        kernel = kernel_name(torch.empty(0, device=device, dtype=DTYPES[args.dtype]))
        print(f"world={world} backend={dist.get_backend()} kernel={kernel} S={args.seq} "
              f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype} causal, "
              f"median of {args.iters}, bytes sent by rank 0")
        print(f"{'impl':34s} {'H_kv':>4s} {'hp':>3s} {'cp':>3s} {'w':>3s} {'fwd+bwd ms':>11s} "
              f"{'a2a fwd':>10s} {'a2a bwd':>10s} {'p2p fwd':>10s} {'p2p bwd':>10s}")
        for r in rows:
            head = f"{r['impl']:34s} {r['kv_heads']:4d} {r['hp']:3d} {r['cp']:3d} {r['w']:3d}"
            if "error" in r:
                print(f"{head} FAILED: {r['error']}")
            elif "p2p_fwd" not in r:
                print(f"{head} {r['ms']:11.1f}")
            else:
                print(f"{head} {r['ms']:11.1f} {r['all_to_all_fwd']:10d} {r['all_to_all_bwd']:10d} "
                      f"{r['p2p_fwd']:10d} {r['p2p_bwd']:10d}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
