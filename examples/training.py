"""What both training examples share: text, the distributed setup, the loss, the loop.

The compiled function is the model *and* its loss (``loong_compile.NextTokenLoss``): with the
loss in the graph the backend chunks the LM head and the loss by tokens, so the logits
(tokens x vocabulary) never exist; a compiled model that returned its logits would hold them.

The text is the Python standard library's own source, read as bytes (a
256-token byte-level vocabulary): every machine with Python has it, so the
examples need no download.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

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
        elif name == "inductor_options":
            parser.add_argument(flag, type=json.loads, default={},
                                help='Inductor\'s config as JSON, e.g. \'{"max_autotune": true}\'')
        elif f.type in ("bool",):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.type in ("float | str", "int | str"):  # alpha, lm_head_chunk: "auto" or a number
            parser.add_argument(flag, default=f.default, help='"auto" or a number')
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=f.default)


def config_from_args(args: argparse.Namespace) -> dict:
    options = {name: getattr(args, name) for name in LoongConfig.__dataclass_fields__}
    for name, f in LoongConfig.__dataclass_fields__.items():
        if f.type in ("float | str", "int | str") and options[name] != "auto":
            options[name] = (float if f.type == "float | str" else int)(options[name])
    return options


def init_distributed() -> None:
    """Under torchrun: gloo on CPU, NCCL when CUDA is present. Alone: a single process."""
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def finish_distributed() -> None:
    """Under torchrun: every rank waits for the others, then leaves the process group.  A rank
    that exits with the group still open can abort in gloo's threads ("terminate called without
    an active exception") while a slower rank still reads the store, failing the whole run."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def train(model: torch.nn.Module, args: argparse.Namespace) -> list[float]:
    """The loop: shard each batch, step, print loss and tokens/s, return the per-step losses.

    Each rank's loss is its share of the batch's mean next-token loss (the sum over its tokens
    over the batch's label count, ``batch.num_labels``): summed over the ranks of a sequence
    it is the one-process loss."""
    if args.offload_states and not args.fsdp:
        raise ValueError("--offload-states keeps FSDP2's sharded states on the host, so it needs "
                         "--fsdp: add --fsdp or drop --offload-states")
    options = config_from_args(args)
    mesh = lc.init_mesh(hp=args.hp, cp=args.cp, placement=args.placement, inner_ring=args.inner_ring)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = device()
    model.to(dev)
    if args.fsdp:
        step_loss = shard_with_fsdp2(model, options, mesh, offload_states=args.offload_states)
    else:
        step_loss = torch.compile(lc.NextTokenLoss(model), backend="loong", options=options,
                                  fullgraph=True)
    # the step's parameters: under FSDP2 the head has moved out of the model into the loss unit
    optimizer = torch.optim.AdamW(step_loss.parameters(), lr=args.lr, weight_decay=0.0)
    text = stdlib_text(args.text_bytes)
    data = batches(text, args.batch * mesh.dp, args.seq, args.seed)
    losses: list[float] = []
    progress = _Progress(args.steps, enabled=rank == 0)
    for step in range(args.steps):
        tokens = next(data)[mesh.dp_rank * args.batch:(mesh.dp_rank + 1) * args.batch]
        sharded = lc.shard_batch(tokens, tokens, mesh)
        start = time.perf_counter()
        loss = step_loss(sharded.input_ids.to(dev), sharded.labels.to(dev),
                         sharded.num_labels.to(dev), position_ids=sharded.position_ids.to(dev))
        loss.backward()
        if not args.fsdp:  # FSDP2 reduces during the backward (set_fsdp_gradient_divide_factor)
            lc.reduce_gradients(step_loss, mesh)   # sum over the sequence's ranks, mean over replicas
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


def shard_with_fsdp2(model: torch.nn.Module, options: dict, mesh,
                     offload_states: bool = False) -> torch.nn.Module:
    """LoongTrain's hybrid ZeRO: parameters, gradients and optimizer states sharded over all
    dp x cp x hp ranks with FSDP2, each transformer block compiled with backend="loong", and
    the LM head with the loss as one more compiled unit (so the head is chunked with the loss).

    Blocks are compiled one by one (as torchtitan does) so FSDP2's all-gather and
    reduce-scatter hooks run between compiled graphs; the embedding and the final norm run
    eagerly.  The head moves out of the model into ``NextTokenLoss(head)`` (the model then
    returns its final hidden states): a module FSDP2 shards on its own, whose compiled graph
    holds the projection and the loss and no attention (hence
    ``allow_graphs_without_attention``; it computes each token on its own).  Returns the
    module ``(input_ids, labels, num_labels, position_ids=) -> loss``.
    FSDP2's reduce-scatter spans all ranks; ``set_fsdp_gradient_divide_factor`` makes it divide
    by dp instead of the world size, so gradients are summed over the ranks of a sequence and
    averaged over data-parallel replicas, as ``lc.reduce_gradients`` does without FSDP.
    ``offload_states`` keeps the sharded states on the host (``_states_policy``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = init_device_mesh(device().type, (dist.get_world_size(),), mesh_dim_names=("dp_cp_hp",))
    policy = _states_policy(offload_states)
    blocks = next(m for name, m in model.named_modules() if name.split(".")[-1] == "layers")
    for block in blocks:
        block.compile(backend="loong", options=options, fullgraph=True)
        fully_shard(block, mesh=world, offload_policy=policy)
    head_loss = lc.NextTokenLoss(_take_head(model))
    head_loss.compile(backend="loong", options={**options, "allow_graphs_without_attention": True},
                      fullgraph=True)
    fully_shard(head_loss, mesh=world, offload_policy=policy)
    step = _HiddenThenLoss(model, head_loss)
    fully_shard(step, mesh=world, offload_policy=policy)
    lc.set_fsdp_gradient_divide_factor(step, mesh)
    return step


def _states_policy(offload_states: bool):
    """Where FSDP2 keeps the sharded parameters, gradients and optimizer states.

    With ``offload_states`` (``CPUOffloadPolicy``) they stay in host memory, so the device holds
    only the unit it computes: FSDP2 copies a block's parameter shards to the device before its
    forward and again before its backward, all-gathers them there, copies each gradient's shard
    back to the host after the reduce-scatter, and the optimizer steps on the host.  Pinned host
    memory lets those copies overlap compute; torch can pin only with a GPU (on a CPU-only build
    ``pin_memory()`` raises "Cannot access accelerator device"), and on CPU the copies are no-ops.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not offload_states:
        return OffloadPolicy()   # fully_shard's default: the states stay on the device
    return CPUOffloadPolicy(pin_memory=device().type == "cuda")


def _take_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's LM head (transformers' ``lm_head``, the example Llama's ``output``), replaced
    in the model by the identity: the model then returns its final hidden states."""
    name = "lm_head" if hasattr(model, "lm_head") else "output"
    head = getattr(model, name)
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if any(head.weight is w for w in embeddings):
        raise ValueError("a head tied to the embedding cannot be sharded apart from it; "
                         "untie it or run without --fsdp")
    setattr(model, name, torch.nn.Identity())
    return head


class _HiddenThenLoss(torch.nn.Module):
    """The model (its head taken out), then the compiled head and loss."""

    def __init__(self, model: torch.nn.Module, head_loss: torch.nn.Module):
        super().__init__()
        self.model, self.head_loss = model, head_loss

    def forward(self, input_ids, labels, num_labels, **model_kwargs):
        out = self.model(input_ids, **model_kwargs)
        return self.head_loss(getattr(out, "logits", out), labels, num_labels)


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
        print(f"matplotlib is not installed; not writing {path} (pip install matplotlib)")
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
    parser.add_argument("--offload-states", action="store_true",
                        help="with --fsdp: keep the sharded states on the host, the optimizer "
                             "stepping there (FSDP2's CPUOffloadPolicy)")
    add_config_flags(parser)
    return parser
