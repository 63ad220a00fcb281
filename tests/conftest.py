"""Fixtures of every test, and the shared helpers: those needing no fixture live in
tests/helpers.py (imported here; test modules import them from ``helpers``, never from
another test module), the Hugging Face model zoo in tests/hf_models.py."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import helpers  # noqa: E402,F401  (examples/ must be importable first)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo's caches and counters do not leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class FakeMesh:
    """What the attention pass reads of a mesh: the constant arguments of attention_2d."""

    def attention_kwargs(self):
        return {"hp": 2, "cp": 2, "inner_ring": 1, "hp_group": "g_hp", "kv_inner_group": "",
                "kv_outer_group": "g_out", "dkv_inner_group": "", "dkv_outer_group": "g_dout"}


def dynamo_graph(fn, *inputs):
    """The FX graph Dynamo captures for fn (with its fake-tensor metadata)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm
