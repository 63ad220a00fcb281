"""Fixtures of every test, and nothing else.  The shared helpers are modules beside this one:
helpers.py (builders, steps, multi-rank sections, errors), graph_helpers.py (the passes' graph
tests), hf_models.py (the Hugging Face model zoo) and the trust matrix's trust_*.py.  Test
modules import them by bare name (pytest's default import mode puts this directory on sys.path
before any test module is imported), never from conftest or from another test module."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from helpers import STAND_INS  # noqa: E402  (examples/ must be importable first)


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
    from loong_compile.ops.attention import kernels

    kernels._flash_attn_usable.cache_clear()
    import flash_attn

    yield flash_attn
    kernels._flash_attn_usable.cache_clear()
