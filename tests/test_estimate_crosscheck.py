"""The estimator's activation terms agree with what the compiled graph really saves (issue 7, item 5).

For the example Llama on CPU, the bytes the ``activations`` / ``offload`` passes report
for a transformer layer (not the last, which also keeps the final norm's input) must
equal ``estimate.memory.layer_activations`` per category within 2%. A failure names
the category, both numbers, and the estimator term whose size matches the gap.
"""

from __future__ import annotations

import pytest
import torch

import loong_compile as lc
from loong_compile.estimate.memory import layer_activations
from loong_compile.estimate.models import ModelSpec
from llama import Llama, LlamaConfig

CFG = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128)
BATCH, SEQ, FP32 = 2, 64, 4
SPEC = ModelSpec("example", CFG.dim, CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.ffn_dim,
                 CFG.vocab_size)
CATEGORIES = ("input", "attention", "other")   # the report's category names are the estimator's


def compiled_report(policy: str, alpha: float):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return lc.explain(Llama(CFG), ids, lowering="aot_eager", activations=policy, alpha=alpha,
                      resident_layers=1)


def disagreement(label: str, compiled: dict[str, int], estimated: dict[str, int], estimate) -> list[str]:
    problems = []
    for category, got in compiled.items():
        want = estimated[category]
        if abs(got - want) > 0.02 * max(want, 1):
            gap = got - want
            culprits = [x.name for x in estimate.tensors
                        if x.category == category and x.bytes == abs(gap)]
            problems.append(f"{label} {category}: compiled graph {got} B, estimator {want} B "
                            f"(gap {gap:+d} B; estimator terms of that size: {culprits or 'none'})")
    return problems


@pytest.mark.parametrize("policy,alpha", [("none", 0.0), ("sc++", 0.0), ("memo", 0.125), ("memo", 0.5)])
def test_estimator_agrees_with_compiled_saved_bytes(policy, alpha):
    report = compiled_report(policy, alpha)
    estimate = layer_activations(SPEC, SEQ, BATCH, FP32, policy, alpha)
    layer = report.summary("activations")["layers"][0]
    saved = {c: layer[c]["bytes"] for c in CATEGORIES}
    problems = []
    if policy == "memo":
        # what the layer keeps for its backward: all of input and attention; of the others,
        # the offloaded alpha slice (the rest is recomputed, token-wise)
        offload = report.summary("offload")["layers"][0]
        est_off, est_rec = estimate.by_category("offloaded"), estimate.by_category("recomputed")
        problems += disagreement("offloaded", {"all": offload["offloaded_bytes"]},
                                 {"all": sum(est_off.values())}, estimate)
        problems += disagreement("recomputed", {"all": offload["recomputed_bytes"]},
                                 {"all": sum(est_rec.values())}, estimate)
        problems += disagreement("classified", saved, estimate.by_category("bytes"), estimate)
    else:
        problems += disagreement("saved", saved, estimate.by_category("saved"), estimate)
    assert not problems, "\n".join(problems)
