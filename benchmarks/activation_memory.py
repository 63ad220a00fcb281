"""Saved-activation memory, host bytes, recomputed FLOPs and step time of the activation policies.

    python benchmarks/activation_memory.py [--seqs 256 1024 4096] [--lowering inductor] [--rounds 5]

The example Llama (examples/llama.py, its defaults: dim 128, 4 layers, 4 heads, 2 KV heads)
on token windows of several lengths (``--tokens`` per step in all: batch = tokens / seq).  For
``none``, ``sc++`` and ``memo`` (alpha from the LP with measured bandwidth and layer time, and
fixed alphas), from the compile's report:

- device: saved bytes resident on the device at the start of the backward (everything saved
  minus what ``offload`` sent to the host), per swapped layer and in all;
- host: bytes offloaded;
- recompute: FLOPs of forward ops the backward runs again (matmuls and attention);
- step: forward + backward time, the best of ``--rounds`` steps taken in interleaved rounds;
- loss: the first step's loss minus ``none``'s (identical numbers: 0).

On a CPU "host" and "device" are the same memory: the device/host split is the graph's
accounting, exact in bytes, not a measurement of two memories.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from llama import Llama, LlamaConfig  # noqa: E402
from loong_compile import LoongBackend  # noqa: E402
from loong_compile.passes import library_passes  # noqa: E402
from loong_compile.passes.fx.aten_ops import node_flops  # noqa: E402


class RecomputedFlops:
    """Split-stage probe: FLOPs of the forward ops that ended up in the backward graph."""

    name, stage = "recomputed_flops", "split"

    def enabled(self, config):
        return True

    def run(self, split, ctx):
        nodes = [n for n in split.backward.graph.nodes if n.meta.get("nn_module_stack")]
        return {"flops": sum(node_flops(n) for n in nodes)}


def policies(alphas: list[float]) -> dict[str, dict]:
    out = {"none": {"activations": "none"}, "sc++": {"activations": "sc++"},
           "memo auto": {"activations": "memo", "alpha": "auto", "host_memory": 64 * 2**30}}
    out |= {f"memo {a:g}": {"activations": "memo", "alpha": a, "host_memory": 64 * 2**30} for a in alphas}
    # MEMO keeps the last two layers resident (eq. 3's n-2); this row swaps every layer
    out["memo r0"] = {**out["memo auto"], "resident_layers": 0}
    return out


class Run:
    """One policy compiled for one length: its report and a timed training step."""

    def __init__(self, cfg: LlamaConfig, ids: torch.Tensor, options: dict, lowering: str):
        torch.manual_seed(0)
        self.model, self.ids, reports = Llama(cfg), ids, []
        backend = LoongBackend({"lowering": lowering, **options},
                               passes=library_passes() + [RecomputedFlops()], on_report=reports.append)
        self.compiled = torch.compile(self.model, backend=backend, fullgraph=True)
        self.loss = self.step()[1]           # compiles forward and backward
        self.report, self.memo = reports[-1], options["activations"] == "memo"
        self.times: list[float] = []

    def step(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        logits = self.compiled(self.ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), self.ids[:, 1:].flatten())
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()

    def figures(self) -> dict:
        activations = self.report.summary("activations")
        if self.memo:
            offload = self.report.summary("offload")
            per_layer = [r["device_bytes"] for r in offload["layers"]]
            device, host, alpha = offload["device_bytes"], offload["host_bytes"], activations["alpha"]
            swapped = [r["device_bytes"] for r in offload["layers"] if r["swapped"]]
        else:
            per_layer = [r["total_bytes"] for r in activations["layers"]]
            device, host, swapped, alpha = activations["activation_bytes"], 0, [], None
        return {"device": device, "per_layer": per_layer, "swapped": swapped, "host": host,
                "alpha": alpha, "flops": self.report.summary("recomputed_flops")["flops"],
                "step": min(self.times), "loss": self.loss}


def measure(cfg: LlamaConfig, seq: int, tokens: int, alphas: list[float], lowering: str,
            rounds: int) -> dict[str, dict]:
    """Every policy at one length; steps timed in interleaved rounds (best of ``rounds``) so
    that the noise of a shared machine hits all policies alike."""
    batch = max(1, tokens // seq)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    runs = {name: Run(cfg, ids, opts, lowering) for name, opts in policies(alphas).items()}
    for _ in range(rounds):
        for run in runs.values():
            run.times.append(run.step()[0])
    return {name: run.figures() for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch x seq)")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--lowering", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per policy (best is kept)")
    args = parser.parse_args()
    dim = LlamaConfig().dim                  # the example model's defaults, with the FFN
    cfg = LlamaConfig(ffn_dim=int(8 * dim / 3) // 8 * 8)   # width examples/train_llama.py gives it
    print(f"example Llama: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
          f"{cfg.n_kv_heads} KV heads, ffn {cfg.ffn_dim}; {args.tokens} tokens per step; "
          f"lowering {args.lowering}; torch {torch.__version__}")
    header = (f"{'seq':>5s} {'batch':>5s} {'policy':10s} {'alpha':>6s} {'device KiB':>11s} "
              f"{'per layer KiB':>24s} {'vs none':>8s} {'host KiB':>9s} {'recompute MFLOP':>16s} "
              f"{'step ms':>8s} {'loss diff':>9s}")
    print(header)
    for seq in args.seqs:
        batch = max(1, args.tokens // seq)
        results = measure(cfg, seq, args.tokens, args.alphas, args.lowering, args.rounds)
        none_layer = results["none"]["per_layer"]
        for name, r in results.items():
            layers = r["swapped"] or r["per_layer"]      # memo: its swapped layers; else all
            ratio = max(d / n for d, n in zip(layers, none_layer))
            per_layer = "/".join(f"{b / 1024:.0f}" for b in r["per_layer"])
            alpha = "" if r["alpha"] is None else f"{r['alpha']:.3f}"
            print(f"{seq:5d} {batch:5d} {name:10s} {alpha:>6s} {r['device'] / 1024:11.0f} {per_layer:>24s} "
                  f"{ratio:8.1%} {r['host'] / 1024:9.0f} {r['flops'] / 1e6:16.1f} {r['step'] * 1e3:8.1f} "
                  f"{r['loss'] - results['none']['loss']:9.1e}", flush=True)
    print("\nvs none: the largest per-layer ratio of device-resident saved bytes to none's, over the "
          "swapped layers (memo) or all layers (none, sc++).  memo keeps the last 2 layers "
          "(resident_layers=2) on device, as MEMO does.")


if __name__ == "__main__":
    main()
