"""passes/memory_plan/plan_pass.py inside Inductor: layer keys, the report, fall-backs, and end to end
(bit-identical training with and without the plan, pools in the generated code, and a peak
that is never higher), in one process and on 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_llama
import loong_compile as lc
from loong_compile import _compat
from loong_compile._compat.inductor import generated_code
from loong_compile.passes.memory_plan import plan_pass as plan_pass_module
from loong_compile.report.allocator import measure_peak_bytes
from loong_compile.passes.fx.module_paths import layer_of_paths, normalize_module_path
from loong_compile.passes.memory_plan.plan_pass import MemoryPlanPass, inductor_config_patches, layer_of_origins
from loong_compile.passes.memory_plan.request import PoolBuffer, PoolRequest
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

# A buffer carved out of a pool in Inductor's generated code (the module header always
# defines ``alloc_from_pool``; a call on a pool is what matters).
POOL_ALLOCATION = "= alloc_from_pool(pool"


def test_module_paths_to_layer_keys():
    assert normalize_module_path("L['self'].model.layers.3.mlp") == "model.layers.3.mlp"
    assert normalize_module_path("L['self'].layers[3]._modules['mlp']") == "layers.3.mlp"
    assert layer_of_paths(["L['self'].model", "L['self'].model.layers.3",
                           "L['self'].model.layers.3.experts.5"]) == "model.layers.3"
    assert layer_of_paths(["L['self'].lm_head"]) is None
    # However the compiled function reached the model (transformers' wrapped forward, a step
    # function's global or local), the layer is named from the model on.
    for root in ("L['args'][0]", "G['model']", "L['model']", "L['kwargs']['model']"):
        assert layer_of_paths([root, f"{root}.model.layers.2"]) == "model.layers.2", root
    origins = [("a", ["L['s'].layers.0"]), ("b", ["L['s'].layers.1"]), ("c", []),
               ("d", ["L['s'].layers.1"]), ("e", ["L['s'].layers.0"])]
    assert layer_of_origins(origins) == "layers.0"  # tie: the latest origin's layer
    assert layer_of_origins(origins[:4]) == "layers.1"
    assert layer_of_origins([("c", [])]) is None


# -- the pass on hand-made requests (no compile) -----------------------------

def make_request(dynamic=None, n_layers=3):
    """A backward in miniature: per layer three temporaries, outputs piling up."""
    buffers, outputs = [], []
    for k in range(n_layers):
        base = 1 + 6 * k
        origin = [(f"n{k}", [f"L['self'].layers[{k}]"])]
        buffers += [PoolBuffer([f"buf{3 * k}"], 4096, base, base + 3, origin),
                    PoolBuffer([f"buf{3 * k + 1}"], 1024, base + 1, base + 5, origin),
                    PoolBuffer([f"buf{3 * k + 2}"], 2048, base + 3, base + 6, origin)]
        outputs.append((8192, base + 5, 6 * n_layers + 2))
    steps = 6 * n_layers + 2
    background = [sum(size for size, start, end in outputs if start <= t < end)
                  for t in range(steps)]
    return PoolRequest("0_backward", "backward", "cpu", buffers, steps, [background],
                               [False] * steps, outputs, inductor_pools=[(8192, 0, steps)],
                               dynamic=dynamic)


def run_pass(request, time_limit=2.0):
    ctx = type("Ctx", (), {"config": type("C", (), {"solver_time_limit": time_limit})(),
                           "state": {}})()
    return MemoryPlanPass().run(request, ctx)


@pytest.mark.compat
def test_pass_places_every_buffer_and_reports_the_peaks():
    request = make_request()
    summary = run_pass(request)
    assert len(request.placement) == len(request.buffers)
    assert summary["changed"] + summary["own_allocations"] == summary["matched"] == 9
    assert summary["arena_bytes"] >= summary["lower_bound_bytes"] > 0
    assert summary["peak_bytes"] <= summary["alone_peak_bytes"] < summary["single_pool_peak_bytes"]
    assert summary["layers"] == 3 and summary["pools"] >= 1 and summary["status"] == "optimal"
    assert {"inductor_pool_bytes", "inductor_pool_peak_bytes", "solve_time_s", "method",
            "notes"} <= set(summary)
    assert str(request).count("pool") >= 6  # the dump shows the placement


def test_dynamic_sizes_and_planner_errors_keep_inductors_allocation(monkeypatch):
    request = make_request(dynamic="symbolic buffer sizes (dynamic shapes)")
    summary = run_pass(request)
    assert request.placement is None and summary["status"] == "inductor_fallback"
    assert "symbolic" in summary["reason"]

    def broken(*args, **kwargs):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(plan_pass_module, "plan_pools", broken)
    request = make_request()
    summary = run_pass(request)
    assert request.placement is None and summary["status"] == "inductor_fallback"
    assert "planner bug" in summary["reason"]


def test_solver_failure_uses_the_greedy_plan_and_says_so(monkeypatch):
    from loong_compile.passes.memory_plan.solver import pools as pools_module

    def broken(*args, **kwargs):
        raise RuntimeError("HiGHS crashed")

    monkeypatch.setattr(pools_module, "plan_bilevel", broken)
    request = make_request()
    summary = run_pass(request)
    assert request.placement is not None and summary["status"] == "solver_failed"
    assert any("HiGHS crashed" in note and "greedy" in note for note in summary["notes"])


# -- end to end ---------------------------------------------------------------

@pytest.fixture
def one_thread():
    """Inductor's CPU kernels accumulate with atomics across threads (the embedding
    gradient): only one thread makes two runs bit-identical, with or without a plan."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(kind: str, n_layers: int) -> nn.Module:
    return tiny_llama(hf=kind == "hf", layers=n_layers, ffn=160)


def logits_of(model, ids, pos):
    out = model(ids, position_ids=pos)
    return getattr(out, "logits", out)


def train_steps(kind: str, options: dict, ids: torch.Tensor, pos: torch.Tensor, labels,
                steps: int = 2, n_layers: int = 2) -> dict:
    """Compile ``kind`` with backend="loong" and run ``steps`` training steps (SGD).

    Returns per-step losses and gradients, the generated code (first step), the
    memory-plan summaries and the measured peak bytes of forward and backward
    (later steps).
    """
    torch._dynamo.reset()
    model = make_model(kind, n_layers)
    reports = []
    compiled = torch.compile(model, backend=lc.LoongBackend(options, on_report=reports.append),
                             fullgraph=True)
    out = {"losses": [], "grads": [], "code": []}
    for step in range(steps):
        def forward():
            return logits_of(compiled, ids, pos)

        if step == 0:
            logits, out["code"] = generated_code(forward)
        else:
            logits, out["forward_peak"] = measure_peak_bytes(forward)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        del logits
        if step == 0:
            _, code = generated_code(loss.backward)
            out["code"] += code
        else:
            _, out["backward_peak"] = measure_peak_bytes(loss.backward)
        out["losses"].append(loss.detach())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    out["summaries"] = {r.graph_kind: r.summary for report in reports for r in report.passes
                        if r.name == "memory_plan"}
    return out


# The allocator's measured peak also sees what runs around the graphs (Dynamo's guards, the
# runtime wrappers): in one full-suite run the planned forward measured 5 KB above the unplanned
# one while the predicted peaks were equal (alone, that test measures them equal).  One
# activation of these models is 32 KiB, so a plan holding one buffer more than Inductor's
# allocation still fails.
MEASUREMENT_SLACK = 8 * 1024


def assert_identical(plain: dict, planned: dict) -> None:
    for a, b in zip(plain["losses"], planned["losses"]):
        assert torch.equal(a, b)
    for a, b in zip(plain["grads"], planned["grads"]):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_plan_is_bit_identical_uses_pools_and_never_raises_the_peak(kind, one_thread):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(64).expand_as(ids)
    plain = train_steps(kind, {"memory_plan": False}, ids, pos, ids)
    planned = train_steps(kind, {"memory_plan": True}, ids, pos, ids)
    assert_identical(plain, planned)
    # Our pools in the generated code of both graphs; none without the plan.
    assert len(planned["code"]) == 2 and all(POOL_ALLOCATION in c for c in planned["code"])
    assert not any(POOL_ALLOCATION in c for c in plain["code"])
    # The report: arena vs lower bound vs Inductor's pools, and the peaks, per graph.
    assert set(planned["summaries"]) == {"forward", "backward"}
    for summary in planned["summaries"].values():
        assert summary["status"] in ("optimal", "level_optimal", "time_limit")
        assert summary["arena_bytes"] >= summary["lower_bound_bytes"] > 0
        assert summary["peak_bytes"] <= summary["alone_peak_bytes"]
        assert summary["inductor_pool_peak_bytes"] >= summary["alone_peak_bytes"]
    # Measured: the planned graphs never hold more at once than Inductor's own allocation.
    assert planned["forward_peak"] <= plain["forward_peak"] + MEASUREMENT_SLACK
    assert planned["backward_peak"] <= plain["backward_peak"] + MEASUREMENT_SLACK


def test_dynamic_sequence_length_falls_back_and_says_so(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 16))
    reports = []
    compiled = torch.compile(model, backend=lc.LoongBackend({"memory_plan": True},
                                                           on_report=reports.append))
    x = torch.randn(24, 16)
    torch._dynamo.mark_dynamic(x, 0)
    (out,), code = generated_code(lambda: (compiled(x),))
    out.sum().backward()
    expected = model(x)
    torch.testing.assert_close(out, expected)
    summaries = [r.summary for report in reports for r in report.passes if r.name == "memory_plan"]
    assert summaries and all(s["status"] == "inductor_fallback" for s in summaries)
    assert all("dynamic" in s["reason"] for s in summaries)
    assert not any(POOL_ALLOCATION in c for c in code)


def test_second_compile_of_the_same_graph_still_plans_and_reports(one_thread):
    """Inductor's FX graph cache would hand back the first compile's code without running our
    hook, so the second report would lack the plan: the backend turns that cache off."""
    summaries = []
    for _ in range(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 16))
        reports = []
        compiled = torch.compile(model, backend=lc.LoongBackend({"memory_plan": True},
                                                               on_report=reports.append))
        compiled(torch.randn(24, 16)).sum().backward()
        summaries.append({r.graph_kind for report in reports for r in report.passes
                          if r.name == "memory_plan"})
    assert summaries == [{"forward", "backward"}] * 2


@pytest.mark.compat
def test_plain_inductor_through_the_config_patches(one_thread):
    torch.manual_seed(0)
    planned = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(),
                            nn.Linear(96, 32))
    plain = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(),
                          nn.Linear(96, 32))
    plain.load_state_dict(planned.state_dict())
    x = torch.randn(16, 32)
    summaries = []
    options = {**inductor_config_patches(time_limit=5, on_summary=summaries.append),
               "fx_graph_cache": False}
    loss = torch.compile(planned, backend="inductor", options=options)(x).square().sum()
    loss.backward()
    ref = torch.compile(plain, backend="inductor", options={"fx_graph_cache": False})(x)
    ref = ref.square().sum()
    ref.backward()
    assert torch.equal(loss, ref)
    for p, q in zip(planned.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert {s["graph"].split("_", 1)[1] for s in summaries} == {"forward", "backward"}


# -- 4 ranks -------------------------------------------------------------------

# transformers builds a (refused) causal mask under torch.compile where Dynamo folds
# torch.compiler.is_exporting() to True (torch 2.11): the HF model runs only where it does not
MULTI_RANK_KINDS = ("llama", "hf") if _compat.has("dynamo_traces_is_exporting") else ("llama",)

def distributed_worker(rank: int, world: int) -> dict:
    from loong_compile.parallel.tokens import shard_batch

    mesh = lc.init_mesh(hp=2, cp=2)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    shard = shard_batch(ids, ids, mesh)
    results = {}
    for kind in MULTI_RANK_KINDS:
        runs = {planned: train_steps(kind, {"hp": 2, "cp": 2, "memory_plan": planned},
                                     shard.input_ids, shard.position_ids, shard.labels,
                                     steps=1, n_layers=1)
                for planned in (False, True)}
        try:
            assert_identical(runs[False], runs[True])
            identical = True
        except AssertionError as exc:
            identical = repr(exc)
        results[kind] = {"identical": identical,
                         "pools_in_code": [POOL_ALLOCATION in c for c in runs[True]["code"]],
                         "summaries": runs[True]["summaries"]}
    return results


@pytest.mark.compat
@pytest.mark.slow
def test_four_ranks_hp2_cp2_bit_identical_with_the_plan(monkeypatch):
    # One Inductor compile worker per rank: four ranks on a small machine would
    # otherwise each start a pool of compile subprocesses.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    results = run_distributed(distributed_worker, 4, timeout=900)
    for rank, by_kind in enumerate(results):
        for kind, r in by_kind.items():
            label = f"rank {rank} {kind}"
            assert r["identical"] is True, (label, r["identical"])
            assert r["pools_in_code"] == [True, True], label
            assert set(r["summaries"]) == {"forward", "backward"}, label
            for summary in r["summaries"].values():
                # The attention ops are custom ops: their steps are volatile, and the
                # layout around them still keeps the predicted peak at the bound.
                assert summary["status"] in ("optimal", "level_optimal", "time_limit"), label
                assert summary["peak_bytes"] <= summary["alone_peak_bytes"], label
