"""What both training examples share: text, the distributed setup, the loss, the loop.

The text is the Python standard library's own source, read as bytes (a
256-token byte-level vocabulary): every machine with Python has it, so the
examples need no download.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import loong_compile as lc
from loong_compile.config import LoongConfig


def stdlib_text(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's .py files, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batches(text: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless random windows of ``seq`` tokens; the same on every rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(text) - seq, (batch,), generator=g)
        yield torch.stack([text[s:s + seq] for s in starts.tolist()])


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per LoongConfig key (``--hp``, ``--activations``, ...)."""
    for name, f in LoongConfig.__dataclass_fields__.items():
        flag = "--" + name.replace("_", "-")
        if name == "disable_passes":
            parser.add_argument(flag, nargs="*", default=[], help="passes to skip")
        elif f.type in ("bool",):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.type == "float | str":  # alpha, host_bandwidth, ...: "auto" or a number
            parser.add_argument(flag, default=f.default, help='"auto" or a number')
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=f.default)


def config_from_args(args: argparse.Namespace) -> dict:
    options = {name: getattr(args, name) for name in LoongConfig.__dataclass_fields__}
    for name, f in LoongConfig.__dataclass_fields__.items():
        if f.type == "float | str" and options[name] != "auto":
            options[name] = float(options[name])
    return options


def init_distributed() -> None:
    """Under torchrun: gloo on CPU, NCCL when CUDA is present. Alone: a single process."""
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def token_loss(logits: torch.Tensor, labels: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """This rank's share of the mean next-token loss: summed over ranks it is the full loss."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum") / global_tokens


def train(model: torch.nn.Module, forward: Callable, args: argparse.Namespace) -> list[float]:
    """The loop: shard each batch, step, print loss and tokens/s, return the per-step losses."""
    options = config_from_args(args)
    mesh = lc.init_mesh(hp=args.hp, cp=args.cp, placement=args.placement, inner_ring=args.inner_ring)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = device()
    model.to(dev)
    if args.fsdp:
        compiled = shard_with_fsdp2(model, options, mesh)
    else:
        compiled = torch.compile(model, backend="loong", options=options, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    text = stdlib_text(args.text_bytes)
    data = batches(text, args.batch * mesh.dp, args.seq, args.seed)
    losses: list[float] = []
    progress = _Progress(args.steps, enabled=rank == 0)
    for step in range(args.steps):
        tokens = next(data)[mesh.dp_rank * args.batch:(mesh.dp_rank + 1) * args.batch]
        sharded = lc.shard_batch(tokens, tokens, mesh)
        start = time.perf_counter()
        logits = forward(compiled, sharded.input_ids.to(dev), sharded.position_ids.to(dev))
        loss = token_loss(logits, sharded.labels.to(dev), global_tokens=args.batch * (args.seq - 1))
        loss.backward()
        if not args.fsdp:  # FSDP2 reduces during the backward (set_fsdp_gradient_divide_factor)
            lc.reduce_gradients(model, mesh)   # sum over the sequence's ranks, mean over replicas
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(reported)
            reported /= mesh.dp
        losses.append(reported.item())
        tokens_per_s = args.batch * mesh.dp * args.seq / (time.perf_counter() - start)
        progress.update(step, losses[-1], tokens_per_s)
    progress.close()
    if rank == 0 and args.plot:
        plot_losses(losses, args.plot)
    return losses


def shard_with_fsdp2(model: torch.nn.Module, options: dict, mesh) -> torch.nn.Module:
    """LoongTrain's hybrid ZeRO: parameters, gradients and optimizer states sharded over all
    dp x cp x hp ranks with FSDP2, each transformer block compiled with backend="loong".

    Blocks are compiled one by one (as torchtitan does) so FSDP2's all-gather and
    reduce-scatter hooks run between compiled graphs; the embedding and the head run eagerly.
    FSDP2's reduce-scatter spans all ranks; ``set_fsdp_gradient_divide_factor`` makes it divide
    by dp instead of the world size, so gradients are summed over the ranks of a sequence and
    averaged over data-parallel replicas, as ``lc.reduce_gradients`` does without FSDP.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = init_device_mesh(device().type, (dist.get_world_size(),), mesh_dim_names=("dp_cp_hp",))
    blocks = next(m for name, m in model.named_modules() if name.split(".")[-1] == "layers")
    for block in blocks:
        block.compile(backend="loong", options=options, fullgraph=True)
        fully_shard(block, mesh=world)
    fully_shard(model, mesh=world)
    lc.set_fsdp_gradient_divide_factor(model, mesh)
    return model


class _Progress:
    """Rank 0's progress: one redrawn line on a terminal, a line every tenth of the run otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.redraw = enabled and sys.stdout.isatty()
        self.every = max(1, total // 10)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        done = int(30 * (step + 1) / self.total)
        line = (f"[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{self.total}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s" + (" (includes compile)" if step == 0 else ""))
        if self.redraw and step > 0:
            print("\r" + line, end="", flush=True)
        elif step == 0 or (step + 1) % self.every == 0 or step + 1 == self.total:
            print(line, flush=True)

    def close(self) -> None:
        if self.redraw:
            print()


def plot_losses(losses: list[float], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; not writing {path} (pip install loong-compile[plot])")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def common_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel replica")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-bytes", type=int, default=4_000_000)
    parser.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard parameters, gradients and optimizer states over all ranks (FSDP2)")
    add_config_flags(parser)
    return parser
