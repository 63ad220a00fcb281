"""benchmarks/longest_sequence.py (issue 36): its search, its models, and one run on a tiny CPU
config under a memory cap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import longest_sequence as bench  # noqa: E402


@pytest.mark.parametrize("edge,start,limit,want", [
    (5000, 256, 2 ** 20, (4864, 5120)),   # doubles to 4096, bisects (4096, 8192) to within 1/16
    (4096, 256, 2 ** 20, (4096, 4096)),   # a power of two: the bisection finds nothing longer
    (200, 256, 2 ** 20, (0, 0)),          # the first length fails
    (10 ** 9, 256, 3000, (2816, 3000)),   # never fails: stops at the limit's last multiple
    (1300, 512, 2 ** 20, (1024, 1024)),   # the step is the start: 1536 fails
])
def test_the_search_doubles_then_bisects_to_a_sixteenth(edge, start, limit, want):
    tried = []

    def fits(tokens):
        tried.append(tokens)
        assert tokens % start == 0 and tokens <= limit
        return tokens <= edge

    found = bench.longest(fits, start, limit)
    low, high = want
    assert low <= found <= high and found <= edge
    assert len(tried) == len(set(tried))                 # no length tried twice
    if found:
        failed = min((t for t in tried if t > found), default=None)
        # the first longer length that failed is within a sixteenth (or one step) of the answer
        assert failed is None or failed - found <= max(start, found // 16)


PUBLISHED_BILLIONS = {"llama3.2-1b": 1.24, "llama3.2-3b": 3.21, "qwen2.5-1.5b": 1.54,
                      "qwen2.5-7b": 7.62}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_one_gpu_presets_are_their_published_models(name):
    """The estimator's preset and the model the benchmark builds from it (on the meta device)
    have the published parameter count."""
    from transformers import AutoModelForCausalLM

    from loong_compile.estimate.presets import load_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(bench.model_config(name))
    assert model.num_parameters() == load_model(name).parameters
    assert round(load_model(name).parameters / 1e9, 2) == PUBLISHED_BILLIONS[name]


def test_a_tiny_model_runs_under_a_cap_with_its_masks_dropped():
    """The whole benchmark on CPU: the tiny Llama under backend="loong" reaches the limit within
    the cap (a 2,048-token step peaks near 18 MiB; plain Inductor's S x S mask takes 34 MiB),
    with both attention masks dropped."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "longest_sequence.py"), "--model", "tiny",
         "--variants", "loong-none", "--start", "512", "--limit", "2048", "--cap-mib", "28",
         "--mask"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert row["variant"] == "loong-none" and row["longest"] == 2048, row
    assert row["tried"] == [512, 1024, 2048]
    assert row["masks_dropped"] == 2 and row["masks_kept"] == 0
    assert row["tokens_per_s"] > 0 and 0 < row["peak_gib"] * 1024 <= 28
