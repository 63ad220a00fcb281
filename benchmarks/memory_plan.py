"""Memory planner benchmarks: arena vs lower bound, and solve times.

    python benchmarks/memory_plan.py --minimalloc [--time-limit 60] [--only A,B]
    python benchmarks/memory_plan.py --llama [--layers 4,8,16,32] [--time-limit 30]
    python benchmarks/memory_plan.py --hf-llama [--layers 4,8,16] [--time-limit 30]
    python benchmarks/memory_plan.py --synthetic [--layers 4,8,16,32] [--time-limit 30]

``--minimalloc``: the 11 public MiniMalloc instances (``../shared/benchmarks/
minimalloc``), each planned flat with ``--time-limit`` seconds; prints arena /
lower bound, the proven bound and the time.

``--llama``: the example Llama (examples/llama.py), ``--hf-llama``: a randomly
initialised Hugging Face ``LlamaForCausalLM``, compiled by plain Inductor for
one training step; the buffers of its forward and backward graphs are
captured through the pool-planning hook (Inductor keeps its own plan) and
planned four ways by :func:`compare_plans`: Inductor's own pool heuristic,
our greedy, the flat planner, the bi-level planner, each flat/bi-level one
with the same time limit.  ``--synthetic`` does the same on
``planner.generate.layered_instance`` (no compile).

:func:`compare_plans` takes any list of ``planner.Buffer`` with layer keys:
the loong backend's graphs can be fed to it directly.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MINIMALLOC_DIR = ROOT.parent / "shared" / "benchmarks" / "minimalloc"

from loong_compile.planner import Buffer, plan, plan_bilevel  # noqa: E402


def load_minimalloc(path: Path) -> list[Buffer]:
    """A MiniMalloc CSV (``id,lower,upper,size``; live on ``[lower, upper)``) as buffers."""
    with open(path) as f:
        return [Buffer(int(r["size"]), int(r["lower"]), int(r["upper"]), name=f"b{r['id']}")
                for r in csv.DictReader(f)]


def run_minimalloc(time_limit: float, only: set[str] | None, method: str) -> list[dict]:
    rows = []
    for path in sorted(MINIMALLOC_DIR.glob("*.csv")):
        name = path.name.split(".")[0]
        if only and name not in only:
            continue
        buffers = load_minimalloc(path)
        capacity = int(path.name.split(".")[1])
        greedy = plan(buffers, alignment=1, method="greedy")
        p = plan(buffers, alignment=1, time_limit=time_limit, method=method)
        rows.append({
            "instance": name, "buffers": len(buffers), "lower_bound": p.lower_bound,
            "capacity": capacity, "greedy_ratio": round(greedy.ratio, 4),
            "ratio": round(p.ratio, 4), "within_capacity": p.arena <= capacity,
            "proven_bound_ratio": round(p.bound / p.lower_bound, 4), "status": p.status,
            "method": p.method, "seconds": round(p.solve_time, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def compare_plans(buffers: list[Buffer], time_limit: float, alignment: int = 64,
                  inductor_pool_bytes: int | None = None) -> dict:
    """One graph's buffers (with ``Buffer.layer`` keys) planned four ways.

    Returns the lower bound and, per planner, the arena (bytes and x lower
    bound) and the solve time: ``inductor`` (its own pool heuristic, when the
    caller measured it), ``greedy``, ``flat`` (greedy + search + MIP, one
    instance) and ``bilevel``; flat and bi-level get the same time limit.
    """
    row: dict = {"buffers": len(buffers),
                 "layers": len({b.layer for b in buffers if b.layer is not None})}
    plans = {
        "greedy": plan(buffers, alignment=alignment, method="greedy"),
        "flat": plan(buffers, alignment=alignment, time_limit=time_limit),
        "bilevel": plan_bilevel(buffers, alignment=alignment, time_limit=time_limit),
    }
    lb = plans["greedy"].lower_bound
    row["lower_bound"] = lb
    if inductor_pool_bytes is not None:
        row["inductor"] = round(inductor_pool_bytes / lb, 4) if lb else 1.0
    row["bilevel_bytes"] = plans["bilevel"].arena
    for name, p in plans.items():
        row[name] = round(p.ratio, 4)
        row[f"{name}_s"] = round(p.solve_time, 2)
        row[f"{name}_status"] = p.status
    return row


def capture_graphs(model, ids) -> list:
    """Compile one training step of ``model`` on ``ids``; return its graphs' PoolRequests."""
    import torch

    from loong_compile import _compat

    captured = []

    def capture(request):
        captured.append(request)
        return None  # Inductor keeps its own plan

    options = {**_compat.pool_planning_patches(capture, f"capture-{time.time()}"),
               "fx_graph_cache": False}
    compiled = torch.compile(model, backend="inductor", options=options, fullgraph=True)
    logits = compiled(ids)
    logits = getattr(logits, "logits", logits)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return captured


def make_model(kind: str, n_layers: int, dim: int, ffn: int):
    """The example Llama (``llama``) or a randomly initialised Hugging Face Llama (``hf``)."""
    if kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=n_layers,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    sys.path.insert(0, str(ROOT / "examples"))
    from llama import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=ffn))


def run_models(kind: str, layers: list[int], time_limit: float, seq: int, dim: int, ffn: int,
               batch: int) -> list[dict]:
    import torch

    from loong_compile.passes.memory_plan import inductor_baselines, planned_peak, request_buffers

    rows = []
    for n in layers:
        torch.manual_seed(0)
        t0 = time.monotonic()
        ids = torch.randint(0, 256, (batch, seq))
        requests = capture_graphs(make_model(kind, n, dim, ffn), ids)
        compile_s = time.monotonic() - t0
        for request in requests:
            buffers = request_buffers(request)
            base = inductor_baselines(request, buffers)
            row = {"model": f"{kind}-{n}", "graph": request.graph_name,
                   "compile_s": round(compile_s),
                   **compare_plans(buffers, time_limit,
                                   inductor_pool_bytes=base["inductor_pool_bytes"])}
            # Peak bytes held (intermediates + outputs): allocating each buffer alone at best,
            # Inductor's pools, our bi-level pool.
            row.update(live_peak=base["live_peak_bytes"],
                       inductor_pool_peak=base["inductor_pool_peak_bytes"],
                       bilevel_peak=planned_peak(row["bilevel_bytes"], buffers, request))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_synthetic(layers: list[int], time_limit: float) -> list[dict]:
    from loong_compile.planner.generate import layered_instance

    rows = []
    for n in layers:
        row = {"model": f"synthetic-{n}", **compare_plans(layered_instance(n), time_limit)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--minimalloc", action="store_true")
    mode.add_argument("--llama", action="store_true", help="the example Llama")
    mode.add_argument("--hf-llama", action="store_true", help="Hugging Face LlamaForCausalLM")
    mode.add_argument("--synthetic", action="store_true")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per instance (minimalloc: 60) or per graph plan (30)")
    parser.add_argument("--only", default="", help="minimalloc instances, e.g. A,E")
    parser.add_argument("--method", default="auto", help="minimalloc: planner method")
    parser.add_argument("--layers", default="4,8,16,32")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=344)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    if args.minimalloc:
        run_minimalloc(args.time_limit or 60.0, set(filter(None, args.only.split(","))),
                       args.method)
    elif args.llama or args.hf_llama:
        run_models("hf" if args.hf_llama else "llama", layers, args.time_limit or 30.0,
                   args.seq, args.dim, args.ffn, args.batch)
    else:
        run_synthetic(layers, args.time_limit or 30.0)


if __name__ == "__main__":
    main()
