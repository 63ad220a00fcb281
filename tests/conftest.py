"""Fixtures of every test, and the shared helpers: those needing no fixture live in
tests/helpers.py (imported here; test modules import them from ``helpers``, never from
another test module), the Hugging Face model zoo in tests/hf_models.py."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import helpers  # noqa: E402,F401  (examples/ must be importable first)


@pytest.fixture(autouse=True, scope="session")
def _kept_ranks():
    """One set of gloo ranks per world size serves every run_distributed call of the session
    (loong_compile.testing: each call still starts as a new process would)."""
    from loong_compile.testing import keep_ranks

    with keep_ranks():
        yield


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

    def document_kwargs(self):
        return {"hp": 2, "cp": 2, "sp_group": "g_sp", "hp_group": "g_hp", "cp_group": "g_dout"}


class StubMesh:
    """What the dynamo passes read of a mesh (sizes and group names), for graph tests in one
    process: the graphs stand for a rank of ``hp * cp``; nothing runs a collective."""

    def __init__(self, hp: int = 1, cp: int = 2):
        self.hp, self.cp, self.sp = hp, cp, hp * cp
        self.group_names = {"sp": "sp", "hp": "hp", "dkv_outer": "cp"}

    def document_kwargs(self) -> dict:
        return {"hp": self.hp, "cp": self.cp, "sp_group": "sp", "hp_group": "hp",
                "cp_group": "cp"}

    def scan_kwargs(self, heads_split: bool = False) -> dict:
        places = [(c, h) for c in range(self.cp) for h in range(self.hp)]
        return {"hp": self.hp, "cp": self.cp, "places": places, "group_rank": 0, "scan_group": "sp"}


def dynamo_graph(fn, *inputs, **kw_inputs):
    """The FX graph Dynamo captures for fn (with its fake-tensor metadata, and each input's
    source, which Dynamo drops once the compile is over)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, {n: n.meta["grapharg"] for n in gm.graph.find_nodes(op="placeholder")
                            if "grapharg" in n.meta}))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*inputs, **kw_inputs)
    ((gm, sources),) = graphs
    for node, grapharg in sources.items():
        node.meta["grapharg"] = grapharg
    return gm


STAND_INS = ROOT / "tests" / "stand_ins"


@pytest.fixture
def stand_ins(monkeypatch):
    """tests/stand_ins on sys.path for this test only (and for ranks it spawns)."""
    monkeypatch.syspath_prepend(str(STAND_INS))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "kernel_layout")]:
        del sys.modules[name]


@pytest.fixture
def flash_attn_stand_in(stand_ins):
    """The CPU flash-attn 2.8 stand-in, importable as ``flash_attn`` during this test only."""
    from loong_compile.ops import kernels

    kernels._flash_attn_usable.cache_clear()
    import flash_attn

    yield flash_attn
    kernels._flash_attn_usable.cache_clear()


def error_of(fn) -> str:
    """``"ErrorClass: message"`` of what fn raised (unwrapping Dynamo's BackendCompilerFailed),
    or "no error"."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        inner = getattr(e, "inner_exception", e)
        return f"{type(inner).__name__}: {inner}"
    return "no error"


def still_in_step() -> bool:
    """An all_reduce over the world: it returns only if no rank was left inside a collective."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()
