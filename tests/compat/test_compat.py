"""The torch capabilities of loong_compile/_compat/: present exactly where documented,
the memory-plan hook installed wherever they say it should be, degradations reported."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import loong_compile as lc
import loong_compile.passes
from loong_compile import _compat
from loong_compile._compat.pool_planner import install_pool_planning
from loong_compile.errors import LoongUnsupportedError
from loong_compile.passes.memory_plan.request import pool_planning_patches

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("name", sorted(_compat.CAPABILITIES))
def test_capability_is_present_exactly_on_the_documented_versions(name):
    capability = _compat.CAPABILITIES[name]
    assert capability.available == capability.expected(), (
        f"torch {torch.__version__}: {name} available={capability.available}, but "
        f"docs/compat.md and _compat say torch {capability.versions} has it")


def test_documented_ranges_tell_versions_apart():
    inference_aware = _compat.CAPABILITIES["inference_aware_post_grad_pass"]
    assert not inference_aware.expected("2.11.0")
    assert inference_aware.expected("2.12.0") and inference_aware.expected("2.15.0+cu130")


def test_memory_plan_hook_installs_wherever_the_capability_says():
    requests = []

    def planner(request):
        requests.append(request)     # declining: Inductor's default allocation

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches = pool_planning_patches(planner, "test-hook-installs")
    compiled = torch.compile(model, backend="inductor",
                             options={**patches, "fx_graph_cache": False})
    compiled(x).sum().backward()
    if _compat.has("inductor_pool_planning"):
        assert {r.graph_kind for r in requests} == {"forward", "backward"}, (
            "the memory-plan hook did not run although this torch has inductor_pool_planning")
    else:
        assert not requests and any("inductor_pool_planning" in str(w.message) for w in caught)


def test_a_wrapper_the_hook_cannot_replace_is_refused():
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    class OtherWrapper(PythonWrapperCodegen):
        def memory_plan(self):  # a wrapper with its own planner (like the C++ wrappers)
            pass

    wrapper = OtherWrapper.__new__(OtherWrapper)
    with pytest.raises(LoongUnsupportedError, match="OtherWrapper"):
        install_pool_planning(wrapper, lambda request: None)


def test_a_degraded_capability_warns_with_its_name_and_consequence():
    _compat.warn_degraded.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="inductor_pool_planning.*memory_plan=True is off"):
            _compat.warn_degraded("inductor_pool_planning")
    finally:
        _compat.warn_degraded.cache_clear()


def test_compile_report_lists_the_degraded_capabilities(monkeypatch):
    missing = _compat.CAPABILITIES["inference_aware_post_grad_pass"]
    monkeypatch.setattr(_compat, "degraded", lambda: [missing])
    graphs = lc.explain(nn.Linear(4, 4), torch.randn(2, 4)).graphs
    assert {"name": missing.name, "stage": "torch", "reason": missing.without} in graphs[0].skipped


def test_private_torch_modules_are_imported_only_inside_compat():
    """The rule of the house: a private torch module (``torch._inductor``, ``torch._dynamo``,
    ...) is imported by the shims of ``loong_compile/_compat/`` only."""
    root = Path(lc.__file__).parent
    sources = [p for p in root.rglob("*.py") if "_compat" not in p.parts]
    sources += list(Path(lc.passes.__file__).parent.rglob("*.py"))
    private = re.compile(r"^\s*(from|import) torch\._\w+", re.M)
    offenders = [str(p) for p in sources if private.search(p.read_text())]
    assert not offenders


def test_held_ancestors_are_what_inductor_would_compute(monkeypatch):
    """The scheduler hook updates the ancestors of the nodes its holds reach instead of making
    them all again: on a memo backward (every layer's waits held after its reloads) each node's
    ancestors and order must equal what ``Scheduler.compute_ancestors`` gives."""
    from loong_compile._compat import inductor
    from helpers import run_step

    checked = []
    update = inductor._add_held_ancestors

    def compare(scheduler, holds):
        update(scheduler, holds)
        got = {n.get_name(): (set(n.ancestors), n.min_order) for n in scheduler.nodes}
        scheduler.compute_ancestors()
        want = {n.get_name(): (set(n.ancestors), n.min_order) for n in scheduler.nodes}
        checked.append((len(holds), got == want))

    monkeypatch.setattr(inductor, "_add_held_ancestors", compare)
    run_step("example", {"activations": "memo", "alpha": 0.5, "resident_layers": 0},
             lowering="inductor")
    assert any(holds for holds, _ in checked) and all(same for _, same in checked), checked


def test_a_frame_past_the_recompile_limit_raises_inside_the_context_only():
    """Dynamo runs a frame past its recompile limit uncompiled (on one rank's tokens, without
    2D-Attention: silently wrong); ``recompile_limit_raises`` makes it raise, and only inside."""
    from loong_compile._compat.dynamo import recompile_limit_raises

    def scaled(x):
        return x * 2

    step = torch.compile(scaled, backend="eager", dynamic=False)
    torch.compiler.reset()
    with pytest.raises(Exception, match="(?i)recompile"):  # noqa: PT011 - Dynamo's own error type
        with recompile_limit_raises():
            for size in range(1, 40):
                step(torch.ones(size))
    torch.compiler.reset()
    for size in range(1, 40):  # outside: Dynamo's default (run uncompiled), nothing raised
        step(torch.ones(size))
    torch.compiler.reset()
