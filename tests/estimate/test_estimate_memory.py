"""The memory estimator: the 4D paper's Tables 2 and 7 cell by cell, its equations symbolically,
and the extension terms on hand-computed cases and limits."""

import dataclasses

import pytest
import sympy as sp

from loong_compile.errors import LoongConfigError
from loong_compile.estimate import equations as mem
from loong_compile.estimate.equations import model_state_terms
from loong_compile.estimate.memory import GIB, MemoryOptions, ParallelConfig, estimate_memory, layer_activations
from loong_compile.estimate.models import ModelSpec
from loong_compile.estimate.presets import load_model
from loong_compile.parallel.rules import CATEGORIES

LLAMA31_8B = load_model("llama3.1-8b")

# The paper's Table 2 (A100 40GB) and Table 7 (H100 94GB): Llama-3.1-8B, s = 8192,
# rows (TP, CP, PP, MBS), columns GPU counts, GB per GPU; "-" where TP*CP*PP > GPUs.
TABLE_2_GPUS = (8, 16, 32, 64, 128, 256)
TABLE_2 = """
(4, 1, 2, 1) 27.2 21.59 18.79 17.39 16.69 16.34
(4, 1, 2, 2) 37.58 31.97 29.16 27.76 27.06 26.71
(4, 1, 2, 4) 58.33 52.72 49.91 48.51 47.81 47.46
(4, 2, 2, 1) - 16.41 13.6 12.2 11.5 11.15
(4, 2, 2, 2) - 21.59 18.79 17.39 16.69 16.34
(4, 2, 2, 4) - 31.97 29.16 27.76 27.06 26.71
(4, 2, 2, 8) - 52.72 49.91 48.51 47.81 47.46
(2, 2, 2, 1) 32.81 27.2 24.4 23.00 22.29 21.94
(2, 2, 2, 2) 43.19 37.58 34.77 33.37 32.67 32.32
(2, 4, 2, 1) - 22.02 19.21 17.81 17.11 16.76
(2, 4, 2, 2) - 27.2 24.40 23.00 22.29 21.94
(4, 2, 1, 1) 28.1 22.49 19.69 18.28 17.58 17.23
(4, 2, 1, 2) 33.76 28.15 25.35 23.94 23.24 22.89
(4, 2, 1, 4) 45.08 39.47 36.67 35.27 34.56 34.21
(2, 2, 4, 1) - 23.19 20.01 18.43 17.64 17.24
(2, 2, 4, 2) - 33.69 30.51 28.93 28.14 27.74
(2, 2, 4, 4) - 54.69 51.51 49.93 49.14 48.74
(2, 4, 1, 1) 39.32 33.71 30.9 29.5 28.8 28.45
(2, 4, 1, 2) 44.98 39.37 36.56 35.16 34.46 34.11
(2, 4, 1, 4) 56.3 50.69 47.89 46.48 45.78 45.43
(4, 1, 1, 1) 33.76 28.15 25.35 23.94 23.24 22.89
(4, 1, 1, 2) 45.08 39.47 36.67 35.27 34.56 34.21
(2, 2, 1, 1) 44.98 39.37 36.56 35.16 34.46 34.11
(2, 2, 1, 2) 56.3 50.69 47.89 46.48 45.78 45.43
(2, 1, 2, 1) 43.19 37.58 34.77 33.37 32.67 32.32
(2, 1, 2, 2) 63.94 58.33 55.52 54.12 53.42 53.07
"""
TABLE_7_GPUS = (4, 8, 16, 32, 64)
TABLE_7 = """
(2, 1, 1, 1) 67.52 56.30 50.69 47.89 46.48
(2, 1, 1, 2) 90.16 78.94 73.34 70.53 69.13
(2, 1, 1, 4) 135.45 124.23 118.62 115.82 114.42
(2, 2, 1, 1) 56.20 44.98 39.37 36.56 35.16
(2, 2, 1, 2) 67.52 56.30 50.69 47.89 46.48
(2, 2, 1, 4) 90.16 78.94 73.33 70.53 69.13
(2, 2, 1, 8) 135.45 124.23 118.62 115.82 114.42
(4, 1, 1, 1) 44.98 33.76 28.15 25.35 23.94
(4, 1, 1, 2) 56.30 45.08 39.47 36.67 35.27
(4, 1, 1, 4) 78.95 67.73 62.12 59.31 57.91
(2, 1, 2, 1) 54.41 43.19 37.58 34.77 33.37
(2, 1, 2, 2) 75.16 63.94 58.33 55.52 54.12
(2, 1, 2, 4) 116.66 105.43 99.83 97.02 95.62
(1, 2, 1, 1) 89.95 78.74 70.32 68.92 68.22
(1, 2, 1, 2) 112.60 101.38 95.77 92.97 91.56
(1, 4, 1, 1) 78.63 67.41 61.80 59.00 57.60
(1, 4, 1, 2) 89.95 78.74 73.13 70.32 68.92
"""
# Printed cells that disagree with the paper's own eq. 18: Table 7's (1, 2, 1, 1) row from
# 16 GPUs on holds the formula's values for twice the GPUs (the row is shifted one column).
SHIFTED_CELLS = {("table7", (1, 2, 1, 1), 16), ("table7", (1, 2, 1, 1), 32), ("table7", (1, 2, 1, 1), 64)}


def _cells(name, text, gpus_list, capacity):
    for line in text.strip().splitlines():
        head, values = line.split(")")
        tp, cp, pp, mbs = (int(x) for x in head.strip("(").split(","))
        for gpus, value in zip(gpus_list, values.split()):
            yield name, (tp, cp, pp, mbs), gpus, None if value == "-" else float(value), capacity


CELLS = [*_cells("table2", TABLE_2, TABLE_2_GPUS, 40), *_cells("table7", TABLE_7, TABLE_7_GPUS, 94)]


def _paper_estimate(row, gpus, capacity):
    tp, cp, pp, mbs = row
    config = ParallelConfig(seq=8192, dp=gpus // (tp * cp * pp), tp=tp, pp=pp, cp=cp, micro_batch=mbs)
    return estimate_memory(LLAMA31_8B, config, MemoryOptions(), capacity)


def test_tables_have_every_cell():
    assert len(CELLS) == 26 * 6 + 17 * 5


@pytest.mark.parametrize("table,row,gpus,printed,capacity", CELLS,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}gpus" for c in CELLS])
def test_paper_table_cell(table, row, gpus, printed, capacity):
    tp, cp, pp, _ = row
    if printed is None:
        # "-": the paper leaves out configurations needing more GPUs than there are.
        assert tp * cp * pp > gpus
        return
    result = _paper_estimate(row, gpus, capacity)
    if (table, row, gpus) in SHIFTED_CELLS:
        # Documented inconsistency: the formula gives a different value here, and the printed
        # value is the formula's at twice the GPUs.  The formula is not bent to match.
        assert abs(result.estimate_gib - printed) > 0.5
        assert _paper_estimate(row, 2 * gpus, capacity).estimate_gib == pytest.approx(printed, abs=0.01)
        return
    assert result.estimate_gib == pytest.approx(printed, abs=0.01)
    # The paper's colours: green <= 80% of capacity, yellow up to capacity, red above.
    expected = "fits" if printed <= 0.8 * capacity else "near limit" if printed <= capacity else "exceeds"
    if abs(printed - 0.8 * capacity) > 0.01 and abs(printed - capacity) > 0.01:
        assert result.verdict == expected


def test_pp1_single_stage_holds_embedding_and_lm_head():
    """With p = 1 the paper's tables use eq. 6's 2hv/t + h (eq. 18 prints the first stage's hv/t)."""
    config = ParallelConfig(seq=8192, dp=2, tp=4)        # Table 2 row (4, 1, 1, 1) at 8 GPUs
    terms = estimate_memory(LLAMA31_8B, config).terms
    states = sum(terms[x] for x in ("parameters", "gradients", "optimizer states")) * GIB
    h, v, t, d = LLAMA31_8B.hidden, LLAMA31_8B.vocab, 4, 2
    layers = 2 * LLAMA31_8B.layers * h ** 2 * ((1 + 8 / 32 + 1.5 * LLAMA31_8B.ffn / h) / t + 1 / h)
    assert states == pytest.approx((6 + 12 / d) * (2 * h * v / t + h + layers), rel=1e-12)
    assert terms["activations: LM head"] > 0


def _layers_bracket():
    """2(L/p) h^2 ((1 + k/a + 3/2 h_ffn/h)/t + 1/h), typed from eqs. 6-10."""
    h, a, k, f, L, t, p = mem.h, mem.a, mem.k, mem.f, mem.L, mem.t, mem.p
    return 2 * (L / p) * h ** 2 * ((1 + k / a + sp.Rational(3, 2) * f / h) / t + 1 / h)


def _zero1_states():
    return sum(term.expr for term in model_state_terms(1)).subs(mem.PAPER_LAYER).subs({mem.stage: 0, mem.hp: 1})


def test_zero1_over_d_c_is_eq10_symbolically():
    """First stage of p > 1 stages (KroneckerDelta(0, p - 1) = 0): eq. 10 exactly."""
    h, v, d, t, c = mem.h, mem.v, mem.d, mem.t, mem.c
    eq10 = (6 + 12 / (d * c)) * (h * v / t + _layers_bracket())
    states = _zero1_states().subs(sp.KroneckerDelta(0, mem.p - 1), 0)
    assert sp.simplify(states - eq10) == 0


def test_p1_states_symbolically():
    """p = 1: the stage holds embedding, LM head and final norm: eq. 6's bracket, ZeRO-1 over d*c."""
    h, v, d, t, c = mem.h, mem.v, mem.d, mem.t, mem.c
    eq6 = (6 + 12 / (d * c)) * (2 * h * v / t + h + _layers_bracket().subs(mem.p, 1))
    assert sp.simplify(_zero1_states().subs(mem.p, 1) - eq6) == 0


def test_zero_stages_symbolically():
    psi = mem.STAGE_PARAMS.subs({mem.stage: 0, mem.p: 1, mem.t: 1})
    n = mem.d * mem.c * mem.hp
    stages = {0: 18 * psi, 1: 6 * psi + 12 * psi / n, 2: 2 * psi + 16 * psi / n, 3: 18 * psi / n}
    for zero, expected in stages.items():
        total = sum(term.expr for term in model_state_terms(zero)).subs({mem.stage: 0, mem.p: 1, mem.t: 1})
        assert sp.simplify(total - expected) == 0, zero
    # ZeRO-0 on one GPU is eq. 4: 18 x eq. 3's parameter count.
    assert sp.simplify(psi - mem.TOTAL_PARAMS) == 0


def test_states_on_host_leave_the_gathered_units_on_the_device():
    """ZeRO-3 with the states on the host (FSDP2's CPU offload), Llama-3.1-8B on 8 GPUs: the
    device holds the root unit (embedding, final norm), the LM head and two blocks, their bf16
    parameters and as many gradient bytes; the host the 18 bytes a parameter over 8 ranks; the
    activations are those of ZeRO-3."""
    h, v, kv_width, ffn = 4096, 128256, 8 * 128, 14336
    block = 2 * h * h + 2 * h * kv_width + 3 * h * ffn + 2 * h     # q, o; k, v; gate, up, down; 2 norms
    gathered = (v * h + h) + v * h + 2 * block                     # root, head, running + prefetched
    config, gpus = ParallelConfig(seq=8192, dp=8), 8
    on_host = estimate_memory(LLAMA31_8B, config, MemoryOptions(zero=3, states_on_host=True))
    on_device = estimate_memory(LLAMA31_8B, config, MemoryOptions(zero=3))
    assert on_host.terms["parameters (gathered on device)"] * GIB == pytest.approx(2 * gathered, rel=1e-12)
    assert on_host.terms["gradients (unsharded on device)"] * GIB == pytest.approx(2 * gathered, rel=1e-12)
    params = 32 * block + 2 * v * h + h
    assert params == LLAMA31_8B.parameters
    assert on_host.host == pytest.approx({"host: parameters": 2 * params / gpus / GIB,
                                          "host: gradients": 4 * params / gpus / GIB,
                                          "host: optimizer states": 12 * params / gpus / GIB}, rel=1e-12)
    device_states = sum(on_device.terms[x] for x in ("parameters", "gradients", "optimizer states"))
    assert on_host.estimate_gib - on_device.estimate_gib == pytest.approx(
        4 * gathered / GIB - device_states, rel=1e-12)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_states_on_host_need_zero3(zero):
    with pytest.raises(LoongConfigError, match=f"states_on_host=True with zero={zero}"):
        MemoryOptions(zero=zero, states_on_host=True)


def test_model_states_hybrid_zero_over_hp():
    """d_hp shards model states like d_cp (LoongTrain 5.1): (cp, hp) = (2, 4) equals (8, 1)."""
    a = estimate_memory(LLAMA31_8B, ParallelConfig(seq=8192, dp=2, cp=2, hp=4))
    b = estimate_memory(LLAMA31_8B, ParallelConfig(seq=8192, dp=2, cp=8))
    for name in ("parameters", "gradients", "optimizer states"):
        assert a.terms[name] == pytest.approx(b.terms[name], rel=1e-12)


def test_hp_splits_sequence_like_cp_while_kv_heads_suffice():
    a = estimate_memory(LLAMA31_8B, ParallelConfig(seq=131072, cp=2, hp=4))
    b = estimate_memory(LLAMA31_8B, ParallelConfig(seq=131072, cp=8))
    assert a.estimate_gib == pytest.approx(b.estimate_gib, rel=1e-12)


def test_hp_beyond_kv_heads_replicates_kv():
    """d_hp = 16 > 8 KV heads: K and V hold 16/8 x the heads after the all-to-all (LoongTrain 4.2)."""
    s, hidden, heads, kv, layers = 131072, 4096, 32, 8, 32
    with_hp = estimate_memory(LLAMA31_8B, ParallelConfig(seq=s, cp=1, hp=16)).terms
    with_cp = estimate_memory(LLAMA31_8B, ParallelConfig(seq=s, cp=16, hp=1)).terms
    extra = layers * 2 * 2 * (s / 16) * (hidden / heads) * (16 - kv)    # K and V, bf16, per GPU
    name = "activations: transformer layers"
    assert (with_hp[name] - with_cp[name]) * GIB == pytest.approx(extra, rel=1e-12)


def _sizes(model, seq, sp_size, batch=1, beta=2, hp=1):
    """Hand-computed per-GPU bytes of one layer's tensors (LoongTrain notation: S, D, H)."""
    tokens = batch * seq / sp_size
    head_dim = model.hidden // model.heads
    # with hp > 1 the attention output comes back from the all-to-all into a second storage
    gathered = model.hidden if hp > 1 else 0
    return {"x": beta * tokens * model.hidden, "out": beta * tokens * model.hidden,
            "lse": 4 * tokens * model.heads,
            # exact: SiLU(gate) is recomputed by the min-cut partition, so 3 FFN-wide tensors
            "other": tokens * (beta * (4 * model.hidden + gathered + 2 * model.kv_heads * head_dim
                                       + 3 * model.ffn) + 8)}


@pytest.mark.parametrize("policy", ["full", "sc++"])
def test_checkpoint_policies_match_loongtrain(policy):
    """full: 2SD/d_sp per layer; sc++: + (2SD + 4SH)/d_sp (LoongTrain 5.2), bf16."""
    model, s, cp, hp = load_model("7b-gqa"), 262144, 4, 8
    options = MemoryOptions(activations=policy, recompute_working_set=False)
    terms = estimate_memory(model, ParallelConfig(seq=s, cp=cp, hp=hp), options).terms
    name = [x for x in terms if x.startswith("activations: layer inputs")][0]
    dsp, sd = cp * hp, s * model.hidden
    per_layer = 2 * sd / dsp + ((2 * sd + 4 * s * model.heads) / dsp if policy == "sc++" else 0)
    assert terms[name] * GIB == pytest.approx(model.layers * per_layer, rel=1e-12)


def test_recompute_working_set_is_one_layer_of_recomputed_tensors():
    model, s = load_model("7b-gqa"), 65536
    config = ParallelConfig(seq=s, cp=2, hp=2)
    terms = estimate_memory(model, config, MemoryOptions(activations="sc++", exact=True)).terms
    size = _sizes(model, s, 4, hp=2)
    assert terms["activations: recompute working set (one layer)"] * GIB == pytest.approx(size["other"], rel=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_memo_rounding_buffers_and_host_bytes(alpha):
    """MEMO 4.1: two rounding buffers of one layer's skeletal tensors on GPU (one shared buffer for
    the others when alpha = 0); (n - 2)(S_input + S_attn + alpha S_others) on the host."""
    model, s = load_model("llama3.1-8b"), 131072
    config = ParallelConfig(seq=s, cp=4, hp=2)
    result = estimate_memory(model, config, MemoryOptions(activations="memo", alpha=alpha, exact=True))
    size = _sizes(model, s, 8, hp=2)
    kept = size["x"] + size["out"] + size["lse"]
    buffers = 2 * kept + (1 if alpha == 0 else 2) * size["other"]
    assert result.terms["activations: MEMO rounding buffers"] * GIB == pytest.approx(buffers, rel=1e-12)
    host = (model.layers - 2) * (kept + alpha * size["other"])
    assert result.host_gib * GIB == pytest.approx(host, rel=1e-12)
    assert "host: offloaded activations" not in result.terms    # host bytes are not GPU bytes
    assert not any("working set" in name for name in result.terms)   # recompute fills the buffers


def test_double_ring_buffers():
    """One Size(kv) = max(Hkv, d_hp)/H * 4SD/d_sp buffer per ring level (LoongTrain 4.5.5)."""
    model, s = load_model("7b-gqa"), 131072
    options = MemoryOptions(double_ring_buffers=True)

    def buffers(cp, hp, w):
        terms = estimate_memory(model, ParallelConfig(seq=s, cp=cp, hp=hp, inner_ring=w), options).terms
        return terms["Double-Ring KV buffers"] * GIB

    size = lambda hp, dsp: max(model.kv_heads, hp) / model.heads * 4 * s * model.hidden / dsp   # noqa: E731
    assert buffers(8, 2, 2) == pytest.approx(2 * size(2, 16), rel=1e-12)
    assert buffers(8, 2, 8) == pytest.approx(size(2, 16), rel=1e-12)           # one ring: no outer
    assert buffers(2, 16, 1) == pytest.approx(2 * size(16, 32), rel=1e-12)     # KV replicated
    assert buffers(1, 8, 1) == 0


def test_head_groups_hold_one_groups_attention_backward_and_ring_buffer():
    """2D-Attention's backward holds one head group's output gradient and kernel dQ, dK/dV
    (+ the float32 dQ and dK/dV accumulators with a ring), and the ring one group's K/V (issue
    52): G groups of a rank's query heads, min(G, its KV heads) groups of its K/V."""
    model, s = load_model("7b-gqa"), 131072          # 32 query heads, 8 KV heads, bf16
    options = MemoryOptions(double_ring_buffers=True)
    head_dim = model.hidden // model.heads

    def terms(cp, hp, groups):
        config = ParallelConfig(seq=s, cp=cp, hp=hp, head_groups=groups)
        got = estimate_memory(model, config, options).terms
        return got["2D-Attention backward (one head group)"] * GIB, got["Double-Ring KV buffers"] * GIB

    def expected(cp, hp, query_groups, kv_groups):
        local = s / (cp * hp)
        query, kv = model.heads * head_dim, 2 * max(model.kv_heads, hp) * head_dim
        ring = cp > 1
        attention = local * (query / query_groups * (2 * 2 + 4 * ring) + kv / kv_groups * (2 + 4 * ring))
        return attention, 2 * ring * local * kv * 2 / kv_groups   # inner_ring=1: two buffers

    # hp = 2: a rank holds 16 query heads and 4 KV heads; 8 groups share each KV head by two
    for groups, kv_groups in ((1, 1), (4, 4), (8, 4), (16, 4)):
        assert terms(2, 2, groups) == pytest.approx(expected(2, 2, groups, kv_groups), rel=1e-12)
    assert terms(1, 8, 4) == pytest.approx(expected(1, 8, 4, 1), rel=1e-12)   # no ring
    with pytest.raises(LoongConfigError, match=r"head_groups=3 .* use head_groups in \[1, 2, 4, 8, 16\]"):
        estimate_memory(model, ParallelConfig(seq=s, cp=2, hp=2, head_groups=3), options)


def test_switches_off_reduce_to_the_paper():
    config = ParallelConfig(seq=8192, dp=4, tp=2, cp=2)
    paper = estimate_memory(LLAMA31_8B, config)
    assert set(paper.terms) == {"parameters", "gradients", "optimizer states", "activations: transformer layers",
                                "activations: embedding", "activations: LM head"}
    exact = estimate_memory(LLAMA31_8B, config, MemoryOptions(exact=True))
    # exact adds the lse and the two norm statistics and drops SiLU(gate), which the compiler
    # recomputes: per token (4a + 2*4 - 2 h_ffn) / t bytes, over the stage's L layers; and it
    # counts what the compiled graph keeps outside the layers (ids, document ids, RoPE angles,
    # labels, the final norm's input and 1/rms) instead of eq. 13's 8sbhp
    m, t, tokens = LLAMA31_8B, 2, 8192 // 2
    per_token = (4 * m.heads + 8 - 2 * m.ffn) / t
    outside = (8 + 8 + 4 * m.head_dim + 8 + 2 * m.hidden + 4) / t - 8 * m.hidden / t
    assert (exact.estimate_gib - paper.estimate_gib) * GIB == pytest.approx(
        tokens * (m.layers * per_token + outside), rel=1e-9)


def test_overheads_are_reported_apart():
    config = ParallelConfig(seq=8192, dp=4, tp=2, cp=2)
    options = MemoryOptions(cuda_context_gib=0.75, comm_buffers_gib=0.5, fragmentation=0.1)
    plain, loaded = estimate_memory(LLAMA31_8B, config), estimate_memory(LLAMA31_8B, config, options, 40)
    assert loaded.estimate_gib == pytest.approx(plain.estimate_gib, rel=1e-12)
    assert loaded.total_gib == pytest.approx(plain.estimate_gib * 1.1 + 1.25, rel=1e-12)
    assert loaded.limit_gib == pytest.approx(32)


def test_usable_fraction_is_a_parameter():
    config = ParallelConfig(seq=8192, dp=2, tp=4)          # 33.76 GiB on a 40 GiB GPU
    assert estimate_memory(LLAMA31_8B, config, MemoryOptions(), 40).verdict == "near limit"
    assert estimate_memory(LLAMA31_8B, config, MemoryOptions(usable_fraction=0.9), 40).verdict == "fits"


def test_later_pipeline_stages():
    """1F1B: stage i holds p - i micro-batches; the last stage holds the LM head, not the embedding."""
    base = dict(seq=8192, dp=1, tp=2, pp=4)
    first = estimate_memory(LLAMA31_8B, ParallelConfig(**base, stage=0)).terms
    last = estimate_memory(LLAMA31_8B, ParallelConfig(**base, stage=3)).terms
    name = "activations: transformer layers"
    assert last[name] == pytest.approx(first[name] / 4, rel=1e-12)
    assert first["activations: LM head"] == 0 and last["activations: embedding"] == 0
    assert last["activations: LM head"] > 0 and first["activations: embedding"] > 0


# --- exact bytes of one layer (for the compiler cross-check) -------------------------------
TINY = ModelSpec("tiny", hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=256)


def test_layer_activations_exact_bytes_per_tensor():
    seq, batch, beta = 128, 2, 4
    result = layer_activations(TINY, seq, batch, beta, "none")
    tokens = seq * batch
    head_dim = TINY.hidden // TINY.heads
    expected = {"layer_input": beta * tokens * 64, "attention_output": beta * tokens * 64,
                "softmax_lse": 4 * batch * TINY.heads * seq, "attention_norm_output": beta * tokens * 64,
                "query": beta * tokens * 64, "key": beta * tokens * 2 * head_dim,
                "value": beta * tokens * 2 * head_dim, "ffn_norm_input": beta * tokens * 64,
                "ffn_input": beta * tokens * 64, "gate": beta * tokens * 176, "up": beta * tokens * 176,
                "down_input": beta * tokens * 176,   # no silu_gate: the min-cut recomputes it
                "attention_norm_rstd": 4 * tokens, "ffn_norm_rstd": 4 * tokens}
    assert {x.name: x.bytes for x in result.tensors} == expected
    assert all(isinstance(x.bytes, int) for x in result.tensors)
    saved = result.by_category()
    assert saved["input"] == expected["layer_input"]
    assert saved["attention"] == expected["attention_output"] + expected["softmax_lse"]
    assert sum(saved.values()) == sum(expected.values())


def test_layer_activations_paper_tensors_sum_to_eq12():
    """The tensors eq. 12 counts sum to sbh(12 + 4k/a + 8 h_ffn/h) bytes (bf16), once SiLU(gate)
    (which eq. 12 counts and the compiler recomputes) is added back."""
    model, seq, batch = LLAMA31_8B, 8192, 2
    result = layer_activations(model, seq, batch, 2, "none")
    paper = {x.name for x in mem.LAYER_TENSORS if x.paper}
    assert "silu_gate" in paper and "silu_gate" not in {x.name for x in result.tensors}
    total = sum(x.bytes for x in result.tensors if x.name in paper) + 2 * seq * batch * model.ffn
    h = model.hidden
    assert total == seq * batch * h * (12 + 4 * model.kv_heads / model.heads) + 8 * seq * batch * model.ffn


@pytest.mark.parametrize("alpha", [0.0, 0.125, 0.5, 1.0])
def test_layer_activations_memo_slices_tokens(alpha):
    seq, batch, beta = 128, 2, 4
    none = {x.name: x for x in layer_activations(TINY, seq, batch, beta, "none").tensors}
    memo = layer_activations(TINY, seq, batch, beta, "memo", alpha=alpha)
    kept_tokens = int(alpha * seq)
    for x in memo.tensors:
        assert x.saved + x.recomputed == x.bytes == none[x.name].bytes
        assert x.offloaded == x.saved
        if x.category == "other":
            assert x.saved == x.bytes // seq * kept_tokens
        else:
            assert x.recomputed == 0
    assert memo.by_category("recomputed")["other"] == none_others(none) * (seq - kept_tokens) // seq


def none_others(tensors):
    return sum(x.bytes for x in tensors.values() if x.category == "other")


def test_layer_activations_sc_plus_plus():
    result = layer_activations(TINY, 128, 1, 4, "sc++")
    saved, recomputed = result.by_category(), result.by_category("recomputed")
    assert saved["other"] == 0 and recomputed["input"] == recomputed["attention"] == 0
    assert saved["attention"] == 4 * 128 * 64 + 4 * 4 * 128
    assert result.by_category("offloaded") == dict.fromkeys(CATEGORIES, 0)


@pytest.mark.parametrize("change,named", [
    (dict(cp=3), "sequence length 8192"), (dict(hp=3), "hp=3"), (dict(tp=3), "tp=3"), (dict(pp=5), "pp=5"),
    (dict(cp=0), "cp=0"), (dict(seq=-1), "seq=-1"), (dict(cp=4, inner_ring=3), "inner_ring=3"),
    (dict(pp=2, stage=2), "stage=2"),
])
def test_bad_configurations_name_the_value(change, named):
    config = dataclasses.replace(ParallelConfig(seq=8192), **change)
    with pytest.raises(LoongConfigError, match=named.replace("*", r"\*")):
        estimate_memory(LLAMA31_8B, config)


@pytest.mark.parametrize("change", [dict(activations="swap"), dict(alpha=1.5), dict(zero=4),
                                    dict(fragmentation=-0.1), dict(usable_fraction=0)])
def test_bad_options_name_the_value(change):
    key = next(iter(change))
    with pytest.raises(LoongConfigError, match=key):
        MemoryOptions(**change)
