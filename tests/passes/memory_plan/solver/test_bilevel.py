"""Bi-level planning: identical layers share one level-1 plan; escaping buffers go to level 2."""

from __future__ import annotations

import pytest

from loong_compile.passes.memory_plan.solver import Buffer, plan_bilevel, verify
from loong_compile.passes.memory_plan.solver import bilevel as bilevel_module
from loong_compile.passes.memory_plan.solver.generate import layered_instance, tiled_instance


def relative_offsets(p, layer):
    """A layer's inner buffers' offsets relative to the lowest of them, in step order."""
    inner = [(b.start, b.end, b.size, off) for b, off in zip(p.buffers, p.offsets)
             if b.layer == layer and not b.name.endswith(".out")]
    base_step = min(s for s, _, _, _ in inner)
    base_off = min(off for _, _, _, off in inner)
    return sorted((s - base_step, e - base_step, size, off - base_off) for s, e, size, off in inner)


def test_identical_layers_get_identical_offsets(monkeypatch):
    calls = []
    real_plan = bilevel_module.plan

    def counting_plan(buffers, **kw):
        calls.append(len(buffers))
        return real_plan(buffers, **kw)

    monkeypatch.setattr(bilevel_module, "plan", counting_plan)
    buffers = layered_instance(6, per_layer=25, seed=3)
    p = plan_bilevel(buffers, time_limit=10)
    verify(buffers, p.offsets, p.arena, 64)
    assert len(p.level1) == 1 and set(p.layer_structure.values()) == {0}
    assert calls == [25, 6 + 6 + 3]  # one level-1 solve; level 2: blocks, outputs, head/tail
    reference = relative_offsets(p, "layers.0")
    for k in range(1, 6):
        assert relative_offsets(p, f"layers.{k}") == reference
    assert p.arena >= p.lower_bound and p.status in ("optimal", "level_optimal", "time_limit")


def test_escaping_buffers_are_planned_at_level_two():
    buffers = layered_instance(3, per_layer=10, seed=1)
    p = plan_bilevel(buffers, time_limit=5)
    level2_names = {b.name for b in p.level2.buffers}
    assert {"layers.0.out", "layers.1.out", "layers.2.out", "head", "tail"} <= level2_names
    assert not any(name.startswith("layers.0.t") for name in level2_names)
    assert sum(name.startswith("layer layers.") for name in level2_names) == 3


def test_different_layer_structures_are_solved_separately():
    a = [Buffer(b.size, b.start, b.end, layer="layers.0") for b in tiled_instance(1, 12, steps=20)]
    b = [Buffer(b.size, 30 + b.start, 30 + b.end, layer="layers.1")
         for b in tiled_instance(2, 12, steps=20)]
    c = [Buffer(b.size, 60 + b.start, 60 + b.end, layer="layers.2")
         for b in tiled_instance(1, 12, steps=20)]
    buffers = a + b + c
    p = plan_bilevel(buffers, alignment=1, time_limit=5)
    verify(buffers, p.offsets, p.arena)
    assert len(p.level1) == 2
    assert p.layer_structure["layers.0"] == p.layer_structure["layers.2"] != \
        p.layer_structure["layers.1"]


def test_explicit_layer_spans_and_layerless_input():
    # With an explicit span ending at step 4, the buffer live to step 6 escapes.
    buffers = [Buffer(64, 0, 3, layer="L"), Buffer(64, 1, 4, layer="L"),
               Buffer(64, 2, 6, layer="L"), Buffer(128, 5, 8)]
    p = plan_bilevel(buffers, alignment=64, time_limit=2, layer_spans={"L": (0, 4)})
    verify(buffers, p.offsets, p.arena, 64)
    assert len(p.level1[0].buffers) == 2
    q = plan_bilevel([Buffer(128, 0, 4), Buffer(64, 2, 6)], time_limit=2)
    assert q.level1 == () and q.arena == 192


def test_bilevel_rejects_bad_input():
    from loong_compile.passes.memory_plan.solver import LoongPlanError

    with pytest.raises(LoongPlanError):
        plan_bilevel([Buffer(64, 3, 1, layer="L")])
    with pytest.raises(LoongPlanError):
        plan_bilevel([Buffer(64, 0, 1, layer="L")], time_limit=-1)


def test_draw_plan_writes_a_png(tmp_path):
    from loong_compile.passes.memory_plan.solver import draw_plan

    buffers = layered_instance(2, per_layer=8, seed=2)
    p = plan_bilevel(buffers, time_limit=2)
    path = draw_plan(p, tmp_path / "plan.png", title="two layers")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
