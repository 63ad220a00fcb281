"""Compile time and step time of backend="loong" (no pass enabled, and defaults) vs backend="inductor".

    python benchmarks/compile_overhead.py [--reps 3] [--rounds 10] [--steps 10]
    python benchmarks/compile_overhead.py --depths 8 32 80 [--hp 1 2] [--policies none memo memo+plan]

Compile time: each variant compiles in a fresh process with an empty Inductor
cache, so every kernel is compiled from scratch; compile time = the first
training step (forward + backward, which compiles both graphs) minus one
steady step; the median over ``--reps`` processes, variants alternating.

Step time: one process compiles all variants (the same weights) and then times
them in interleaved rounds of ``--steps`` steps each, so that machine noise (a
shared VM, frequency changes) hits every variant alike; a variant's step time
is the median over rounds of each round's median.

Depth mode (``--depths``): transformers' ``LlamaForCausalLM`` built from its
config (width ``--dim``, 4 heads / 2 KV heads, SDPA; no download) at each
depth; per variant a fresh process (empty Inductor cache) times the first
training step (forward + backward, compile included) and a later step (median
of ``--later`` steps after one warm-up step), one thread per process or rank; ``--jobs N``
runs N variants at once (for a machine with a core for each of their processes).  Variants: at ``--hp 1`` (one
process) ``inductor`` (plain ``backend="inductor"``, the baseline) and
``backend="loong"`` per policy; at ``--hp 2`` (2 gloo ranks, one thread each,
``options={"hp": 2, "cp": 1, ...}``; times are the slower rank's) ``loong`` per
policy.  Policies: ``none`` (``activations="none"``, the default), ``sc++``
(``activations="sc++"``), ``memo`` (``activations="memo"``), ``memo+plan`` (``memo`` and
``memory_plan=True``), and token tiling (issue 52): ``none+tiles`` and ``sc++ +tiles`` (the
policy with ``tile_tokens=--tile-tokens``, default 512 tokens; the batch's rows together, so at
8 x 256 tokens each MLP runs 4 tiles of 64 tokens a row).  The other policies keep
``tile_tokens="auto"``, which tiles nothing at these sizes (a region's intermediates fit its
1 GiB); the ``tiled`` column shows what each variant's report tiled.  ``--reps N`` runs N
rounds of every variant, variants alternating, and prints each variant's min / median / max;
the ratios are of medians.

    python benchmarks/compile_overhead.py --depths 32 --hp 1 --no-inductor --reps 3 \
        --policies none none+tiles sc++ "sc++ +tiles"      # tiling's compile time
"""

from __future__ import annotations

import argparse
import concurrent.futures
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


POLICIES = {"none": {}, "memo": {"activations": "memo"},
            "memo+plan": {"activations": "memo", "memory_plan": True},
            "sc++": {"activations": "sc++"},
            # token tiling forced (issue 52): tile_tokens from --tile-tokens
            "none+tiles": {"tile_tokens": None}, "sc++ +tiles": {"activations": "sc++", "tile_tokens": None}}


def policy_options(policy: str, tile_tokens: int) -> dict:
    """The backend options of ``policy``, a "+tiles" policy's ``tile_tokens`` filled in."""
    return {k: tile_tokens if k == "tile_tokens" else v for k, v in POLICIES[policy].items()}


def untiled(name: str) -> str:
    return name.removesuffix("+tiles").rstrip()


def hf_llama(dim: int, layers: int, seq: int) -> "torch.nn.Module":
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=dim, intermediate_size=int(8 * dim / 3) // 8 * 8,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=seq, attn_implementation="sdpa"))


def depth_run(rank: int, world: int, spec: dict) -> dict:
    """One variant in this process (or on this rank): first step and later step, seconds."""
    import time

    import torch
    import torch.nn.functional as F

    import loong_compile as lc

    model = hf_llama(spec["dim"], spec["layers"], spec["seq"])
    ids = torch.randint(0, 256, (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(0))
    if world > 1:
        import torch.distributed as dist

        shard = lc.shard_batch(ids, ids, lc.init_mesh(hp=spec["hp"], cp=1))
        inputs, pos, labels = shard.input_ids, shard.position_ids, shard.labels
    else:
        inputs, pos, labels = ids, None, ids
    reports: list = []
    backend = (lc.LoongBackend(spec["options"], on_report=reports.append)
               if spec["backend"] == "loong" else spec["backend"])
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        logits = compiled(inputs, position_ids=pos).logits
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    first = step()
    step()
    later = statistics.median(step() for _ in range(spec["later"]))
    graphs = list({id(r): r for r in reports}.values())
    # the regions token tiling cut (tokens, tile, tiles): none for an untiled variant
    tiled = [(c["tokens"], c["tile"], c["tiles"]) for report in graphs
             for record in report.passes if record.name == "token_tiling"
             for c in record.summary["changed"]]
    # of the first step: the backend's stages (its passes, Inductor's lowering within them
    # excluded where it is a stage of its own) and the tiling pass alone, seconds
    stages = sum(sum(report.stage_seconds.values()) for report in graphs)
    tiling = sum(record.seconds for report in graphs for record in report.passes
                 if record.name == "token_tiling")
    return {"first": first, "later": later, "tiled": tiled, "stages_s": stages, "tiling_pass_s": tiling}


DEPTH_CHILD = r"""
import json, sys
sys.path.insert(0, {bench!r})
from compile_overhead import depth_run
from loong_compile.testing import run_distributed
spec = {spec!r}
if spec["hp"] == 1:
    import torch
    torch.set_num_threads(1)   # as each rank of run_distributed
    results = [depth_run(0, 1, spec)]
else:
    results = run_distributed(depth_run, spec["hp"], spec, timeout=3600)
print(json.dumps({{"first": max(r["first"] for r in results), "later": max(r["later"] for r in results),
                  **{{k: results[0][k] for k in ("tiled", "stages_s", "tiling_pass_s")}}}}))
"""


def depth_variant(spec: dict) -> dict:
    """One variant of depth mode in a fresh process (or 2 ranks) with an empty Inductor cache:
    its first and later step in seconds, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        code = DEPTH_CHILD.format(bench=str(ROOT / "benchmarks"), spec=spec)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    result = ({"error": out.stderr.strip().splitlines()[-1:]} if out.returncode else
              json.loads(out.stdout.strip().splitlines()[-1]))
    # each as it ends: a run cut short by a time limit still shows the variants it finished
    print(f"done: {spec['layers']} layers, hp {spec['hp']}, {spec['backend']} {spec['options']}: "
          f"{result}", file=sys.stderr, flush=True)
    return result


def depth_mode(args: argparse.Namespace) -> None:
    runs = []  # (layers, hp, variant name, spec), in the table's order
    for layers in args.depths:
        for hp in args.hp:
            chosen = ([("inductor", "inductor", {})] if hp == 1 and not args.no_inductor else [])
            for policy in args.policies:
                chosen.append((policy, "loong", dict(policy_options(policy, args.tile_tokens),
                                                     **({"hp": hp, "cp": 1} if hp > 1 else {}))))
            runs += [(layers, hp, name, {"dim": args.dim, "layers": layers, "seq": args.seq,
                                         "batch": args.batch, "hp": hp, "backend": backend,
                                         "options": options, "later": args.later})
                     for name, backend, options in chosen]
    reps = args.reps or 1
    print(f"transformers LlamaForCausalLM: dim {args.dim}, 4 heads / 2 KV heads, batch {args.batch} x "
          f"seq {args.seq}; first step incl. compile (fresh process, empty Inductor cache); "
          f"later step: median of {args.later}; {args.jobs} variant(s) at a time; "
          f"{reps} round(s), variants alternating")
    # variants in parallel only on a machine with a core for each of their processes; rounds
    # of every variant one after the other, so that a shared machine's load hits all alike
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(depth_variant, [spec for _ in range(reps) for *_, spec in runs]))
    times: dict[tuple, list[dict]] = {}
    for i, t in enumerate(results):
        layers, hp, name, _ = runs[i % len(runs)]
        times.setdefault((layers, hp, name), []).append(t)
    print(f"{'layers':>6} {'hp':>3} {'variant':>11} {'first s (min/median/max)':>26} {'later s':>8} "
          f"{'first / inductor':>17} {'later / no plan':>16} {'first / untiled':>16}  tiled", flush=True)
    medians, rows = {}, []
    for layers, hp, name, _ in runs:
        done = [t for t in times[layers, hp, name] if "error" not in t]
        if not done:
            print(f"{layers:6d} {hp:3d} {name:>11} failed: {times[layers, hp, name][0]['error']}",
                  flush=True)
            continue
        first = [t["first"] for t in done]
        medians[layers, hp, name] = t = {"first": statistics.median(first),
                                        "later": statistics.median(x["later"] for x in done)}
        base = medians.get((layers, hp, "inductor"))
        ratio = f"{t['first'] / base['first']:16.2f}x" if base and name != "inductor" else f"{'':>17}"
        no_plan = medians.get((layers, hp, name.replace("+plan", ""))) if name.endswith("+plan") else None
        later = f"{t['later'] / no_plan['later']:15.2f}x" if no_plan else f"{'':>16}"
        plain = medians.get((layers, hp, untiled(name))) if name.endswith("+tiles") else None
        tiles = f"{t['first'] / plain['first']:15.3f}x" if plain else f"{'':>16}"
        spread = f"{min(first):.1f} / {t['first']:.1f} / {max(first):.1f}"
        tiled = done[0].get("tiled") or []
        regions = f"{len(tiled)} regions x {tiled[0][2]} tiles of {tiled[0][1]}" if tiled else "nothing"
        print(f"{layers:6d} {hp:3d} {name:>11} {spread:>26} {t['later']:8.3f} {ratio} {later} {tiles}"
              f"  {regions}", flush=True)
        rows.append({"layers": layers, "hp": hp, "variant": name, **t, "firsts": first,
                     "laters": [x["later"] for x in done], "tiled": tiled,
                     **{k: [x.get(k) for x in done] for k in ("stages_s", "tiling_pass_s")}})
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int,
                        help="fresh processes per variant (compile time; default 3, depth mode 1)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (step time)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--depths", type=int, nargs="+", help="depth mode: these layer counts")
    parser.add_argument("--hp", type=int, nargs="+", default=[1, 2], help="depth mode: 1 and/or 2 ranks")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
                        help="depth mode: loong variants")
    parser.add_argument("--no-inductor", action="store_true", help="depth mode: skip the baseline")
    parser.add_argument("--later", type=int, default=3, help="depth mode: later steps timed")
    parser.add_argument("--tile-tokens", type=int, default=512,
                        help='depth mode: the "+tiles" policies\' tile_tokens')
    parser.add_argument("--jobs", type=int, default=1,
                        help="depth mode: variants run at once (each takes a core per process)")
    args = parser.parse_args()
    if args.depths:
        return depth_mode(args)
    args.reps = args.reps or 3
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
