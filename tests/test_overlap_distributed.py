"""Communication under hp > 1 with MEMO: token-slice recompute never replays a collective
(2 gloo ranks, hp = 2), and the example Llama's offloads, reloads and q/k/v all-to-alls
overlap compute in the code Inductor generates on 4 ranks (hp × cp = 2 × 2).  One spawn per
world size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import BUDGET, Probe, Sections, assert_same_loss_and_grads, section_results, sharded_step
from helpers import tiny_llama, token_ids
from loong_compile.mesh import init_mesh
from loong_compile.overlap import overlap_of
from loong_compile.passes import library_passes
from loong_compile.passes.fx_util import is_collective
from loong_compile.testing import run_distributed

ALPHAS = (0.0, 0.5)
LAYERS = 4


def _reference():
    model, ids = tiny_llama(layers=LAYERS), token_ids()
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _step(hp, cp, options, probe=None):
    """One memo step of the 4-layer example on this rank's tokens: (loss, grads, report)."""
    torch._dynamo.reset()
    options = {"hp": hp, "cp": cp, "activations": "memo", "resident_layers": 0, **BUDGET, **options}
    return sharded_step(tiny_llama(layers=LAYERS), token_ids(), init_mesh(hp=hp, cp=cp), options,
                        passes=library_passes() + ([probe] if probe else []))


def _no_replayed_collective(alpha):
    probe = Probe()
    loss, grads, report = _step(2, 1, {"alpha": alpha, "lowering": "aot_eager"}, probe)
    forward, backward = probe.graphs[0].forward.graph, probe.graphs[0].backward.graph
    replayed = [n.name for n in backward.nodes if n.meta.get("loong") == "recompute" and is_collective(n)]
    exchanges = [n.name for n in backward.nodes if n.op == "call_function" and is_collective(n)]
    # what the forward hands the backward: the exchanged q/k/v arrive saved, as the waits' results
    saved = [n for n in forward.output_node().args[0] if isinstance(n, torch.fx.Node)]
    assert_same_loss_and_grads((loss, grads), _reference())     # a failing section fails the test
    return {"replayed": replayed, "exchanges": len(exchanges),
            "saved_exchanges": sum(is_collective(n) for n in saved)}


def _two_ranks(rank, world):
    sections = Sections()
    for alpha in ALPHAS:
        sections.run(alpha, _no_replayed_collective, alpha)
    return sections.results


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_ranks, 2, timeout=600)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_hp2_memo_recomputes_no_collective_and_computes_what_one_process_does(two_ranks, alpha):
    for result in section_results(two_ranks, alpha):
        assert result["replayed"] == []
        assert result["exchanges"] > 0            # the backward's own exchanges are still there
        assert result["saved_exchanges"] >= 3 * LAYERS


def _generated_overlap(dump_dir):
    from loong_compile._compat import generated_code

    (loss, grads, _), codes = generated_code(_step, 2, 2, {"alpha": 0.5, "dump_dir": dump_dir})
    assert_same_loss_and_grads((loss, grads), _reference(), rtol=1e-4, atol=1e-6)
    return [[(s.kind, s.kernels_between, s.wait_line is not None) for s in overlap_of(code)]
            for code in codes]


def _four_ranks(rank, world, dump_dir):
    sections = Sections()
    sections.run("memo", _generated_overlap, f"{dump_dir}/rank{rank}")
    return sections.results


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_distributed(_four_ranks, 4, str(tmp_path_factory.mktemp("dump")), timeout=900)


@pytest.mark.slow
def test_offloads_and_reloads_overlap_compute_in_the_generated_code_on_4_ranks(four_ranks):
    for forward, backward in section_results(four_ranks, "memo"):
        offloads = [s for s in forward if s[0] == "offload"]
        reloads = [s for s in backward if s[0] == "reload"]
        assert len(offloads) == len(reloads) > LAYERS * 3
        assert all(waited and between >= 1 for _, between, waited in offloads + reloads), offloads + reloads


@pytest.mark.slow
def test_q_k_v_all_to_alls_overlap_compute_in_the_generated_code_on_4_ranks(four_ranks):
    """Per layer, in start order: the exchanges of q, k, v (each started where its tensor is
    ready, passes/comm_overlap.py), then out's, whose wait o_proj needs at once."""
    for forward, _ in section_results(four_ranks, "memo"):
        exchanges = [s for s in forward if s[0] == "all_to_all"]
        assert len(exchanges) == 4 * LAYERS and all(waited for _, _, waited in exchanges)
        for layer in range(LAYERS):
            q_k_v = exchanges[4 * layer:4 * layer + 3]
            assert all(between >= 1 for _, between, _ in q_k_v), (layer, exchanges)
