"""The memory equations: every contribution to per-GPU memory as a named sympy term.

The 4D-parallelism memory estimator (``shared/papers/4d-parallelism-memory-estimator.txt``,
eqs. 1-18) is reproduced term by term; its total is eq. 18.  Extension terms, each behind
a switch and all reducing to the paper when switched off, cover what LoongTrain and MEMO
add: head parallelism ``d_hp`` beside ``d_cp``, ZeRO stages 0-3 over ``d * d_cp * d_hp`` (ZeRO-3
also with its shards on the host, as FSDP2's CPU offload keeps them),
activation policies (``full``, ``sc++``, ``memo`` with ``alpha``) and the Double-Ring's KV
buffers.  The model enters through the paper's symbols plus what other families add: an
explicit head dimension, the per-layer parameter counts (eqs. 1-2 for the paper's Llama
layer, the family's exact count otherwise), tied embeddings, MoE routing.
Evaluating the terms for one configuration is ``estimate/memory.py``.
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from loong_compile.estimate import lm_head
from loong_compile.parallel.rules import ESTIMATED_POLICIES

POLICIES = ESTIMATED_POLICIES

# --- symbols: the paper's Table 1, then the extensions ----------------------------------
h, a, k, f, L, v = sp.symbols("h a k h_ffn L v", positive=True, integer=True)
s, b, d, t, p, c = sp.symbols("s b d t p c", positive=True, integer=True)
hp = sp.Symbol("d_hp", positive=True, integer=True)        # head-parallel size (LoongTrain)
stage = sp.Symbol("i", integer=True, nonnegative=True)     # pipeline stage, 0 = first
beta = sp.Symbol("beta", positive=True, integer=True)      # bytes per activation element
alpha = sp.Symbol("alpha", nonnegative=True)               # MEMO's offloaded token fraction
n_ring_buffers = sp.Symbol("n_ring_buffers", nonnegative=True, integer=True)
# The model beyond the paper's Llama: head dimension (h/a there); per-layer parameters split
# by TP (psi_t: projections, experts) and replicated (psi_r: norms); tied embeddings (0/1);
# routed experts (0: dense).  f is the FFN width one token passes through (MoE: the active
# experts' widths).
hd = sp.Symbol("d_head", positive=True, integer=True)
psi_t, psi_r = sp.symbols("psi_t psi_r", positive=True)
tied = sp.Symbol("e_tied", nonnegative=True, integer=True)
n_exp = sp.Symbol("E", nonnegative=True, integer=True)
# Tokens per chunk of the LM head and its loss when the compiler chunks them (the value comes
# from estimate/lm_head.py::chunk_tokens, the rule the compiler applies).
chunk = sp.Symbol("C", positive=True, integer=True)
# Tokens per tile of a tiled MLP (estimate/tiling.py::region_tile, the compiler's rule).
tile = sp.Symbol("T_tile", positive=True, integer=True)
# Head groups 2D-Attention runs one after the other (option head_groups,
# ops/attention/head_groups.py).
groups = sp.Symbol("G_heads", positive=True, integer=True)
SYMBOLS = (h, a, k, f, L, v, s, b, d, t, p, c, hp, stage, beta, alpha, n_ring_buffers, hd, psi_t, psi_r,
           tied, n_exp, chunk, tile, groups)

FIRST_STAGE = sp.KroneckerDelta(stage, 0)
LAST_STAGE = sp.KroneckerDelta(stage, p - 1)   # at stage 0 this is the paper's delta_{p,1}


@dataclasses.dataclass(frozen=True)
class Term:
    """A named contribution to per-GPU memory: ``expr`` in bytes; ``source`` where it comes from."""

    name: str
    group: str       # "model states", "activations", "buffers" or "host"
    expr: sp.Expr
    source: str


# --- parameters (eqs. 1-3) and model states (eqs. 4-10) ---------------------------------
ATTENTION_PARAMS = 2 * h ** 2 * (1 + k / a)          # eq. 1: W_Q, W_K, W_V, W_O
FFN_PARAMS = 3 * h * f                               # eq. 2: up, gate, down
NORM_PARAMS = 2 * h                                  # two RMSNorm weights per layer
# The Llama layer of the paper, for the per-layer parameter symbols (any other family gives
# its exact counts: ModelSpec.layer_matmul_params, ModelSpec.norm_params).
PAPER_LAYER = {psi_t: ATTENTION_PARAMS + FFN_PARAMS, psi_r: NORM_PARAMS, tied: 0, hd: h / a, n_exp: 0}
TOTAL_PARAMS = (2 - tied) * h * v + h + L * (psi_t + psi_r)   # eq. 3

# Parameters held by one GPU of pipeline stage `stage`: eqs. 6-9 in one expression.  The
# first stage holds the embedding, the last the LM head and final norm; with p = 1 the only
# stage holds both (the form of eq. 6, which the paper's PP=1 table rows use).
# A tied LM head is the embedding, held once when one stage holds both.
BLOCK_PARAMS = psi_t / t + psi_r                      # one transformer layer, one TP rank
# outside the layers: the embedding (first stage), the LM head and final norm (last stage)
OUTER_PARAMS = FIRST_STAGE * h * v / t + LAST_STAGE * ((1 - tied * FIRST_STAGE) * h * v / t + h)
STAGE_PARAMS = OUTER_PARAMS + (L / p) * BLOCK_PARAMS

# Bytes per parameter (section 3.1): bf16 weight, fp32 gradient (accumulated in fp32),
# fp32 master weight + Adam momentum + variance.  6 + 12 = 18 (eq. 4).
WEIGHT_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# ZeRO shards over the DP and CP ranks (eq. 10) and, with LoongTrain's hybrid ZeRO, HP too.
ZERO_GROUP = d * c * hp


# ZeRO-3 with the states on the host (FSDP2's CPUOffloadPolicy on every unit, as
# examples/training.py --fsdp --offload-states shards them): ZeRO-3's shards stay in host memory
# and the optimizer steps there.  The device holds the units FSDP2 gathers: the root unit
# (embedding and final norm; FSDP2 keeps the root unsharded from its forward through its
# backward), the LM-head unit while it runs, and two blocks (the one running and the one
# prefetched), in the parameters' dtype, and as much again for their unsharded gradients until
# the reduce-scatter sends each shard to the host.  All of them at once is an upper bound: the
# head runs beside one block, and the embedding's gradient appears only at the backward's end.
GATHERED_PARAMS = OUTER_PARAMS + 2 * BLOCK_PARAMS
_GATHERED = ("FSDP2 states on host: root unit (embedding, final norm), LM-head unit, "
             "running + prefetched block, unsharded")
GATHERED_ON_DEVICE = (
    Term("parameters (gathered on device)", "model states", WEIGHT_BYTES * GATHERED_PARAMS, _GATHERED),
    Term("gradients (unsharded on device)", "model states", WEIGHT_BYTES * GATHERED_PARAMS,
         _GATHERED + ", until the reduce-scatter"),
)


def model_state_terms(zero: int, states_on_host: bool = False) -> list[Term]:
    """Weights, gradients, optimizer states; ZeRO stage ``zero`` shards the first ``zero`` of
    (optimizer states, gradients, weights) over ``d * d_cp * d_hp`` ranks (ZeRO-1 = eq. 10).
    ``states_on_host`` (ZeRO-3 only): those shards are host terms, and the device holds
    ``GATHERED_ON_DEVICE``."""
    def shard(level: int) -> sp.Expr:
        return ZERO_GROUP if zero >= level else sp.Integer(1)

    source = "4D eqs. 4-10" + (f"; ZeRO-{zero} over d*c*d_hp (LoongTrain 5.1)" if zero != 1 else "")
    states = [Term("parameters", "model states", WEIGHT_BYTES * STAGE_PARAMS / shard(3), source),
              Term("gradients", "model states", GRADIENT_BYTES * STAGE_PARAMS / shard(2), source),
              Term("optimizer states", "model states", OPTIMIZER_BYTES * STAGE_PARAMS / shard(1), source)]
    if not states_on_host:
        return states
    return list(GATHERED_ON_DEVICE) + [
        Term(f"host: {x.name}", "host", x.expr, f"{x.source}; on the host (FSDP2 CPUOffloadPolicy)")
        for x in states]


# --- activations of one transformer layer (eqs. 11-12, LoongTrain 4.5.5 / 5.2, MEMO 4.1) ---
# Tokens one GPU holds outside attention: the sequence split over d_cp * d_hp (and over t by
# sequence parallelism).  Inside attention, after the SeqAlltoAll, a GPU holds s/d_cp tokens of
# a/(t*d_hp) heads: the same bytes per tensor, except K and V, whose heads are replicated to
# d_hp when d_hp exceeds the KV heads (LoongTrain 4.2).
LOCAL_TOKENS = b * s / (c * hp)
KV_WIDTH = hd * sp.Max(k, t * hp) / t               # K (or V) bytes per local token / beta


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """One activation a transformer layer saves for its backward.

    per_token: bytes per local token (times LOCAL_TOKENS gives bytes per GPU).
    category: MEMO's classes: the layer ``input``, the ``attention`` output (+ lse), ``other``.
    paper: counted by the 4D paper's eq. 12 (the rest are counted only with ``exact=True``,
    except the lse, which ``sc++`` and ``memo`` always keep as LoongTrain 5.2 does).
    """

    name: str
    category: str
    per_token: sp.Expr
    paper: bool
    what: str


LAYER_TENSORS = (
    LayerTensor("layer_input", "input", beta * h / t, True,
                "x, input of the layer and of the attention RMSNorm [b, s, h]"),
    LayerTensor("attention_output", "attention", beta * a * hd / t, True,
                "SDPA output = o_proj input [b, s, a*d_head] (one storage)"),
    LayerTensor("softmax_lse", "attention", 4 * a / t, False,
                "SDPA log-sum-exp, fp32 [b, a, s]"),
    # with d_hp > 1 the output comes back from the SeqAlltoAll into a second storage, which the
    # o_proj reads (with d_hp = 1 it is the attention op's own output, token-major: one storage)
    LayerTensor("attention_output_gathered", "other", (1 - sp.KroneckerDelta(hp, 1)) * beta * a * hd / t,
                False, "SeqAlltoAll output = o_proj input when d_hp > 1 [b, s, a*d_head]"),
    LayerTensor("attention_norm_output", "other", beta * h / t, True,
                "RMSNorm output = q/k/v projection input [b, s, h]"),
    LayerTensor("query", "other", beta * a * hd / t, True, "q after RoPE [b, a, s, d_head]"),
    LayerTensor("key", "other", beta * KV_WIDTH, True,
                "k after RoPE [b, max(k, d_hp), s, d_head]"),
    LayerTensor("value", "other", beta * KV_WIDTH, True, "v [b, max(k, d_hp), s, d_head]"),
    LayerTensor("ffn_norm_input", "other", beta * h / t, True,
                "x + attention (residual), input of the FFN RMSNorm [b, s, h]"),
    LayerTensor("ffn_input", "other", beta * h / t, True,
                "FFN RMSNorm output = gate/up projection input [b, s, h]"),
    LayerTensor("gate", "other", beta * f / t, True, "gate projection output [b, s, h_ffn]"),
    LayerTensor("up", "other", beta * f / t, True, "up projection output [b, s, h_ffn]"),
    LayerTensor("silu_gate", "other", beta * f / t, True, "SiLU(gate) [b, s, h_ffn]"),
    LayerTensor("down_input", "other", beta * f / t, True,
                "SiLU(gate) * up = down projection input [b, s, h_ffn]"),
    LayerTensor("router_logits", "other", beta * n_exp / t, False,
                "MoE router logits [b, s, experts] (none in a dense layer)"),
    LayerTensor("attention_norm_rstd", "other", sp.Integer(4) / t, False,
                "attention RMSNorm 1/rms, fp32 [b, s, 1]"),
    LayerTensor("ffn_norm_rstd", "other", sp.Integer(4) / t, False,
                "FFN RMSNorm 1/rms, fp32 [b, s, 1]"),
)
SC_PP_SAVED = ("layer_input", "attention_output", "softmax_lse")   # LoongTrain 5.2


# PyTorch's min-cut partition (what the backend runs) recomputes these in the backward from
# values it saves anyway, instead of storing them: SiLU(gate) is one pointwise op on the saved
# gate.  The exact count follows the compiler; eq. 12 (paper terms) still counts them.
PARTITIONER_RECOMPUTES = ("silu_gate",)


# Token tiling (passes/tiling/regions.py) runs the MLP, from the norm before it, a tile of tokens
# at a time and keeps only the region's input (``ffn_norm_input``): these are never saved then.
# tests/estimate/test_estimate_crosscheck.py compares the rest with the compiled graph.
TILED_AWAY = ("ffn_input", "gate", "up", "silu_gate", "down_input", "ffn_norm_rstd")
# What one tile of the region holds while it runs (its backward: the recomputed intermediates
# and their gradients): the norm's output and the four FFN-wide values, twice, per token.
TILE_WORKING_BYTES = 2 * tile * beta * (h + 4 * f) / t


def counted_tensors(policy: str, exact: bool, tiled: bool = False) -> tuple[LayerTensor, ...]:
    """The layer tensors a policy accounts for: eq. 12's, plus the lse under sc++ / memo (their
    sources count it), plus, when ``exact``, every other tensor the compiled graph saves; with
    ``tiled``, not those the tiled MLP no longer saves."""
    keep_lse = exact or policy in ("sc++", "memo")
    return tuple(x for x in LAYER_TENSORS
                 if (x.paper or exact or (keep_lse and x.name == "softmax_lse"))
                 and not (exact and x.name in PARTITIONER_RECOMPUTES)
                 and not (tiled and x.name in TILED_AWAY))


def stored_tensors(policy: str, exact: bool, tiled: bool = False) -> tuple[LayerTensor, ...]:
    """Of ``counted_tensors``, those a layer keeps (on GPU or host) until its backward."""
    counted = counted_tensors(policy, exact, tiled)
    if policy == "none":
        return counted
    if policy in ("full", "full_offload"):
        return tuple(x for x in counted if x.name == "layer_input")
    if policy == "sc++":
        return tuple(x for x in counted if x.name in SC_PP_SAVED)
    return tuple(x for x in counted if x.category != "other")   # memo: "other" handled by alpha


def _bytes(tensors) -> sp.Expr:
    return LOCAL_TOKENS * sum((x.per_token for x in tensors), sp.Integer(0))


# Layers whose activations one GPU of stage i holds under 1F1B: its L/p layers for p - i
# micro-batches (section 3.2.2; the first stage: L, independent of p).
HELD_LAYERS = (L / p) * (p - stage)


def activation_terms(policy: str, exact: bool, working_set: bool, memo_alpha_zero: bool,
                     lm_head_chunked: bool = False, tiled: bool = False,
                     resident_layers: int = 2) -> list[Term]:
    """Transformer-layer activations under ``policy`` plus the embedding / LM-head terms (the
    LM head as eq. 14 counts it, or as the compiler's token-chunked op keeps it); with
    ``tiled``, the MLP run a tile at a time (its intermediates never saved, one tile's working
    set instead).  ``resident_layers``: the layers memo and full_offload keep on the device
    (MEMO: 2; none where each block is compiled on its own, as every block runs one graph)."""
    counted = counted_tensors(policy, exact, tiled)
    stored = stored_tensors(policy, exact, tiled)
    recomputed = [x for x in counted if x not in stored]
    terms = []
    if policy == "none":
        terms.append(Term("activations: transformer layers", "activations",
                          HELD_LAYERS * _bytes(counted), "4D eqs. 11-12, 15-17 (+ d_hp)"))
    elif policy in ("full", "sc++"):
        name = "layer inputs" if policy == "full" else "layer inputs + attention outputs + lse"
        terms.append(Term(f"activations: {name}", "activations", HELD_LAYERS * _bytes(stored),
                          "LoongTrain 5.2: 2SD/d_sp" + (" + (2SD + 4SH)/d_sp" if policy == "sc++" else "")))
    elif policy == "full_offload":
        # MEMO's offload and prefetch of the layer inputs alone: two rounding buffers (the layer
        # in use, the one arriving); the layer itself is recomputed whole (the working set below)
        terms.append(Term("activations: MEMO rounding buffers", "activations", 2 * _bytes(stored),
                          "MEMO 4.1 (two rounding buffers), layer inputs only"))
        terms.append(Term("host: offloaded activations", "host",
                          sp.Max(HELD_LAYERS - resident_layers, 0) * _bytes(stored),
                          "MEMO 4.1 eq. 3, alpha = 0"))
    else:
        # MEMO 4.1: every layer's skeletal tensors pass through two rounding buffers (even / odd
        # layers); with alpha = 0 the "other" tensors need no double buffering and share one buffer.
        buffers = 2 * _bytes(stored) + (1 if memo_alpha_zero else 2) * _bytes(recomputed)
        terms.append(Term("activations: MEMO rounding buffers", "activations", buffers,
                          "MEMO 4.1 (two rounding buffers)"))
        host = sp.Max(HELD_LAYERS - resident_layers, 0) * (_bytes(stored) + alpha * _bytes(recomputed))
        terms.append(Term("host: offloaded activations", "host", host, "MEMO 4.1 eq. 3"))
    if working_set and recomputed and policy != "memo":     # memo recomputes into its rounding buffer
        terms.append(Term("activations: recompute working set (one layer)", "activations",
                          _bytes(recomputed), "one layer's recomputed tensors live during its backward"))
    if tiled:
        terms.append(Term("activations: tiled MLP (one tile)", "activations", TILE_WORKING_BYTES,
                          "token tiling: one tile's intermediates and their gradients "
                          "(estimate/tiling.py)"))
    tokens = LOCAL_TOKENS / t
    terms.append(OUTSIDE_LAYERS if exact else
                 Term("activations: embedding", "activations", FIRST_STAGE * 8 * tokens * h * p,
                      "4D eq. 13 (as printed: 8sbhp)"))
    terms.append(LM_HEAD_CHUNKED if lm_head_chunked else
                 Term("activations: LM head", "activations", LAST_STAGE * 4 * tokens * h * (1 + v / h),
                      "4D eq. 14 (delta_{p,1} in eq. 16)"))
    return terms


# What the compiled step keeps outside its transformer layers, per local token, besides the LM
# head (eq. 13's 8sbhp is not it: the embedding's backward needs only the token ids).  The first
# stage, for each micro-batch in flight: the token ids (int64, for the embedding's backward), the
# document ids the attention pass builds (int64) and RoPE's angles (transformers computes them
# in float32 whatever the model's dtype; cos and sin are recomputed from them).  The last stage:
# the labels (int64), the final norm's input and its 1/rms (float32).
# tests/estimate/test_estimate_crosscheck.py compares this with the compiled graph.
OUTSIDE_LAYERS = Term(
    "activations: outside the layers", "activations",
    LOCAL_TOKENS / t * (FIRST_STAGE * p * (8 + 8 + 4 * hd) + LAST_STAGE * (8 + beta * h + 4)),
    "compiled graph: token and document ids, RoPE angles (fp32), labels, final norm input + 1/rms")


# The LM head and its loss as the compiler runs them when the loss is in the graph
# (passes/tiling/lm_head.py): the gradients of the hidden states and of the head's weight are kept
# from the forward to the backward, and one chunk of C tokens' logits exists at a time.
_HEAD_TOKENS = LOCAL_TOKENS / t
LM_HEAD_CHUNKED = Term(
    "activations: LM head", "activations",
    LAST_STAGE * (lm_head.kept_bytes(_HEAD_TOKENS, h, v / t, beta)
                  + lm_head.working_bytes(chunk, v / t, beta)),
    "chunked, loss in the graph: dL/dhidden + dL/dW kept, one chunk of C tokens "
    "(estimate/lm_head.py)")


# What 2D-Attention moves, from the same tensors (after the SeqAlltoAll a GPU holds its K and
# V chunks in head layout; the bytes are those of the layer's key and value tensors).
# Size(kv) = max(Hkv, d_hp)/H * 4SD/d_sp for bf16 (LoongTrain 4.5.3).
_TENSOR = {x.name: x for x in LAYER_TENSORS}
KV_CHUNK_BYTES = _bytes([_TENSOR["key"], _TENSOR["value"]])
# Size(q) + Size(k) + Size(v) + Size(out): what each GPU's SeqAlltoAll redistributes (4.5.4).
ALLTOALL_HELD_BYTES = _bytes([_TENSOR[x] for x in ("query", "key", "value", "attention_output")])

# Head groups split a rank's K/V heads among them, or share one between several groups: the K/V
# a group holds is 1/min(G, K/V heads a rank holds) of the rank's (ops/attention/head_groups.py).
KV_GROUPS = sp.Min(groups, sp.Max(k, t * hp) / (t * hp))

# Double-Ring KV buffers (LoongTrain 4.5.5): one of Size(kv) for the inner ring, one more
# for the outer ring; one head group's (the groups run one after the other).
RING_BUFFER_TERM = Term("Double-Ring KV buffers", "buffers", n_ring_buffers * KV_CHUNK_BYTES / KV_GROUPS,
                        "LoongTrain 4.5.5; one head group's")

# 2D-Attention's backward, while one block's kernel runs (ops/attention/ring.py::ring_backward),
# for one head group: the group's output gradient after the all-to-all and the kernel's dQ, dK
# and dV; with d_cp > 1 also the dQ and dK/dV accumulators, in float32 (float64 for float64).
# The received K/V block is the ring buffer above.  (A kernel expanding K/V for GQA, PyTorch's
# CUDA flash kernel without flash-attn, holds the group's K/V and dK/dV at its query heads.)
_RING = sp.Min(c - 1, 1)                              # 1 with a ring (d_cp > 1), else 0
_ACCUMULATOR = sp.Max(beta, 4)
ATTENTION_BACKWARD_TERM = Term(
    "2D-Attention backward (one head group)", "buffers",
    LOCAL_TOKENS * (a * hd / t / groups * (2 * beta + _RING * _ACCUMULATOR)
                    + 2 * KV_WIDTH / KV_GROUPS * (beta + _RING * _ACCUMULATOR)),
    "ops/attention/ring.py: dout, dQ, dK/dV (+ fp32 accumulators with d_cp > 1), one head group")


def all_terms(zero: int, policy: str, exact: bool, working_set: bool, alpha_zero: bool,
              ring_buffers: bool, lm_head_chunked: bool = False, tiled: bool = False,
              states_on_host: bool = False) -> list[Term]:
    """Every term for these switches (see ``MemoryOptions``), symbolic in ``SYMBOLS``."""
    terms = model_state_terms(zero, states_on_host)
    # ZeRO-3 shards each block as a unit of its own, compiled on its own (examples/training.py
    # --fsdp): every block runs the one graph, so memo and full_offload swap every layer
    terms += activation_terms(policy, exact, working_set, memo_alpha_zero=alpha_zero,
                              lm_head_chunked=lm_head_chunked, tiled=tiled,
                              resident_layers=0 if zero == 3 else 2)
    if ring_buffers:
        terms += [RING_BUFFER_TERM, ATTENTION_BACKWARD_TERM]
    return terms
