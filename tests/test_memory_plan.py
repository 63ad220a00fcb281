"""passes/memory_plan.py: layer keys from module paths, and our offsets inside Inductor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loong_compile.passes.memory_plan import (
    inductor_config_patches, layer_of_origins, layer_of_paths, normalize_module_path,
)


def test_module_paths_to_layer_keys():
    assert normalize_module_path("L['self'].model.layers.3.mlp") == "model.layers.3.mlp"
    assert normalize_module_path("L['self'].layers[3]._modules['mlp']") == "layers.3.mlp"
    assert layer_of_paths(["L['self'].model", "L['self'].model.layers.3",
                           "L['self'].model.layers.3.experts.5"]) == "model.layers.3"
    assert layer_of_paths(["L['self'].lm_head"]) is None
    origins = [("a", ["L['s'].layers.0"]), ("b", ["L['s'].layers.1"]), ("c", []),
               ("d", ["L['s'].layers.1"]), ("e", ["L['s'].layers.0"])]
    assert layer_of_origins(origins) == "layers.0"  # tie: the latest origin's layer
    assert layer_of_origins(origins[:4]) == "layers.1"
    assert layer_of_origins([("c", [])]) is None


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 96), nn.Linear(96, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)).sin())


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).sum()


@pytest.mark.slow
def test_planned_pools_give_bit_identical_training_step():
    torch.manual_seed(0)
    planned, plain = Stack(), Stack()
    plain.load_state_dict(planned.state_dict())
    x = torch.randn(16, 32)
    summaries = []
    options = {**inductor_config_patches(time_limit=5, on_summary=summaries.append),
               "fx_graph_cache": False}
    loss = torch.compile(planned, backend="inductor", options=options)(x)
    loss.backward()
    ref = torch.compile(plain, backend="inductor", options={"fx_graph_cache": False})(x)
    ref.backward()
    assert torch.equal(loss, ref)
    for p, q in zip(planned.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    # Training graphs went through our planner (Inductor alone would not pool them); the
    # forward saves every value it makes, so it may have no intermediates to plan.
    assert {s["graph"] for s in summaries} <= {"0_forward", "0_backward"}
    backward = next(s for s in summaries if s["graph"] == "0_backward")
    assert backward["changed"] == backward["matched"] > 0
    assert backward["arena_bytes"] >= backward["lower_bound_bytes"] > 0
    assert backward["layers"] == 3 and backward["status"] != "inductor_fallback"
