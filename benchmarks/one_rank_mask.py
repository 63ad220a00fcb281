"""One process, a long sequence: the peak host memory and step time of one training step of a
transformers Llama, eager against plain Inductor against ``backend="loong"`` (issue 36: at
hp = cp = 1 the backend drops the S x S mask transformers builds under ``torch.compile``).

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/one_rank_mask.py [--tokens 8192] [--steps 3]

Model: ``LlamaForCausalLM`` of 2 layers, width 64, 4 heads / 2 KV heads, a 256-word vocabulary,
SDPA, float32, one sequence; the step is the loss inside the compiled function, then
``backward()``, called as users call it (``--call``): ``mask``, with the tokenizer's
``attention_mask`` (all ones: ``model(ids, attention_mask=mask, labels=ids)``), or
``no_cache``, ``model(ids, labels=ids, use_cache=False)`` (as the Trainer calls a model with
gradient checkpointing).  Either makes transformers build the S x S mask under
``torch.compile`` (a plain ``model(ids, labels=ids)`` gets ``is_causal=True`` and no mask).  Each configuration runs in a
fresh process, one at a time; the peak is ``VmHWM`` above ``VmRSS`` for the step after the
compiling one (``/proc/self/clear_refs`` = 5 resets it), the step the median of ``--steps``
steps after the compiling one.  The loss and the gradients' norm are printed beside them: the
three must agree.
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
from lm_head_memory import status_kib

VOCAB, WIDTH, LAYERS = 256, 64, 2


def child(backend: str, tokens: int, steps: int, call: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens,
        attn_implementation="sdpa"))
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def loss_of(i, m, y):
        if call == "mask":
            return model(i, attention_mask=m, labels=y).loss
        return model(i, labels=y, use_cache=False).loss

    reports = []
    if backend == "eager":
        step = loss_of
    elif backend == "loong":
        import loong_compile as lc

        step = torch.compile(loss_of, backend=lc.LoongBackend({}, on_report=reports.append))
    else:
        step = torch.compile(loss_of, backend=backend)

    def train_step() -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = step(ids, mask, ids)
        loss.backward()
        seconds = time.perf_counter() - start
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        model.zero_grad(set_to_none=True)
        return seconds, loss.item(), norm

    train_step()                                     # compiles
    rest = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    seconds, loss, norm = train_step()
    peak = status_kib("VmHWM") - rest
    times = [seconds] + [train_step()[0] for _ in range(steps - 1)]
    dropped = [site for report in reports[-1:] for record in report.passes
               if record.name == "attention_2d" for site in record.summary["changed"]]
    return {"backend": backend, "tokens": tokens, "call": call, "loss": loss, "grad_norm": norm,
            "peak_mib": peak / 1024, "step_s": statistics.median(times), "steps": times,
            "masks_dropped": len(dropped)}


def run(backend: str, tokens: int, steps: int, call: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, __file__, "--child", backend, str(tokens), str(steps),
                          call],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{backend} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "loong"])
    parser.add_argument("--call", default="mask", choices=["mask", "no_cache"])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, tokens, steps, call = args.child
        print(json.dumps(child(backend, int(tokens), int(steps), call)))
        return
    rows = [run(b, args.tokens, args.steps, args.call) for b in args.backends]
    base = next((r for r in rows if r["backend"] == "inductor"), rows[0])
    print(f"| backend | peak above rest MiB | vs {base['backend']} | step s (median) | "
          f"vs {base['backend']} | loss | gradient norm | masks dropped |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['peak_mib']:.0f} | {r['peak_mib'] / base['peak_mib']:.0%} | "
              f"{r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | {r['loss']:.6f} | "
              f"{r['grad_norm']:.6f} | {r['masks_dropped']} |")


if __name__ == "__main__":
    main()
