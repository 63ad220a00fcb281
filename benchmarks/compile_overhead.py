"""Compile time and step time of backend="loong" (no pass enabled, and defaults) vs backend="inductor".

    python benchmarks/compile_overhead.py [--reps 3] [--steps 20]

Each measurement runs in a fresh process with an empty Inductor cache, so both
backends compile every kernel from scratch.  Compile time = the first training
step (forward + backward, which compiles both graphs) minus one steady step;
step time = the median of the following steps.  Runs alternate between the
backends so that machine noise hits both alike.
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

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {examples!r})
import loong_compile
from llama import Llama, LlamaConfig
torch.manual_seed(0)
cfg = LlamaConfig(dim={dim}, n_layers={layers}, n_heads=4, n_kv_heads=2, ffn_dim={ffn})
model = Llama(cfg)
ids = torch.randint(0, 256, ({batch}, {seq}))
options = {options!r}
compiled = torch.compile(model, backend={backend!r}, fullgraph=True, options=options or None)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
def step():
    t = time.perf_counter()
    logits = compiled(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t
first = step()
steps = [step() for _ in range({steps})]
print(json.dumps({{"first": first, "steps": steps}}))
"""


def no_pass_options() -> dict:
    """backend="loong" with every library pass disabled: the pipeline's own overhead."""
    from loong_compile.passes import library_passes

    return {"disable_passes": [p.name for p in library_passes()]}


VARIANTS = {"inductor": ("inductor", {}), "loong (no pass)": ("loong", None),
            "loong (defaults)": ("loong", {})}


def measure(variant: str, args: argparse.Namespace) -> dict:
    backend, options = VARIANTS[variant]
    options = no_pass_options() if options is None else options
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        code = CHILD.format(examples=str(ROOT / "examples"), backend=backend, options=options, dim=args.dim,
                            layers=args.layers, ffn=int(8 * args.dim / 3) // 8 * 8,
                            batch=args.batch, seq=args.seq, steps=args.steps)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    step = statistics.median(data["steps"])
    return {"compile": data["first"] - step, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for rep in range(args.reps):
        for variant in results:
            results[variant].append(measure(variant, args))
            r = results[variant][-1]
            print(f"rep {rep + 1} {variant:17s} compile {r['compile']:6.2f} s  step {r['step'] * 1e3:7.2f} ms",
                  flush=True)
    med = {b: {k: statistics.median(r[k] for r in rs) for k in ("compile", "step")} for b, rs in results.items()}
    print(f"\nmodel: dim {args.dim}, {args.layers} layers, batch {args.batch} x seq {args.seq}; "
          f"medians over {args.reps} fresh processes")
    print(f"{'backend':17s} {'compile s':>10s} {'step ms':>10s} {'compile / inductor':>19s} "
          f"{'step / inductor':>16s}")
    base = med["inductor"]
    for b, m in med.items():
        print(f"{b:17s} {m['compile']:10.2f} {m['step'] * 1e3:10.2f} "
              f"{m['compile'] / base['compile']:18.3f}x {m['step'] / base['step']:15.3f}x")


if __name__ == "__main__":
    main()
