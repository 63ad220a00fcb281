"""Per-GPU memory of DP x TP x PP x CP (x HP) training of a Llama model, as named sympy terms.

The 4D-parallelism memory estimator (``shared/papers/4d-parallelism-memory-estimator.txt``,
eqs. 1-18) is reproduced term by term; its total is eq. 18.  Extension terms, each behind
a switch of ``MemoryOptions`` and all reducing to the paper when switched off, cover what
LoongTrain and MEMO add: head parallelism ``d_hp`` beside ``d_cp``, ZeRO stages 0-3 over
``d * d_cp * d_hp``, activation policies (``full``, ``sc++``, ``memo`` with ``alpha``), the
Double-Ring's KV buffers, and overheads (CUDA context, communicator buffers, fragmentation),
which are reported apart from the terms.

Every term is a sympy expression in bytes per GPU; ``estimate_memory`` evaluates them
numerically (compiled once per set of switches with ``lambdify``) and reports GiB.
``layer_activations`` gives one layer's saved activations in exact bytes per category, for
comparison with what the compiled graph saves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import sympy as sp

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.models import ModelSpec

GIB = 2 ** 30
POLICIES = ("none", "full", "sc++", "memo")
CATEGORIES = ("input", "attention", "others")

# --- symbols: the paper's Table 1, then the extensions ----------------------------------
h, a, k, f, L, v = sp.symbols("h a k h_ffn L v", positive=True, integer=True)
s, b, d, t, p, c = sp.symbols("s b d t p c", positive=True, integer=True)
hp = sp.Symbol("d_hp", positive=True, integer=True)        # head-parallel size (LoongTrain)
stage = sp.Symbol("i", integer=True, nonnegative=True)     # pipeline stage, 0 = first
beta = sp.Symbol("beta", positive=True, integer=True)      # bytes per activation element
alpha = sp.Symbol("alpha", nonnegative=True)               # MEMO's offloaded token fraction
n_ring_buffers = sp.Symbol("n_ring_buffers", nonnegative=True, integer=True)
SYMBOLS = (h, a, k, f, L, v, s, b, d, t, p, c, hp, stage, beta, alpha, n_ring_buffers)

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
TOTAL_PARAMS = 2 * h * v + h + L * (ATTENTION_PARAMS + FFN_PARAMS + NORM_PARAMS)   # eq. 3

# Parameters held by one GPU of pipeline stage `stage`: eqs. 6-9 in one expression.  The
# first stage holds the embedding, the last the LM head and final norm; with p = 1 the only
# stage holds both (the form of eq. 6, which the paper's PP=1 table rows use).
STAGE_PARAMS = (FIRST_STAGE * h * v / t + LAST_STAGE * (h * v / t + h)
                + (L / p) * ((ATTENTION_PARAMS + FFN_PARAMS) / t + NORM_PARAMS))

# Bytes per parameter (section 3.1): bf16 weight, fp32 gradient (accumulated in fp32),
# fp32 master weight + Adam momentum + variance.  6 + 12 = 18 (eq. 4).
WEIGHT_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# ZeRO shards over the DP and CP ranks (eq. 10) and, with LoongTrain's hybrid ZeRO, HP too.
ZERO_GROUP = d * c * hp


def model_state_terms(zero: int) -> list[Term]:
    """Weights, gradients, optimizer states; ZeRO stage ``zero`` shards the first ``zero`` of
    (optimizer states, gradients, weights) over ``d * d_cp * d_hp`` ranks (ZeRO-1 = eq. 10)."""
    def shard(level: int) -> sp.Expr:
        return ZERO_GROUP if zero >= level else sp.Integer(1)

    source = "4D eqs. 4-10" + (f"; ZeRO-{zero} over d*c*d_hp (LoongTrain 5.1)" if zero != 1 else "")
    return [Term("parameters", "model states", WEIGHT_BYTES * STAGE_PARAMS / shard(3), source),
            Term("gradients", "model states", GRADIENT_BYTES * STAGE_PARAMS / shard(2), source),
            Term("optimizer states", "model states", OPTIMIZER_BYTES * STAGE_PARAMS / shard(1), source)]


# --- activations of one transformer layer (eqs. 11-12, LoongTrain 4.5.5 / 5.2, MEMO 4.1) ---
# Tokens one GPU holds outside attention: the sequence split over d_cp * d_hp (and over t by
# sequence parallelism).  Inside attention, after the SeqAlltoAll, a GPU holds s/d_cp tokens of
# a/(t*d_hp) heads: the same bytes per tensor, except K and V, whose heads are replicated to
# d_hp when d_hp exceeds the KV heads (LoongTrain 4.2).
LOCAL_TOKENS = b * s / (c * hp)
KV_WIDTH = (h / a) * sp.Max(k, t * hp) / t           # K (or V) bytes per local token / beta


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """One activation a transformer layer saves for its backward.

    per_token: bytes per local token (times LOCAL_TOKENS gives bytes per GPU).
    category: MEMO's classes: the layer ``input``, the ``attention`` output (+ lse), ``others``.
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
    LayerTensor("attention_output", "attention", beta * h / t, True,
                "SDPA output = o_proj input [b, s, h] (one storage)"),
    LayerTensor("softmax_lse", "attention", 4 * a / t, False,
                "SDPA log-sum-exp, fp32 [b, a, s]"),
    LayerTensor("attention_norm_output", "others", beta * h / t, True,
                "RMSNorm output = q/k/v projection input [b, s, h]"),
    LayerTensor("query", "others", beta * h / t, True, "q after RoPE [b, a, s, h/a]"),
    LayerTensor("key", "others", beta * KV_WIDTH, True,
                "k after RoPE [b, max(k, d_hp), s, h/a]"),
    LayerTensor("value", "others", beta * KV_WIDTH, True, "v [b, max(k, d_hp), s, h/a]"),
    LayerTensor("ffn_norm_input", "others", beta * h / t, True,
                "x + attention (residual), input of the FFN RMSNorm [b, s, h]"),
    LayerTensor("ffn_input", "others", beta * h / t, True,
                "FFN RMSNorm output = gate/up projection input [b, s, h]"),
    LayerTensor("gate", "others", beta * f / t, True, "gate projection output [b, s, h_ffn]"),
    LayerTensor("up", "others", beta * f / t, True, "up projection output [b, s, h_ffn]"),
    LayerTensor("silu_gate", "others", beta * f / t, True, "SiLU(gate) [b, s, h_ffn]"),
    LayerTensor("down_input", "others", beta * f / t, True,
                "SiLU(gate) * up = down projection input [b, s, h_ffn]"),
    LayerTensor("attention_norm_rstd", "others", sp.Integer(4) / t, False,
                "attention RMSNorm 1/rms, fp32 [b, s, 1]"),
    LayerTensor("ffn_norm_rstd", "others", sp.Integer(4) / t, False,
                "FFN RMSNorm 1/rms, fp32 [b, s, 1]"),
)
SC_PP_SAVED = ("layer_input", "attention_output", "softmax_lse")   # LoongTrain 5.2


# PyTorch's min-cut partition (what the backend runs) recomputes these in the backward from
# values it saves anyway, instead of storing them: SiLU(gate) is one pointwise op on the saved
# gate.  The exact count follows the compiler; eq. 12 (paper terms) still counts them.
PARTITIONER_RECOMPUTES = ("silu_gate",)


def counted_tensors(policy: str, exact: bool) -> tuple[LayerTensor, ...]:
    """The layer tensors a policy accounts for: eq. 12's, plus the lse under sc++ / memo (their
    sources count it), plus, when ``exact``, every other tensor the compiled graph saves."""
    keep_lse = exact or policy in ("sc++", "memo")
    return tuple(x for x in LAYER_TENSORS
                 if (x.paper or exact or (keep_lse and x.name == "softmax_lse"))
                 and not (exact and x.name in PARTITIONER_RECOMPUTES))


def stored_tensors(policy: str, exact: bool) -> tuple[LayerTensor, ...]:
    """Of ``counted_tensors``, those a layer keeps (on GPU or host) until its backward."""
    counted = counted_tensors(policy, exact)
    if policy == "none":
        return counted
    if policy == "full":
        return tuple(x for x in counted if x.name == "layer_input")
    if policy == "sc++":
        return tuple(x for x in counted if x.name in SC_PP_SAVED)
    return tuple(x for x in counted if x.category != "others")   # memo: "others" handled by alpha


def _bytes(tensors) -> sp.Expr:
    return LOCAL_TOKENS * sum((x.per_token for x in tensors), sp.Integer(0))


# Layers whose activations one GPU of stage i holds under 1F1B: its L/p layers for p - i
# micro-batches (section 3.2.2; the first stage: L, independent of p).
HELD_LAYERS = (L / p) * (p - stage)


def activation_terms(policy: str, exact: bool, working_set: bool, memo_alpha_zero: bool) -> list[Term]:
    """Transformer-layer activations under ``policy`` plus the embedding / LM-head terms."""
    counted = counted_tensors(policy, exact)
    stored = stored_tensors(policy, exact)
    recomputed = [x for x in counted if x not in stored]
    terms = []
    if policy == "none":
        terms.append(Term("activations: transformer layers", "activations",
                          HELD_LAYERS * _bytes(counted), "4D eqs. 11-12, 15-17 (+ d_hp)"))
    elif policy in ("full", "sc++"):
        name = "layer inputs" if policy == "full" else "layer inputs + attention outputs + lse"
        terms.append(Term(f"activations: {name}", "activations", HELD_LAYERS * _bytes(stored),
                          "LoongTrain 5.2: 2SD/d_sp" + (" + (2SD + 4SH)/d_sp" if policy == "sc++" else "")))
    else:
        # MEMO 4.1: every layer's skeletal tensors pass through two rounding buffers (even / odd
        # layers); with alpha = 0 the "others" need no double buffering and share one buffer.
        buffers = 2 * _bytes(stored) + (1 if memo_alpha_zero else 2) * _bytes(recomputed)
        terms.append(Term("activations: MEMO rounding buffers", "activations", buffers,
                          "MEMO 4.1 (two rounding buffers)"))
        host = sp.Max(HELD_LAYERS - 2, 0) * (_bytes(stored) + alpha * _bytes(recomputed))
        terms.append(Term("host: offloaded activations", "host", host, "MEMO 4.1 eq. 3"))
    if working_set and recomputed and policy != "memo":     # memo recomputes into its rounding buffer
        terms.append(Term("activations: recompute working set (one layer)", "activations",
                          _bytes(recomputed), "one layer's recomputed tensors live during its backward"))
    tokens = LOCAL_TOKENS / t
    terms.append(Term("activations: embedding", "activations", FIRST_STAGE * 8 * tokens * h * p,
                      "4D eq. 13 (as printed: 8sbhp)"))
    terms.append(Term("activations: LM head", "activations", LAST_STAGE * 4 * tokens * h * (1 + v / h),
                      "4D eq. 14 (delta_{p,1} in eq. 16)"))
    return terms


# What 2D-Attention moves, from the same tensors (after the SeqAlltoAll a GPU holds its K and
# V chunks in head layout; the bytes are those of the layer's key and value tensors).
# Size(kv) = max(Hkv, d_hp)/H * 4SD/d_sp for bf16 (LoongTrain 4.5.3).
_TENSOR = {x.name: x for x in LAYER_TENSORS}
KV_CHUNK_BYTES = _bytes([_TENSOR["key"], _TENSOR["value"]])
# Size(q) + Size(k) + Size(v) + Size(out): what each GPU's SeqAlltoAll redistributes (4.5.4).
ALLTOALL_HELD_BYTES = _bytes([_TENSOR[x] for x in ("query", "key", "value", "attention_output")])

# Double-Ring KV buffers (LoongTrain 4.5.5): one of Size(kv) for the inner ring, one more
# for the outer ring.
RING_BUFFER_TERM = Term("Double-Ring KV buffers", "buffers", n_ring_buffers * KV_CHUNK_BYTES,
                        "LoongTrain 4.5.5")


# --- configuration, options and results -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """One training configuration.  ``dp`` x ``tp`` x ``pp`` x ``cp`` x ``hp`` GPUs; ``stage``
    is the pipeline stage to report (0, the first, is the one the paper reports)."""

    seq: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    hp: int = 1
    micro_batch: int = 1
    inner_ring: int = 1
    stage: int = 0

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.hp

    @property
    def sp(self) -> int:
        return self.cp * self.hp

    def validate(self, model: ModelSpec) -> None:
        """Raise LoongConfigError naming the first value that breaks a divisibility rule."""
        for name in ("seq", "dp", "tp", "pp", "cp", "hp", "micro_batch", "inner_ring"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoongConfigError(f"{name}={value!r}", f"{name} must be a positive integer",
                                       f"pass a positive integer for {name}")
        checks = (
            (model.heads % (self.tp * self.hp) == 0, f"tp*hp={self.tp * self.hp}",
             f"tp*hp must divide the {model.heads} attention heads of {model.name}",
             "choose tp and hp whose product divides the head count"),
            (self.tp <= model.kv_heads and model.kv_heads % self.tp == 0 or self.tp % model.kv_heads == 0,
             f"tp={self.tp}", f"tp must divide {model.kv_heads} KV heads or be a multiple of them",
             "choose another tp"),
            (model.layers % self.pp == 0, f"pp={self.pp}",
             f"pp must divide the {model.layers} layers", "choose a pp that divides the layer count"),
            (self.sp == 1 or self.seq % (2 * self.sp) == 0, f"seq={self.seq}",
             f"the sequence must split into 2*cp*hp = {2 * self.sp} zigzag chunks",
             f"use a sequence length that is a multiple of {2 * self.sp}"),
            (self.seq % self.tp == 0, f"seq={self.seq}",
             f"sequence parallelism splits the sequence over tp={self.tp}", "use a multiple of tp"),
            (self.cp % self.inner_ring == 0, f"inner_ring={self.inner_ring}",
             f"the inner ring size must divide cp={self.cp}", "choose an inner_ring that divides cp"),
            (0 <= self.stage < self.pp, f"stage={self.stage}",
             f"stage must be in [0, pp) = [0, {self.pp})", "pass a stage index below pp"),
        )
        for ok, what, rule, fix in checks:
            if not ok:
                raise LoongConfigError(what, rule, fix)


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Switches for the extension terms.  The defaults are the 4D paper (eq. 18) exactly.

    activations: ``none`` (everything saved, eq. 12), ``full`` (layer inputs only), ``sc++``
        (LoongTrain's Selective Checkpoint++), ``memo`` (MEMO's swapping with ``alpha``).
    zero: ZeRO stage 0-3 over d*cp*hp (the paper: 1).
    exact: also count the tensors eq. 12 leaves out (lse, RMSNorm statistics).
    double_ring_buffers: count the Double-Ring's KV buffers.
    recompute_working_set: count one layer's recomputed tensors (policies that recompute).
    cuda_context_gib, comm_buffers_gib, fragmentation: overheads, reported apart; fragmentation
        is a fraction of the terms' total.
    usable_fraction: the 80% rule (the paper: estimates <= 80% of capacity never ran out).
    """

    activations: str = "none"
    alpha: float = 1.0
    zero: int = 1
    exact: bool = False
    double_ring_buffers: bool = False
    recompute_working_set: bool = True
    dtype_bytes: int = 2
    cuda_context_gib: float = 0.0
    comm_buffers_gib: float = 0.0
    fragmentation: float = 0.0
    usable_fraction: float = 0.8

    def __post_init__(self) -> None:
        def bad(name, rule, fix):
            return LoongConfigError(f"{name}={getattr(self, name)!r}", rule, fix)

        if self.activations not in POLICIES:
            raise bad("activations", f"activations must be one of {', '.join(POLICIES)}",
                      "pass e.g. activations='sc++'")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not 0 <= self.alpha <= 1:
            raise bad("alpha", "alpha must be a number in [0, 1]", "pass e.g. alpha=0.5")
        if self.zero not in (0, 1, 2, 3):
            raise bad("zero", "zero must be a ZeRO stage 0, 1, 2 or 3", "pass zero=1")
        if isinstance(self.dtype_bytes, bool) or self.dtype_bytes not in (1, 2, 4, 8):
            raise bad("dtype_bytes", "dtype_bytes must be 1, 2, 4 or 8", "pass 2 for bf16")
        for name in ("cuda_context_gib", "comm_buffers_gib", "fragmentation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise bad(name, f"{name} must be a number >= 0", f"pass {name}=0 or more")
        if isinstance(self.usable_fraction, bool) or not isinstance(self.usable_fraction, (int, float)) \
                or not 0 < self.usable_fraction <= 1:
            raise bad("usable_fraction", "usable_fraction must be in (0, 1]", "pass 0.8 (the paper's rule)")

    @classmethod
    def loongtrain(cls, **changes) -> MemoryOptions:
        """The settings ``loong plan`` uses: every tensor counted, the Double-Ring's buffers,
        and typical overheads (0.5 GiB CUDA context, 0.5 GiB NCCL buffers)."""
        base = dict(exact=True, double_ring_buffers=True, cuda_context_gib=0.5, comm_buffers_gib=0.5)
        return cls(**{**base, **changes})


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """GiB per named term (``terms``: the estimate; ``host``: host memory per GPU, memo only;
    ``overheads``: apart from the estimate).  ``capacity_gib`` is the GPU's memory, if known."""

    terms: dict[str, float]
    sources: dict[str, str]
    host: dict[str, float]
    overheads: dict[str, float]
    capacity_gib: float | None
    usable_fraction: float

    @property
    def estimate_gib(self) -> float:
        return sum(self.terms.values())

    @property
    def total_gib(self) -> float:
        return self.estimate_gib + sum(self.overheads.values())

    @property
    def host_gib(self) -> float:
        return sum(self.host.values())

    @property
    def limit_gib(self) -> float | None:
        return None if self.capacity_gib is None else self.usable_fraction * self.capacity_gib

    @property
    def headroom_gib(self) -> float | None:
        return None if self.limit_gib is None else self.limit_gib - self.estimate_gib

    @property
    def verdict(self) -> str:
        """``fits`` (estimate within the usable fraction and total within capacity), ``near limit``
        (the paper's yellow cells), ``exceeds`` (red), or ``unknown`` without a capacity."""
        if self.capacity_gib is None:
            return "unknown"
        if self.estimate_gib > self.capacity_gib or self.total_gib > self.capacity_gib:
            return "exceeds"
        return "fits" if self.estimate_gib <= self.limit_gib else "near limit"

    def to_dict(self) -> dict:
        return {"terms_gib": self.terms, "sources": self.sources, "host_gib": self.host,
                "overheads_gib": self.overheads, "estimate_gib": self.estimate_gib,
                "total_gib": self.total_gib, "capacity_gib": self.capacity_gib,
                "usable_fraction": self.usable_fraction, "limit_gib": self.limit_gib,
                "headroom_gib": self.headroom_gib, "verdict": self.verdict}


def memory_terms(options: MemoryOptions) -> list[Term]:
    """All terms for these switches (symbolic; see ``SYMBOLS``)."""
    terms = model_state_terms(options.zero)
    terms += activation_terms(options.activations, options.exact, options.recompute_working_set,
                              memo_alpha_zero=options.alpha == 0)
    if options.double_ring_buffers:
        terms.append(RING_BUFFER_TERM)
    return terms


@functools.lru_cache(maxsize=256)
def _lambdified(expr: sp.Expr) -> Callable[..., float]:
    """``expr`` as a plain Python function of ``SYMBOLS`` (terms shared by several switch
    settings, like the model states, are compiled once)."""
    return sp.lambdify(SYMBOLS, expr, modules="math")


@functools.lru_cache(maxsize=64)
def _compiled(zero: int, policy: str, exact: bool, working_set: bool, alpha_zero: bool,
              ring: bool) -> tuple[tuple[Term, Callable[..., float]], ...]:
    options = MemoryOptions(activations=policy, zero=zero, exact=exact, recompute_working_set=working_set,
                            alpha=0.0 if alpha_zero else 1.0, double_ring_buffers=ring)
    return tuple((term, _lambdified(term.expr)) for term in memory_terms(options))


def ring_buffer_count(config: ParallelConfig) -> int:
    """Inner-ring buffer when d_cp > 1, outer-ring buffer when there is more than one inner ring."""
    return int(config.cp > 1) + int(config.cp // config.inner_ring > 1)


def symbol_values(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> tuple:
    """Numbers for ``SYMBOLS``, in order."""
    return (model.hidden, model.heads, model.kv_heads, model.ffn, model.layers, model.vocab,
            config.seq, config.micro_batch, config.dp, config.tp, config.pp, config.cp, config.hp,
            config.stage, options.dtype_bytes, options.alpha, ring_buffer_count(config))


def estimate_memory(model: ModelSpec, config: ParallelConfig, options: MemoryOptions = MemoryOptions(),
                    capacity_gib: float | None = None) -> MemoryBreakdown:
    """Evaluate every term for one configuration (GiB per GPU)."""
    config.validate(model)
    if capacity_gib is not None and (isinstance(capacity_gib, bool) or capacity_gib <= 0):
        raise LoongConfigError(f"capacity_gib={capacity_gib!r}", "GPU capacity must be > 0 GiB",
                               "pass the GPU's memory in GiB, e.g. 80")
    compiled = _compiled(options.zero, options.activations, options.exact, options.recompute_working_set,
                         options.alpha == 0, options.double_ring_buffers)
    values = symbol_values(model, config, options)
    terms, host, sources = {}, {}, {}
    for term, fn in compiled:
        gib = float(fn(*values)) / GIB
        (host if term.group == "host" else terms)[term.name] = gib
        sources[term.name] = term.source
    overheads = {"CUDA context": options.cuda_context_gib,
                 "communicator buffers": options.comm_buffers_gib,
                 "fragmentation": options.fragmentation * sum(terms.values())}
    return MemoryBreakdown(terms, sources, host, overheads, capacity_gib, options.usable_fraction)


@functools.lru_cache(maxsize=4)
def _compiled_categories(exact: bool) -> dict[str, Callable[..., float]]:
    counted = counted_tensors("memo", exact)
    return {cat: _lambdified(_bytes([x for x in counted if x.category == cat])) for cat in CATEGORIES}


def category_bytes(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> dict[str, float]:
    """One layer's skeletal bytes per GPU per MEMO category: S_input, S_attn, S_others (MEMO 4.1)."""
    values = symbol_values(model, config, options)
    return {cat: float(fn(*values)) for cat, fn in _compiled_categories(options.exact).items()}


def attention_transfer_bytes(model: ModelSpec, config: ParallelConfig, dtype_bytes: int) -> tuple[float, float]:
    """(Size(kv), Size(q) + Size(k) + Size(v) + Size(out)) in bytes for one GPU (LoongTrain 4.5.3-4)."""
    values = symbol_values(model, config, MemoryOptions(dtype_bytes=dtype_bytes))
    return float(_lambdified(KV_CHUNK_BYTES)(*values)), float(_lambdified(ALLTOALL_HELD_BYTES)(*values))


_LAYER_MATMUL_PARAMS = sp.lambdify((h, a, k, f), ATTENTION_PARAMS + FFN_PARAMS, modules="math")


def layer_matmul_params(model: ModelSpec) -> float:
    """Weights of one layer's projections (eqs. 1 + 2): 2 FLOPs each per token forward."""
    return float(_LAYER_MATMUL_PARAMS(model.hidden, model.heads, model.kv_heads, model.ffn))


# --- one layer's saved activations in exact bytes (for the compiler cross-check) ---------
@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One layer tensor under a policy: ``bytes`` in full; of it, what the backward reads from
    storage (``saved``), what of that goes to host (``offloaded``), and what is ``recomputed``."""

    name: str
    category: str
    bytes: int
    saved: int
    offloaded: int
    recomputed: int
    what: str


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    policy: str
    alpha: float
    tensors: tuple[SavedTensor, ...]

    def by_category(self, field: str = "saved") -> dict[str, int]:
        """Bytes per MEMO category (``input``, ``attention``, ``others``) of ``field``."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for x in self.tensors:
            totals[x.category] += getattr(x, field)
        return totals


def layer_activations(model: ModelSpec, seq: int, batch: int, dtype_bytes: int, policy: str,
                      alpha: float = 0.0, hp: int = 1, cp: int = 1) -> LayerActivations:
    """Exact bytes one transformer layer saves for its backward, per tensor and category.

    Counts every tensor of ``LAYER_TENSORS`` (eq. 12's plus the lse and RMSNorm statistics),
    for the Llama of this project (RMSNorm, RoPE, SwiGLU, GQA, causal SDPA) on one GPU of a
    ``hp x cp`` grid.  ``none``: all saved.  ``sc++``: layer input, attention output and lse
    saved, the others recomputed.  ``memo``: the layer input and attention output + lse
    offloaded; of each "other" tensor the first floor(alpha * s_local) tokens of every sequence
    offloaded, the rest recomputed (the last two layers, which MEMO does not swap, would keep
    their bytes on device instead).  ``full`` saves the layer input only.
    """
    options = MemoryOptions(activations=policy, alpha=alpha, dtype_bytes=dtype_bytes)   # validates
    config = ParallelConfig(seq=seq, cp=cp, hp=hp, micro_batch=batch)
    config.validate(model)
    values = dict(zip(SYMBOLS, (sp.Integer(x) for x in symbol_values(model, config, options)[:-2])))
    local_seq = seq // (cp * hp)
    alpha_tokens = math.floor(alpha * local_seq)
    stored = stored_tensors(policy, exact=True)
    tensors = []
    for x in counted_tensors(policy, exact=True):
        size = sp.nsimplify(LOCAL_TOKENS * x.per_token).subs(values)
        if not size.is_Integer:
            raise LoongConfigError(f"{x.name} of {model.name} takes {size} bytes per GPU",
                                   "tensor sizes must be whole bytes", "choose divisible sizes")
        size = int(size)
        per_sequence_token = size // (batch * local_seq)
        if x in stored:
            saved, recomputed = size, 0
        elif policy == "memo":
            saved = per_sequence_token * batch * alpha_tokens
            recomputed = size - saved
        else:
            saved, recomputed = 0, size
        offloaded = saved if policy == "memo" else 0
        tensors.append(SavedTensor(x.name, x.category, size, saved, offloaded, recomputed, x.what))
    return LayerActivations(policy, alpha, tuple(tensors))
