"""Communication under hp > 1 with MEMO: token-slice recompute never replays a collective
(2 gloo ranks, hp = 2), and the example Llama's offloads, reloads and q/k/v all-to-alls
overlap compute in the code Inductor generates on 4 ranks (hp × cp = 2 × 2 and 4 × 1).  One spawn per
world size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import BUDGET, Probe, Sections, assert_same_loss_and_grads, section_results, sharded_step
from helpers import tiny_llama, token_ids
from loong_compile.parallel.mesh import init_mesh
from loong_compile.report.overlap import late_prefetches, overlap_of
from loong_compile.passes import library_passes
from loong_compile.passes.fx.aten_ops import is_collective
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

ALPHAS = (0.0, 0.5)
LAYERS = 4
EXAMPLE = {"layers": LAYERS, "dim": 128, "ffn": 344}   # examples/llama.py's defaults
SEQ = 1024


def _inputs(example: bool):
    """The 4-layer test model on the test batch, or the example at its defaults on one sequence
    of its length (Inductor fuses by the sizes it sees)."""
    if example:
        return tiny_llama(**EXAMPLE), token_ids(SEQ, batch=1)
    return tiny_llama(layers=LAYERS), token_ids()


def _reference(example=False):
    model, ids = _inputs(example)
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _step(hp, cp, options, probe=None, example=False):
    """One memo step on this rank's tokens: (loss, grads, report)."""
    torch._dynamo.reset()
    options = {"hp": hp, "cp": cp, "activations": "memo", "resident_layers": 0, **BUDGET, **options}
    return sharded_step(*_inputs(example), init_mesh(hp=hp, cp=cp), options,
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


def _recorded_hf_llama(dump_dir):
    """transformers' Llama (4 layers, a 32000-token vocabulary, one 256-token sequence, the
    labels passed to the model) under memo at hp = 2, compiled by Inductor: the waits one step
    blocks on, per layer and kind (ops/exposure.py's record, as gpu-check takes it; on CPU the
    times are host times), and the generated backward's reloads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loong_compile import LoongBackend, shard_batch
    from loong_compile.ops.exposure import per_layer, recording

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    ids = torch.randint(0, 32000, (1, 256), generator=torch.Generator().manual_seed(1))
    batch = shard_batch(ids, ids, init_mesh(hp=2, cp=1))
    options = {"hp": 2, "cp": 1, "activations": "memo", "alpha": 0.5, "resident_layers": 0,
               "dump_dir": dump_dir, **BUDGET}
    reports = []
    compiled = torch.compile(model, backend=LoongBackend(options, on_report=reports.append), fullgraph=True)

    def step():
        compiled(batch.input_ids, position_ids=batch.position_ids, labels=batch.labels,
                 shift_labels=batch.labels, num_items_in_batch=ids.numel() - 1).loss.backward()

    step()                                  # compiles: the record times runs, not tracing
    with recording(layers=LAYERS) as records:
        step()
        rows = per_layer(records)
    [reloads] = [r.summary["kinds"]["reload"] for r in reports[-1].passes
                 if r.name == "overlap" and r.graph_kind == "backward"]
    return ({layer: {kind: n for kind, n in row.items() if kind.endswith("_waits")}
             for layer, row in rows.items()}, reloads)


def _two_ranks(rank, world, dump_dir):
    sections = Sections()
    for alpha in ALPHAS:
        sections.run(alpha, _no_replayed_collective, alpha)
    sections.run("hf", _recorded_hf_llama, f"{dump_dir}/rank{rank}")
    return sections.results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp("dump")), timeout=900)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_hp2_memo_recomputes_no_collective_and_computes_what_one_process_does(two_ranks, alpha):
    for result in section_results(two_ranks, alpha):
        assert result["replayed"] == []
        assert result["exchanges"] > 0            # the backward's own exchanges are still there
        assert result["saved_exchanges"] >= 3 * LAYERS


def test_every_wait_of_a_compiled_step_is_recorded_with_its_layer(two_ranks):
    """gpu-check's exposed time per layer: each layer's 4 exchanges forward and 4 backward
    (q, k, v, out; their gradients) land in that layer's row.  (Offload and reload waits block
    only on CUDA, where a copy is in flight.)"""
    for rows, _ in section_results(two_ranks, "hf"):
        assert rows == {layer: {"collective_waits": 8} for layer in range(LAYERS)}, rows


def test_hf_llamas_prefetches_start_before_their_layer_and_overlap_compute(two_ranks):
    """A user's model and habits (transformers' Llama, labels passed to it) at hp = 2 under memo:
    in the generated backward every reload has compute before its wait and starts before its
    layer's backward begins (passes/activations/offload.py::hold_prefetches holds them there)."""
    for _, reloads in section_results(two_ranks, "hf"):
        assert reloads["starts"] > 3 * LAYERS and reloads["unwaited"] == 0
        assert reloads["exposed"] == 0 and reloads["late_prefetches"] == 0, reloads


def _generated_overlap(hp, cp, dump_dir):
    """Per generated graph (forward, backward): every async span as (kind, kernels between
    start and wait, waited), and the reloads that start after their layer's backward began."""
    from loong_compile._compat.inductor import generated_code

    (loss, grads, _), codes = generated_code(_step, hp, cp, {"alpha": 0.5, "dump_dir": dump_dir},
                                             example=True)
    assert_same_loss_and_grads((loss, grads), _reference(example=True), rtol=1e-4, atol=1e-6)
    return [([(s.kind, s.kernels_between, s.wait_line is not None) for s in overlap_of(code)],
             len(late_prefetches(overlap_of(code)))) for code in codes]


MESHES = {"memo 2x2": (2, 2), "memo 4x1": (4, 1)}


def _four_ranks(rank, world, dump_dir):
    sections = Sections()
    for label, (hp, cp) in MESHES.items():
        sections.run(label, _generated_overlap, hp, cp, f"{dump_dir}/{hp}x{cp}/rank{rank}")
    return sections.results


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_distributed(_four_ranks, 4, str(tmp_path_factory.mktemp("dump")), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_offloads_and_reloads_overlap_compute_in_the_generated_code_on_4_ranks(four_ranks, mesh):
    """Every offload and reload has a kernel before its wait, and every prefetch starts before
    the backward of the layer that needs it."""
    for (forward, _), (backward, late) in section_results(four_ranks, mesh):
        offloads = [s for s in forward if s[0] == "offload"]
        reloads = [s for s in backward if s[0] == "reload"]
        assert len(offloads) == len(reloads) > LAYERS * 3
        assert all(waited and between >= 1 for _, between, waited in offloads + reloads), offloads + reloads
        assert late == 0


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_q_k_v_all_to_alls_overlap_compute_in_the_generated_code_on_4_ranks(four_ranks, mesh):
    """Per layer, in start order: the exchanges of q, k and v, then out's (o_proj needs it at
    once: nothing is left to overlap).  At 2x2 q's arrival is an unpacking copy and starts
    first (passes/schedule/exchange_order.py), so every q/k/v exchange has a kernel before its wait.
    At 4x1 (one head per rank) all three arrive as views: the last to start has nothing left
    to run before the ring, the other two have."""
    for (forward, _), _ in section_results(four_ranks, mesh):
        exchanges = [s for s in forward if s[0] == "all_to_all"]
        assert len(exchanges) == 4 * LAYERS and all(waited for _, _, waited in exchanges)
        for layer in range(LAYERS):
            between = [b for _, b, _ in exchanges[4 * layer:4 * layer + 3]]
            overlapped = between if mesh == "memo 2x2" else between[:2]
            assert all(b >= 1 for b in overlapped), (layer, exchanges)
