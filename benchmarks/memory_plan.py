"""Memory planner benchmarks: arena vs lower bound, solve times, and peak memory.

    python benchmarks/memory_plan.py --minimalloc [--time-limit 60] [--only A,B]
    python benchmarks/memory_plan.py --llama [--layers 4,8,16,32] [--time-limit 30]
    python benchmarks/memory_plan.py --hf-llama [--layers 4,8,16] [--time-limit 30]
    python benchmarks/memory_plan.py --synthetic [--layers 4,8,16,32] [--time-limit 30]

``--minimalloc``: the 11 public MiniMalloc instances (``../shared/benchmarks/
minimalloc``), each planned flat with ``--time-limit`` seconds; prints arena /
lower bound, the proven bound and the time.

``--llama``: the example Llama (examples/llama.py), ``--hf-llama``: a randomly
initialised Hugging Face ``LlamaForCausalLM``, one training step compiled by
Inductor twice: as is (its default allocation; the buffers of the forward and
backward graphs are captured through the pool-planning hook, which declines)
and with the memory-plan pass (``inductor_config_patches``).  Per graph it
prints the DSA comparison of :func:`compare_plans` (Inductor's own pool
heuristic, greedy, flat MIP, bi-level, same time limit), the layout the pass
chose (pools, buffers on their own, time), the peaks it predicts (bytes held
at once: every buffer on its own = the bound, our layout, one pool for the
whole graph, Inductor's own pools) and the peaks measured with the CPU
allocator's profiler events during the forward call and during
``loss.backward()``, with and without the plan.  ``--synthetic`` runs
:func:`compare_plans` on ``solver.generate.layered_instance`` (no compile).
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

from loong_compile.passes.memory_plan.solver import Buffer, plan, plan_bilevel  # noqa: E402
from loong_compile.report.allocator import measure_peak_bytes  # noqa: E402

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
    """One graph's buffers (with ``Buffer.layer`` keys) planned several ways.

    Returns the lower bound and, per planner, the arena as a multiple of it
    and the solve time: ``inductor`` (its own pool heuristic, when the caller
    measured it), ``by_size`` (best fit in decreasing size, one order: the
    classic greedy), ``greedy`` (our greedy: several orders, best kept),
    ``mip`` (greedy then the flat MIP) and ``bilevel``; the MIP and the
    bi-level planner get the same time limit.
    """
    from loong_compile.passes.memory_plan.solver.greedy import place_in_order
    from loong_compile.passes.memory_plan.solver.problem import Instance

    inst = Instance(buffers, alignment)
    by_size = place_in_order(inst, sorted(range(inst.n), key=lambda k: -inst.sizes[k]))
    plans = {
        "greedy": plan(buffers, alignment=alignment, method="greedy"),
        "mip": plan(buffers, alignment=alignment, time_limit=time_limit, method="mip"),
        "bilevel": plan_bilevel(buffers, alignment=alignment, time_limit=time_limit),
    }
    lb = plans["greedy"].lower_bound
    row: dict = {"buffers": len(buffers),
                 "layers": len({b.layer for b in buffers if b.layer is not None}),
                 "lower_bound": lb}
    if inductor_pool_bytes is not None:
        row["inductor"] = round(inductor_pool_bytes / lb, 4) if lb else 1.0
    row["by_size"] = round(inst.arena(by_size) * inst.unit / lb, 4) if lb else 1.0
    for name, p in plans.items():
        row[name] = round(p.ratio, 4)
        row[f"{name}_s"] = round(p.solve_time, 2)
        row[f"{name}_status"] = p.status
    return row


def make_model(kind: str, n_layers: int, dim: int, ffn: int, heads: int, kv_heads: int):
    """The example Llama (``llama``) or a randomly initialised Hugging Face Llama (``hf``)."""
    import torch

    torch.manual_seed(0)
    if kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa"))
    sys.path.insert(0, str(ROOT / "examples"))
    from llama import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads,
                             ffn_dim=ffn))


def training_step_peaks(model, ids, options: dict) -> dict:
    """Compile ``model`` with Inductor and ``options``; after one step that compiles the
    forward and backward, measure the allocator's peak above the start of the forward
    call and of ``loss.backward()`` (bytes)."""
    import torch
    import torch.nn.functional as F

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", options=options, fullgraph=True)

    def forward():
        out = compiled(ids)
        return getattr(out, "logits", out)

    t0 = time.monotonic()
    for step in range(2):
        if step:
            logits, forward_peak = measure_peak_bytes(forward)
        else:
            logits = forward()
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        del logits
        if step:
            _, backward_peak = measure_peak_bytes(loss.backward)
        else:
            loss.backward()
            compile_s = time.monotonic() - t0
        model.zero_grad(set_to_none=True)
    return {"forward": forward_peak, "backward": backward_peak, "compile_s": compile_s}


def run_models(kind: str, layers: list[int], time_limit: float, seq: int, dim: int, ffn: int,
               heads: int, kv_heads: int, batch: int) -> list[dict]:
    import torch

    from loong_compile.passes.memory_plan.plan_pass import inductor_config_patches, request_buffers
    from loong_compile.passes.memory_plan.request import pool_planning_patches

    rows = []
    for n in layers:
        ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
        requests, summaries = {}, {}

        def capture(request):  # declines: Inductor keeps its default allocation
            requests[request.graph_kind] = request

        plain = training_step_peaks(
            make_model(kind, n, dim, ffn, heads, kv_heads), ids,
            {**pool_planning_patches(capture, f"capture-{time.time()}"),
             "fx_graph_cache": False})
        planned = training_step_peaks(
            make_model(kind, n, dim, ffn, heads, kv_heads), ids,
            {**inductor_config_patches(time_limit, on_summary=lambda s: summaries.__setitem__(
                s["graph"].split("_", 1)[1], s)), "fx_graph_cache": False})
        for graph, request in requests.items():
            summary = summaries[graph]
            row = {"model": f"{kind}-{n}", "graph": graph,
                   **compare_plans(request_buffers(request), time_limit,
                                   inductor_pool_bytes=summary["inductor_pool_bytes"])}
            row.update(
                pools=summary["pools"], own=summary["own_allocations"],
                layout_s=summary["solve_time_s"],
                alone_peak=summary["alone_peak_bytes"], peak=summary["peak_bytes"],
                single_pool_peak=summary["single_pool_peak_bytes"],
                inductor_pool_peak=summary["inductor_pool_peak_bytes"],
                measured_default=plain[graph], measured_planned=planned[graph],
                compile_s=round(plain["compile_s"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_synthetic(layers: list[int], time_limit: float) -> list[dict]:
    from loong_compile.passes.memory_plan.solver.generate import layered_instance

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
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    if args.minimalloc:
        run_minimalloc(args.time_limit or 60.0, set(filter(None, args.only.split(","))),
                       args.method)
    elif args.llama or args.hf_llama:
        run_models("hf" if args.hf_llama else "llama", layers, args.time_limit or 30.0,
                   args.seq, args.dim, args.ffn, args.heads, args.kv_heads, args.batch)
    else:
        run_synthetic(layers, args.time_limit or 30.0)


if __name__ == "__main__":
    main()
