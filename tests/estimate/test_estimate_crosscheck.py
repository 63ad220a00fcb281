"""The estimator agrees with what the compiled graph really saves: the activation terms (issue 7,
item 5; with the MLP token-tiled, issue 52) and the chunked LM head (issue 22).

For the example Llama on CPU, the bytes the ``activations`` / ``offload`` passes report
for a transformer layer (not the last, which also keeps the final norm's input) must
equal ``estimate.memory.layer_activations`` per category within 2%. A failure names
the category, both numbers, and the estimator term whose size matches the gap.
"""

from __future__ import annotations

import operator

import pytest
import torch

import loong_compile as lc
from loong_compile.estimate.memory import layer_activations
from loong_compile.estimate.models import ModelSpec
from loong_compile.parallel.rules import CATEGORIES   # the report's category names are the estimator's
from llama import Llama, LlamaConfig
from transformers import LlamaConfig as HFLlamaConfig
from helpers import BUDGET

CFG = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128)
BATCH, SEQ, FP32 = 2, 64, 4
SPEC = ModelSpec("example", CFG.dim, CFG.n_layers, CFG.n_heads, CFG.n_kv_heads, CFG.ffn_dim,
                 CFG.vocab_size)
# a transformers Llama of the same sizes (what `loong plan`'s llama presets are)
HF_CONFIG = HFLlamaConfig(hidden_size=CFG.dim, intermediate_size=CFG.ffn_dim, num_hidden_layers=3,
                          num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads,
                          vocab_size=256)


def compiled_report(policy: str, alpha: float, tile_tokens: int = 0):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return lc.explain(Llama(CFG), ids, lowering="aot_eager", activations=policy, alpha=alpha,
                      resident_layers=1, tile_tokens=tile_tokens)


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


# the MLP token-tiled (issue 52, tiles of 16 tokens): the estimator's tiled layer keeps none of
# its intermediates, as the compiled graph
@pytest.mark.parametrize("policy,alpha,tiles", [("none", 0.0, 0), ("sc++", 0.0, 0), ("memo", 0.125, 0),
                                               ("memo", 0.5, 0), ("none", 0.0, 16), ("sc++", 0.0, 16),
                                               ("memo", 0.5, 16)])
def test_estimator_agrees_with_compiled_saved_bytes(policy, alpha, tiles):
    report = compiled_report(policy, alpha, tiles)
    estimate = layer_activations(SPEC, SEQ, BATCH, FP32, policy, alpha, tiled=bool(tiles))
    if tiles:
        assert report.summary("token_tiling")["changed"]
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


def test_estimator_lm_head_term_equals_what_the_compiled_graph_keeps():
    """Issue 22: the chunked LM head term of ``loong estimate`` is what the compiled step keeps
    from its forward to its backward for the head (the values the partition saves that the
    chunked op produced) plus what the op needs while it runs (its measured peak above what
    it returns), for the example Llama with the loss in the graph, float32."""
    from helpers import Probe

    from loong_compile.report.allocator import measure_peak_bytes
    from loong_compile.estimate.memory import MemoryOptions, ParallelConfig, estimate_memory
    from loong_compile.passes import library_passes
    from loong_compile.passes.fx.storage import base_of, nbytes

    chunk = 16
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    probe, reports = Probe(), []
    backend = lc.LoongBackend({"lowering": "aot_eager", "lm_head_chunk": chunk},
                              passes=library_passes() + [probe], on_report=reports.append)
    model = Llama(CFG)
    step = torch.compile(lc.NextTokenLoss(model), backend=backend, fullgraph=True)
    step(ids, ids, torch.tensor(ids.numel()))
    (head,) = reports[-1].summary("lm_head_loss")["changed"]
    assert head["chunk"] == chunk and head["chunks"] == BATCH * SEQ // chunk
    (split,) = probe.graphs
    op = torch.ops.loong.lm_head_loss.default
    kept = sum(nbytes(v) for v in {base_of(v) for v in split.saved_values()}
               if v.op == "call_function" and v.target is operator.getitem and v.args[0].target is op)

    hidden = torch.randn(BATCH * SEQ, CFG.dim)
    returned = hidden.numel() * FP32 + model.output.weight.numel() * FP32
    _, peak = measure_peak_bytes(lambda: op(
        hidden, model.output.weight, None, ids.flatten(), -100, chunk, 1.0, False, 1.0,
        torch.float32, True))
    working = peak - returned

    estimate = estimate_memory(SPEC, ParallelConfig(seq=SEQ, micro_batch=BATCH),
                               MemoryOptions(dtype_bytes=FP32, lm_head_chunk=chunk))
    term = estimate.terms["activations: LM head"] * 2 ** 30
    assert kept == returned, (kept, returned)                    # dL/dhidden and dL/dW, fp32
    assert abs(term - (kept + working)) <= 0.02 * term, (term, kept, working)
    assert working < 0.2 * BATCH * SEQ * CFG.vocab_size * FP32        # one chunk, not the logits


@pytest.mark.parametrize("policy", ["none", "sc++", "full", "full_offload"])
def test_estimator_counts_what_the_compiled_step_keeps(policy):
    """Issue 52: every byte a transformers Llama's compiled step keeps for its backward (its
    loss in the graph, the head chunked; one process, float32) is in the estimator's
    activation terms: the layers', the LM head's, and what stays outside the layers (token,
    document and label ids, RoPE's angles, the final norm's input and 1/rms, not eq. 13's
    8sbhp).  ``full`` / ``full_offload`` keep each layer's input alone (the attention
    recomputed too); ``full_offload`` moves all of them to the host."""
    from transformers import LlamaForCausalLM

    from loong_compile.estimate import lm_head
    from loong_compile.estimate.hf_config import spec_from_config
    from loong_compile.estimate.memory import MemoryOptions, ParallelConfig, estimate_memory

    config = HF_CONFIG
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    step = lambda i, p, l: model(i, position_ids=p, labels=l, use_cache=False).loss  # noqa: E731
    report = lc.explain(step, ids, positions, ids, lowering="aot_eager", activations=policy,
                        alpha=0.0, resident_layers=0, lm_head_chunk=16, **BUDGET)
    assert report.summary("lm_head_loss")["changed"]
    compiled = report.summary("activations")["activation_bytes"] + 2 * ids.numel() * 8  # + ids, labels

    spec = spec_from_config(config.to_dict(), "tiny-llama")
    options = MemoryOptions(exact=True, activations=policy, alpha=0.0, dtype_bytes=FP32,
                            lm_head_chunk=16, recompute_working_set=False)
    terms = estimate_memory(spec, ParallelConfig(seq=SEQ, micro_batch=BATCH), options).terms
    tokens = BATCH * SEQ
    head_working = lm_head.working_bytes(16, config.vocab_size, FP32)
    estimated = sum(gib for name, gib in terms.items() if name.startswith("activations")) * 2 ** 30
    estimated -= head_working
    layer = layer_activations(spec, SEQ, BATCH, FP32, policy, 0.0)
    if policy == "full_offload":   # the layers' inputs all on the host, not two rounding buffers
        layers = config.num_hidden_layers
        offloaded = report.summary("offload")["host_bytes"]
        assert offloaded == layers * sum(layer.by_category("offloaded").values()) > 0
        estimated += offloaded - terms["activations: MEMO rounding buffers"] * 2 ** 30
    if policy.startswith("full"):
        assert all(x.name == "layer_input" for x in layer.tensors if x.saved)
        assert report.summary("activations")["layers"][0]["attention"]["count"] == 0
    assert abs(compiled - estimated) <= 0.02 * compiled, (compiled, estimated, terms)
    assert terms["activations: outside the layers"] * 2 ** 30 < 8 * tokens * config.hidden_size


def _hf_layer_saved_bytes(rank: int, world: int, hp: int, cp: int) -> dict[str, int]:
    """On every rank: a transformers Llama's first layer's saved bytes per category, under
    ``none`` at ``hp x cp`` (aot_eager, float32), as the compiled graph's report gives them."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(HF_CONFIG).float()
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    batch = lc.shard_batch(ids, ids, lc.init_mesh(hp=hp, cp=cp))
    step = lambda i, p, l: model(i, position_ids=p, labels=l, shift_labels=l,  # noqa: E731
                                 use_cache=False).loss
    report = lc.explain(step, batch.input_ids, batch.position_ids, batch.labels, hp=hp, cp=cp,
                        lowering="aot_eager", lm_head_chunk=16)
    layer = report.summary("activations")["layers"][0]
    return {c: layer[c]["bytes"] for c in CATEGORIES}


def test_estimator_agrees_with_the_compiled_layer_at_hp2_cp2():
    """With d_hp > 1 the attention's output comes back from the SeqAlltoAll into a storage of its
    own, which o_proj saves beside the ring's output (``attention_output_gathered``); the
    estimator's layer equals the compiled one at hp = 2 x cp = 2 (4 ranks), as at one process."""
    from loong_compile.estimate.hf_config import spec_from_config
    from loong_compile.testing import run_distributed

    compiled = run_distributed(_hf_layer_saved_bytes, 4, 2, 2, timeout=300)
    spec = spec_from_config(HF_CONFIG.to_dict(), "tiny-llama")
    estimated = layer_activations(spec, SEQ, BATCH, FP32, "none", 0.0, hp=2, cp=2).by_category("saved")
    assert all(c == compiled[0] for c in compiled) and compiled[0] == estimated, (compiled, estimated)
