"""Peak host memory and step time of one training step with the loss in the compiled function:
plain Inductor vs backend="loong" (the LM head and its loss token-chunked).

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/lm_head_memory.py [--tokens 8192] [--steps 3]
    python benchmarks/lm_head_memory.py --strategies     # gradient in forward vs recompute
    python benchmarks/lm_head_memory.py --device cuda --tokens 32768 --long 131072   # a GPU

Model: a transformers ``LlamaForCausalLM`` of 2 layers, width 64, Llama-3's 128,256-word
vocabulary, one sequence; the step is ``model(ids, position_ids=pos, labels=ids).loss``
(transformers' own loss, float upcast included) compiled with ``torch.compile``, then
``backward()``.  Each configuration runs in a fresh process, one process at a time:

- peak above rest: ``VmHWM`` after resetting it (``/proc/self/clear_refs`` = 5) minus ``VmRSS``
  before the step, for the step after the compiling one (the parameters' gradients are freed
  between steps, so the step allocates them too);
- step: forward + backward, the median of ``--steps`` steps after the compiling one.

With ``--device cuda`` the model runs on the GPU and the peak is the CUDA caching allocator's
(``max_memory_allocated`` after resetting it, minus what was allocated before the step).

``--strategies`` times the two ways to chunk, eagerly, on the head of that model (8,192 tokens
x 128,256 words, width 64, float32): the gradient computed in the forward, chunk by chunk, as
``loong_compile.ops.lm_head_loss`` does (Liger-Kernel's choice), against each chunk's logits
recomputed in the backward (one more matmul over the head per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VOCAB, WIDTH = 128256, 64


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(backend: str, tokens: int, steps: int, chunk: str, device: str = "cpu") -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens,
        attn_implementation="sdpa")).to(device)
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    pos = torch.arange(tokens, device=device).unsqueeze(0)
    cuda = device == "cuda"
    options = {} if backend == "inductor" else {
        "options": {"lm_head_chunk": chunk if chunk == "auto" else int(chunk)}}
    step = torch.compile(lambda i, p, y: model(i, position_ids=p, labels=y).loss,
                         backend=backend, **options)

    def train_step() -> float:
        start = time.perf_counter()
        loss = step(ids, pos, ids)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return seconds, loss.item()

    train_step()                                     # compiles
    if cuda:
        rest = torch.cuda.memory_allocated() / 1024
        torch.cuda.reset_peak_memory_stats()
        seconds, loss = train_step()
        peak = torch.cuda.max_memory_allocated() / 1024 - rest
    else:
        rest = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        seconds, loss = train_step()
        peak = status_kib("VmHWM") - rest
    times = [seconds] + [train_step()[0] for _ in range(steps - 1)]
    return {"backend": backend, "device": device, "tokens": tokens, "chunk": chunk, "loss": loss,
            "peak_gib": peak / 2 ** 20, "step_s": statistics.median(times), "steps": times}


def run(backend: str, tokens: int, steps: int, chunk: str, device: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, __file__, "--child", backend, str(tokens), str(steps), chunk,
                          device], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{backend} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def strategies(tokens: int = 8192, chunk: int = 256, rounds: int = 3) -> dict:
    """Seconds of forward + backward of the head and loss, per strategy (best of ``rounds``)."""
    from loong_compile.ops import lm_head_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, WIDTH, generator=g, requires_grad=True)
    weight = (torch.randn(VOCAB, WIDTH, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=g)

    def forward_gradient():
        lm_head_loss(hidden, weight, None, labels, reduction="sum", chunk=chunk).backward()

    def recompute():
        _Recompute.apply(hidden, weight, labels, chunk).backward()

    best = {}
    for _ in range(rounds):
        for name, fn in (("gradient in forward", forward_gradient), ("recompute in backward", recompute)):
            start = time.perf_counter()
            fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    return best


class _Recompute(torch.autograd.Function):
    """The other strategy, for the comparison only: the forward keeps each token's log-sum-exp,
    the backward forms each chunk's logits again."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        lse = torch.empty(hidden.size(0))
        total = hidden.new_zeros(())
        for s in range(0, hidden.size(0), chunk):
            logits = hidden[s:s + chunk] @ weight.T
            lse[s:s + chunk] = logits.logsumexp(1)
            total += (lse[s:s + chunk] - logits.gather(1, labels[s:s + chunk, None])[:, 0]).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, lse = ctx.saved_tensors
        d_hidden, d_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        for s in range(0, hidden.size(0), ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            p = (h @ weight.T).sub_(lse[s:s + ctx.chunk, None]).exp_()
            p.scatter_add_(1, labels[s:s + ctx.chunk, None], torch.full((h.size(0), 1), -1.0))
            p.mul_(grad)
            torch.mm(p, weight, out=d_hidden[s:s + ctx.chunk])
            d_weight.addmm_(p.T, h)
        return d_hidden, d_weight, None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--long", type=int, default=32768, help="tokens of the loong-only run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", default="auto")
    parser.add_argument("--strategies", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, tokens, steps, chunk, device = args.child
        print(json.dumps(child(backend, int(tokens), int(steps), chunk, device)))
        return
    if args.strategies:
        for name, seconds in strategies().items():
            print(f"{name:24s} {seconds:.2f} s")
        return
    rows = [run("inductor", args.tokens, args.steps, args.chunk, args.device),
            run("loong", args.tokens, args.steps, args.chunk, args.device),
            run("loong", args.long, args.steps, args.chunk, args.device)]
    base = rows[0]
    print("| backend | tokens | peak above rest GiB | vs Inductor | step s (median) | vs Inductor | loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        same = r["tokens"] == base["tokens"]
        print(f"| {r['backend']} | {r['tokens']} | {r['peak_gib']:.3f} | "
              f"{r['peak_gib'] / base['peak_gib']:.1%} | {r['step_s']:.2f} | "
              f"{r['step_s'] / base['step_s'] if same else float('nan'):.2f}x | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
