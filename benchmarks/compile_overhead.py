"""Compile time and step time of backend="loong" (no pass enabled, and defaults) vs backend="inductor".

    python benchmarks/compile_overhead.py [--reps 3] [--rounds 10] [--steps 10]

Compile time: each variant compiles in a fresh process with an empty Inductor
cache, so every kernel is compiled from scratch; compile time = the first
training step (forward + backward, which compiles both graphs) minus one
steady step; the median over ``--reps`` processes, variants alternating.

Step time: one process compiles all variants (the same weights) and then times
them in interleaved rounds of ``--steps`` steps each, so that machine noise (a
shared VM, frequency changes) hits every variant alike; a variant's step time
is the median over rounds of each round's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, {examples!r})
import loong_compile
from llama import Llama, LlamaConfig
variants = {variants!r}
ids = torch.randint(0, 256, ({batch}, {seq}), generator=torch.Generator().manual_seed(0))

def make_step(backend, options):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim={dim}, n_layers={layers}, n_heads=4, n_kv_heads=2, ffn_dim={ffn}))
    compiled = torch.compile(model, backend=backend, fullgraph=True, options=options or None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    def step():
        t = time.perf_counter()
        logits = compiled(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t
    return step
"""

COMPILE_CHILD = SETUP + r"""
step = make_step(*variants[0])
first = step()
print(json.dumps({{"compile": first - statistics.median(step() for _ in range(5))}}))
"""

STEP_CHILD = SETUP + r"""
steps = [make_step(*v) for v in variants]
for step in steps:
    step(); step()
rounds = [[statistics.median(step() for _ in range({steps})) for step in steps] for _ in range({rounds})]
print(json.dumps({{"step": [statistics.median(r[i] for r in rounds) for i in range(len(steps))]}}))
"""


def no_pass_options() -> dict:
    """backend="loong" with every library pass disabled: the pipeline's own overhead."""
    from loong_compile.passes import library_passes

    return {"disable_passes": [p.name for p in library_passes()]}


def variants() -> dict[str, tuple[str, dict]]:
    return {"inductor": ("inductor", {}), "loong (no pass)": ("loong", no_pass_options()),
            "loong (defaults)": ("loong", {})}


def run_child(template: str, chosen: list[tuple[str, dict]], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        code = template.format(examples=str(ROOT / "examples"), variants=chosen, dim=args.dim,
                               layers=args.layers, ffn=int(8 * args.dim / 3) // 8 * 8,
                               batch=args.batch, seq=args.seq, steps=args.steps, rounds=args.rounds)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="fresh processes per variant (compile time)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (step time)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    chosen = variants()
    compile_s: dict[str, list[float]] = {name: [] for name in chosen}
    for rep in range(args.reps):
        for name, variant in chosen.items():
            compile_s[name].append(run_child(COMPILE_CHILD, [variant], args)["compile"])
            print(f"rep {rep + 1} {name:17s} compile {compile_s[name][-1]:6.2f} s", flush=True)
    step_s = dict(zip(chosen, run_child(STEP_CHILD, list(chosen.values()), args)["step"]))
    print(f"\nmodel: dim {args.dim}, {args.layers} layers, batch {args.batch} x seq {args.seq}; "
          f"compile: median of {args.reps} fresh processes; step: median of {args.rounds} interleaved "
          f"rounds x {args.steps} steps")
    print(f"{'backend':17s} {'compile s':>10s} {'step ms':>10s} {'compile / inductor':>19s} "
          f"{'step / inductor':>16s}")
    base_compile, base_step = statistics.median(compile_s["inductor"]), step_s["inductor"]
    for name in chosen:
        c = statistics.median(compile_s[name])
        print(f"{name:17s} {c:10.2f} {step_s[name] * 1e3:10.2f} {c / base_compile:18.3f}x "
              f"{step_s[name] / base_step:15.3f}x")


if __name__ == "__main__":
    main()
