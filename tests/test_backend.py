"""The pipeline: stages, the pass contract, reports, dumps, explain, registration."""

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch
import torch.fx

import loong_compile as lc
from loong_compile import LoongBackend, LoongConfigError
from loong_compile.passes.base import SplitGraphs

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (.ci/compat)


class ReluToAbs:
    """Stage dynamo: replace relu by abs, an observable change of the numbers."""

    name, stage = "relu_to_abs", "dynamo"

    def enabled(self, config):
        return True

    def run(self, gm, ctx):
        hits = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.relu, torch.nn.functional.relu)]
        for n in hits:
            n.target = torch.abs
            n.kwargs = {}
        return {"matched": len(hits), "changed": [n.name for n in hits]}


class CountJoint:
    name, stage = "count_joint", "joint"
    provides = ("joint_tangents",)

    def enabled(self, config):
        return True

    def run(self, gm, ctx):
        placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        ctx.state["joint_tangents"] = sum(p.startswith("tangents") for p in placeholders)
        return {"matched": len(gm.graph.nodes), "tangents": ctx.state["joint_tangents"]}


class CountSaved:
    name, stage = "count_saved", "split"
    requires = ("joint_tangents",)

    def enabled(self, config):
        return True

    def run(self, split: SplitGraphs, ctx):
        assert isinstance(split, SplitGraphs)
        return {"saved": len(split.saved_values()), "seen_tangents": ctx.state["joint_tangents"]}


class CountPostGrad:
    name, stage = "count_post_grad", "post_grad"

    def enabled(self, config):
        return True

    def run(self, graph, ctx):
        assert isinstance(graph, torch.fx.Graph)
        return {"kind": ctx.graph_kind, "ops": sum(n.op == "call_function" for n in graph.nodes)}


class NeverApplies(CountPostGrad):
    name = "never_applies"

    def enabled(self, config):
        return False


def small_passes():
    return [ReluToAbs(), CountJoint(), CountSaved(), CountPostGrad(), NeverApplies()]


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _run(lowering, **options):
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(5, 8)
    reports = {}
    backend = LoongBackend({"lowering": lowering, **options}, passes=small_passes(),
                           on_report=lambda r: reports.__setitem__(r.graph_id, r))
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    (report,) = reports.values()
    return model, x, out, report


def _expected(model, x):
    return model.b(torch.abs(model.a(x)))


@pytest.mark.parametrize("lowering", ["inductor", "aot_eager", "eager"])
def test_stages_run_in_order_and_the_rewrite_takes_effect(lowering):
    model, x, out, report = _run(lowering)
    torch.testing.assert_close(out, _expected(model, x))
    ran = [(r.name, r.stage, r.graph_kind) for r in report.passes]
    expected = {
        "eager": [("relu_to_abs", "dynamo", "dynamo")],
        "aot_eager": [("relu_to_abs", "dynamo", "dynamo"), ("count_joint", "joint", "joint"),
                      ("count_saved", "split", "split")],
        "inductor": [("relu_to_abs", "dynamo", "dynamo"), ("count_joint", "joint", "joint"),
                     ("count_saved", "split", "split"), ("count_post_grad", "post_grad", "forward"),
                     ("overlap", "inductor", "forward"),     # read from each graph's generated code
                     ("count_post_grad", "post_grad", "backward"), ("overlap", "inductor", "backward")],
    }[lowering]
    assert ran == expected
    assert report.summary("relu_to_abs") == {"matched": 1, "changed": ["relu"]}
    if lowering != "eager":
        assert report.summary("count_joint")["tangents"] == 1
        assert report.summary("count_saved")["seen_tangents"] == 1  # state flows between passes
        assert report.summary("count_saved")["saved"] >= 1
    assert {"name": "never_applies", "stage": "post_grad",
            "reason": "does not apply to this config"} in report.skipped


def test_gradients_flow_through_rewritten_graph():
    model, x, out, _ = _run("inductor")
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _expected(model, x).sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)


def test_disable_passes_skips_and_reports():
    model, x, out, report = _run("aot_eager", disable_passes=["relu_to_abs"])
    torch.testing.assert_close(out, model(x))  # relu kept
    assert "relu_to_abs" not in [r.name for r in report.passes]
    assert {"name": "relu_to_abs", "stage": "dynamo", "reason": "disable_passes"} in report.skipped


def test_disable_unknown_pass_is_an_error():
    with pytest.raises(LoongConfigError, match="disable_passes names 'relu2abs'.*known passes are"):
        LoongBackend({"disable_passes": ["relu2abs"]}, passes=small_passes())


def test_disabling_a_pass_another_needs_names_both():
    """recompute and offload act on the activation plan: without it they would report NO_PLAN."""
    with pytest.raises(LoongConfigError) as error:
        LoongBackend({"activations": "memo", "disable_passes": ["activations"]})
    message = str(error.value)
    assert "pass 'recompute' requires 'activation_plan'" in message
    assert "provided by pass 'activations'" in message and "(disable_passes)" in message
    assert "remove 'activations' from disable_passes" in message
    # the same pipeline without memo: nothing requires the plan, so disabling it is fine
    LoongBackend({"activations": "sc++", "disable_passes": ["activations"]})


def test_schedule_checks_custom_pass_contracts():
    with pytest.raises(LoongConfigError, match="'count_saved' requires 'joint_tangents', provided by "
                                               "pass 'count_joint'.*disable_passes"):
        LoongBackend({"disable_passes": ["count_joint"]}, passes=small_passes())

    class NeedsNothingProvided(CountSaved):
        name, requires = "needs_magic", ("magic",)

    with pytest.raises(LoongConfigError, match="'needs_magic' requires 'magic', which no pass"):
        LoongBackend({}, passes=[NeedsNothingProvided()])

    class ProvidesLate(CountPostGrad):
        name, provides = "provides_late", ("joint_tangents",)

    with pytest.raises(LoongConfigError, match="provided by pass 'provides_late'.*runs after 'count_saved'"):
        LoongBackend({}, passes=[CountSaved(), ProvidesLate()])


def test_library_passes_declare_their_contracts():
    from loong_compile.passes import library_passes

    for p in library_passes():
        assert isinstance(p.requires, tuple) and isinstance(p.provides, tuple), p.name
    facts = {p.name: (p.requires, p.provides) for p in library_passes()}
    assert facts["token_locality"][0] == ("attention_sites",)
    assert facts["recompute"][0] == facts["offload"][0] == ("activation_plan",)


def test_bad_stage_is_an_error():
    class Bad(ReluToAbs):
        stage = "pre_dynamo"

    with pytest.raises(LoongConfigError, match="stage 'pre_dynamo'"):
        LoongBackend({}, passes=[Bad()])


def test_dump_dir_has_code_and_reports(tmp_path):
    _, _, _, report = _run("inductor", dump_dir=str(tmp_path))
    graph_dir = tmp_path / "rank0" / f"graph{report.graph_id}"
    files = sorted(p.name for p in graph_dir.iterdir())
    for stem in ["dynamo_before", "dynamo_after", "joint_before", "joint_after",
                 "split_forward_before", "split_backward_after", "post_grad_forward_before",
                 "post_grad_backward_after"]:
        assert any(f.endswith(f"_{stem}.py") for f in files), (stem, files)
    dynamo_after = next(graph_dir.glob("*_dynamo_after.py")).read_text()
    assert "= torch.abs(linear)" in dynamo_after and "= torch.relu(" not in dynamo_after
    data = json.loads((graph_dir / "report.json").read_text())
    assert set(data) >= {"graph_id", "rank", "config", "passes", "skipped", "stage_seconds"}
    assert data["config"]["dump_dir"] == str(tmp_path)
    assert [p["name"] for p in data["passes"]] == ["relu_to_abs", "count_joint", "count_saved",
                                                   "count_post_grad", "overlap", "count_post_grad",
                                                   "overlap"]
    for p in data["passes"]:
        assert set(p) == {"name", "stage", "graph_kind", "seconds", "summary"} and p["seconds"] >= 0
    md = (graph_dir / "report.md").read_text()
    assert "### `relu_to_abs` (dynamo" in md and "**matched**: `1`" in md and "## Skipped" in md


def test_explain_reports_without_a_training_step():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(5, 8)
    before = [p.detach().clone() for p in model.parameters()]
    report = lc.explain(model, x, lowering="aot_eager")
    assert isinstance(report, lc.Report) and len(report.graphs) == 1
    assert report.graphs[0].config["lowering"] == "aot_eager"
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert report.to_dict()["graphs"][0]["rank"] == 0


def test_explain_splits_model_kwargs_from_options():
    class WithKwarg(torch.nn.Module):
        def forward(self, x, scale=None):
            return x * scale

    report = lc.explain(WithKwarg(), torch.ones(2), scale=torch.tensor(3.0), lowering="eager",
                        options={"allow_graphs_without_attention": True})
    config = report.graphs[0].config
    assert config["allow_graphs_without_attention"] is True and config["lowering"] == "eager"


def test_explain_reports_the_backward_too(monkeypatch):
    from loong_compile import backend as backend_module

    monkeypatch.setattr(backend_module, "library_passes", small_passes)
    report = lc.explain(Tiny(), torch.randn(3, 8))
    kinds = [r.graph_kind for r in report.graphs[0].passes if r.name == "count_post_grad"]
    assert kinds == ["forward", "backward"]


def test_global_inductor_config_is_left_unchanged():
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    keys = ["custom_partitioner_fn", "post_grad_custom_post_pass", "joint_custom_pre_pass",
            "fx_graph_cache", "memory_planning"]
    before = {k: getattr(iconfig, k) for k in keys}
    f_keys = ["force_non_lazy_backward_lowering", "enable_autograd_cache"]
    f_before = {k: getattr(fconfig, k) for k in f_keys}
    _run("inductor", dump_dir=None)
    lc.explain(Tiny(), torch.randn(3, 8), lowering="aot_eager")
    assert {k: getattr(iconfig, k) for k in keys} == before
    assert {k: getattr(fconfig, k) for k in f_keys} == f_before


@pytest.mark.parametrize("simdlen,vectorized", [(None, True), (1, False)])
def test_inductor_options_reach_this_compile_only(simdlen, vectorized):
    import torch._inductor.config as iconfig

    from loong_compile._compat.inductor import generated_code

    options = {} if simdlen is None else {"inductor_options": {"cpp.simdlen": simdlen}}
    compiled = torch.compile(lambda x: (x * 2).sin().sum(-1), backend=LoongBackend(options))
    _, code = generated_code(compiled, torch.randn(64, 256))
    assert ("at::vec::" in "\n".join(code)) == vectorized
    assert iconfig.cpp.simdlen is None


def test_inductor_options_may_not_set_the_backends_own_hooks():
    compiled = torch.compile(lambda x: x.sin(), backend=LoongBackend(
        {"inductor_options": {"post_grad_custom_post_pass": None}}))
    with pytest.raises(Exception, match="inductor_options sets 'post_grad_custom_post_pass'.*fix: remove"):
        compiled(torch.randn(4))


def test_single_process_needs_no_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    model, x, out, report = _run("aot_eager")
    assert report.rank == 0


def test_registered_by_import_and_by_entry_point():
    assert "loong" in torch._dynamo.list_backends()
    (ep,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "loong"]
    assert ep.value == "loong_compile.backend:loong_backend"
    # importing again (or reloading) must not raise "duplicate name"
    import importlib
    importlib.reload(lc)


@pytest.mark.slow
def test_backend_string_works_without_import_and_emits_trace_artifacts(tmp_path):
    script = textwrap.dedent("""
        import torch
        f = torch.compile(lambda x: torch.relu(x) * 2, backend="loong", options={"lowering": "aot_eager"})
        x = torch.randn(4, requires_grad=True)
        f(x).sum().backward()
        import sys
        assert "loong_compile" in sys.modules  # loaded through the entry point
        print("OK")
    """)
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert '"name": "loong_dynamo' in logs and '"name": "loong_report"' in logs  # dynamo_before/after
