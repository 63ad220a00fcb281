"""Per-GPU memory of one configuration: the terms of ``estimate/equations.py`` evaluated.

``estimate_memory`` evaluates every term numerically (compiled once per set of switches
with ``lambdify``) and reports GiB, with overheads (CUDA context, communicator buffers,
fragmentation) apart from the terms.  ``layer_activations`` gives one layer's saved
activations in exact bytes per category, for comparison with what the compiled graph saves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import sympy as sp

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.equations import (
    ALLTOALL_HELD_BYTES, KV_CHUNK_BYTES, LOCAL_TOKENS, POLICIES, SYMBOLS, Term, _bytes,
    all_terms, alpha, counted_tensors, n_ring_buffers, stored_tensors,
)
from loong_compile.estimate.lm_head import chunk_tokens
from loong_compile.estimate.tiling import region_tile
from loong_compile.estimate.models import ModelSpec
from loong_compile.parallel.rules import (
    CATEGORIES, Violation, head_group_violation, head_violation, inner_ring_violation,
    sequence_violation)

GIB = 2 ** 30


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
    head_groups: int = 1   # attention a group of heads at a time (option head_groups)
    stage: int = 0
    doc_length: int = 0  # mean packed document length (0: one document per sequence)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.hp

    @property
    def sp(self) -> int:
        return self.cp * self.hp

    def validate(self, model: ModelSpec) -> None:
        """Raise LoongConfigError naming the first value that breaks a divisibility rule."""
        for name in ("seq", "dp", "tp", "pp", "cp", "hp", "micro_batch", "inner_ring",
                     "head_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoongConfigError(f"{name}={value!r}", f"{name} must be a positive integer",
                                       f"pass a positive integer for {name}")
        checks = (
            (model.heads % self.tp == 0, f"tp={self.tp}",
             f"tp must divide the {model.heads} attention heads of {model.name}",
             "choose a tp that divides the head count"),
            (self.tp <= model.kv_heads and model.kv_heads % self.tp == 0 or self.tp % model.kv_heads == 0,
             f"tp={self.tp}", f"tp must divide {model.kv_heads} KV heads or be a multiple of them",
             "choose another tp"),
            (model.layers % self.pp == 0, f"pp={self.pp}",
             f"pp must divide the {model.layers} layers", "choose a pp that divides the layer count"),
            (self.seq % self.tp == 0, f"seq={self.seq}",
             f"sequence parallelism splits the sequence over tp={self.tp}", "use a multiple of tp"),
            (0 <= self.stage < self.pp, f"stage={self.stage}",
             f"stage must be in [0, pp) = [0, {self.pp})", "pass a stage index below pp"),
        )
        for ok, what, rule, fix in checks:
            if not ok:
                raise LoongConfigError(what, rule, fix)
        violation = self.layout_violation(model)
        if violation:
            raise LoongConfigError(*violation)

    def layout_violation(self, model: ModelSpec) -> Violation | None:
        """The backend's layout rules (``loong_compile.parallel.rules``) on this configuration: what
        ``torch.compile(backend="loong")`` would refuse.  Under tensor parallelism they apply
        to one TP rank's heads (KV heads fewer than tp are replicated, one per TP rank)."""
        local_kv = model.kv_heads // self.tp if model.kv_heads % self.tp == 0 else 1
        return (inner_ring_violation(self.cp, self.inner_ring)
                or sequence_violation(self.seq, self.cp, self.hp)
                or head_violation(model.heads // self.tp, local_kv, self.hp)
                or head_group_violation(model.heads // self.tp, local_kv, self.hp,
                                        self.head_groups))


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Switches for the extension terms.  The defaults are the 4D paper (eq. 18) exactly.

    activations: ``none`` (everything saved, eq. 12), ``full`` (layer inputs only),
        ``full_offload`` (layer inputs only, on the host), ``sc++`` (LoongTrain's Selective
        Checkpoint++), ``memo`` (MEMO's swapping with ``alpha``).
    zero: ZeRO stage 0-3 over d*cp*hp (the paper: 1).
    states_on_host: with ``zero=3``, the shards in host memory and on the device only what
        FSDP2 gathers (``equations.GATHERED_ON_DEVICE``; examples/training.py --fsdp --offload-states).
    exact: also count the tensors eq. 12 leaves out (lse, RMSNorm statistics).
    double_ring_buffers: count the Double-Ring's KV buffers and 2D-Attention's backward working
        set (one head group's of each).
    recompute_working_set: count one layer's recomputed tensors (policies that recompute).
    cuda_context_gib, comm_buffers_gib, fragmentation: overheads, reported apart; fragmentation
        is a fraction of the terms' total.
    usable_fraction: the 80% rule (the paper: estimates <= 80% of capacity never ran out).
    lm_head_chunk: None: the LM head's activations as eq. 14 counts them (the logits of every
        token); ``"auto"`` or a number of tokens: as the compiler keeps them when the loss is in
        the graph, chunked (``estimate/lm_head.py``, the rule the compiler uses).
    tile_tokens: None: every MLP intermediate saved (the paper); ``"auto"`` or a number of
        tokens: the MLP token-tiled as the compiler does where its tokens take more than one
        tile (``estimate/tiling.py``), its intermediates never saved, one tile's working set.
    """

    activations: str = "none"
    alpha: float = 1.0
    zero: int = 1
    states_on_host: bool = False
    exact: bool = False
    double_ring_buffers: bool = False
    recompute_working_set: bool = True
    dtype_bytes: int = 2
    cuda_context_gib: float = 0.0
    comm_buffers_gib: float = 0.0
    fragmentation: float = 0.0
    usable_fraction: float = 0.8
    lm_head_chunk: int | str | None = None
    tile_tokens: int | str | None = None

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
        if self.states_on_host and self.zero != 3:
            raise LoongConfigError(f"states_on_host=True with zero={self.zero}",
                                   "the host keeps ZeRO-3's shards (FSDP2's CPU offload): "
                                   "states_on_host needs zero=3", "pass zero=3, or states_on_host=False")
        if isinstance(self.dtype_bytes, bool) or self.dtype_bytes not in (1, 2, 4, 8):
            raise bad("dtype_bytes", "dtype_bytes must be 1, 2, 4 or 8", "pass 2 for bf16")
        for name in ("cuda_context_gib", "comm_buffers_gib", "fragmentation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise bad(name, f"{name} must be a number >= 0", f"pass {name}=0 or more")
        if isinstance(self.usable_fraction, bool) or not isinstance(self.usable_fraction, (int, float)) \
                or not 0 < self.usable_fraction <= 1:
            raise bad("usable_fraction", "usable_fraction must be in (0, 1]", "pass 0.8 (the paper's rule)")
        if self.lm_head_chunk not in (None, "auto") and (
                isinstance(self.lm_head_chunk, bool) or not isinstance(self.lm_head_chunk, int)
                or self.lm_head_chunk < 1):
            raise bad("lm_head_chunk", 'lm_head_chunk is None (unchunked), "auto" or tokens >= 1',
                      'pass lm_head_chunk="auto"')
        if self.tile_tokens not in (None, "auto") and (
                isinstance(self.tile_tokens, bool) or not isinstance(self.tile_tokens, int)
                or self.tile_tokens < 1):
            raise bad("tile_tokens", 'tile_tokens is None (untiled), "auto" or tokens >= 1',
                      'pass tile_tokens="auto"')

    @classmethod
    def loongtrain(cls, **changes) -> MemoryOptions:
        """The settings ``loong plan`` uses: every tensor counted, the Double-Ring's buffers,
        the LM head chunked and the MLP tiled as the compiler runs them (the loss in the
        graph; the default ``tile_tokens="auto"``), and typical overheads (0.5 GiB CUDA
        context, 0.5 GiB NCCL buffers)."""
        base = dict(exact=True, double_ring_buffers=True, cuda_context_gib=0.5, comm_buffers_gib=0.5,
                    lm_head_chunk="auto", tile_tokens="auto")
        return cls(**{**base, **changes})


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """GiB per named term (``terms``: the estimate; ``host``: host memory per GPU: memo's
    offloaded activations, the model states when they are on the host;
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


def memory_terms(options: MemoryOptions, tiled: bool = False) -> list[Term]:
    """All terms for these switches (symbolic; see ``SYMBOLS``); ``tiled``: the MLP tiled
    (``mlp_tile`` says where the compiler tiles it)."""
    return all_terms(*_switches(options, tiled))


def _switches(options: MemoryOptions, tiled: bool) -> tuple:
    """``all_terms``'s arguments for these options, in order (hashable: ``_compiled``'s key)."""
    return (options.zero, options.activations, options.exact, options.recompute_working_set,
            options.alpha == 0, options.double_ring_buffers, options.lm_head_chunk is not None, tiled,
            options.states_on_host)


@functools.lru_cache(maxsize=256)
def _lambdified(expr: sp.Expr) -> Callable[..., float]:
    """``expr`` as a plain Python function of ``SYMBOLS`` (terms shared by several switch
    settings, like the model states, are compiled once)."""
    return sp.lambdify(SYMBOLS, expr, modules="math")


@functools.lru_cache(maxsize=64)
def _compiled(switches: tuple) -> tuple[tuple[Term, Callable[..., float]], ...]:
    return tuple((term, _lambdified(term.expr)) for term in all_terms(*switches))


def ring_buffer_count(config: ParallelConfig) -> int:
    """Inner-ring buffer when d_cp > 1, outer-ring buffer when there is more than one inner ring."""
    return int(config.cp > 1) + int(config.cp // config.inner_ring > 1)


def symbol_values(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> tuple:
    """Numbers for ``SYMBOLS``, in order (``f``: the FFN width a token passes through)."""
    return (model.hidden, model.heads, model.kv_heads, model.activated_ffn, model.layers, model.vocab,
            config.seq, config.micro_batch, config.dp, config.tp, config.pp, config.cp, config.hp,
            config.stage, options.dtype_bytes, options.alpha, ring_buffer_count(config), model.head_dim,
            model.layer_matmul_params, model.norm_params, int(model.tied_embeddings),
            model.experts * model.moe_layers / model.layers, lm_head_chunk(model, config, options),
            mlp_tile(model, config, options), config.head_groups)


def lm_head_chunk(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> int:
    """Tokens per chunk of the LM head, as the compiler picks them for one GPU's tokens (1 when
    the estimate counts the head unchunked: the symbol is then unused)."""
    if options.lm_head_chunk is None:
        return 1
    return chunk_tokens(_local_tokens(config), model.vocab // config.tp, options.lm_head_chunk)


def _local_tokens(config: ParallelConfig) -> int:
    return config.micro_batch * config.seq // (config.cp * config.hp * config.tp)


def mlp_tile(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> int:
    """Tokens per tile of the MLP as the compiler picks them for one GPU's tokens (all of them:
    not tiled, without ``tile_tokens`` or where they fit one tile): the region's input norm
    and its four FFN-wide values per token (``estimate/tiling.py::region_tile``)."""
    tokens = _local_tokens(config)
    if options.tile_tokens is None:
        return tokens
    per_token = options.dtype_bytes * (model.hidden + 4 * model.activated_ffn) // config.tp
    return region_tile(tokens, per_token, options.tile_tokens)


def mlp_tiled(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> bool:
    return mlp_tile(model, config, options) < _local_tokens(config)


def estimate_memory(model: ModelSpec, config: ParallelConfig, options: MemoryOptions = MemoryOptions(),
                    capacity_gib: float | None = None) -> MemoryBreakdown:
    """Evaluate every term for one configuration (GiB per GPU)."""
    config.validate(model)
    if capacity_gib is not None and (isinstance(capacity_gib, bool) or capacity_gib <= 0):
        raise LoongConfigError(f"capacity_gib={capacity_gib!r}", "GPU capacity must be > 0 GiB",
                               "pass the GPU's memory in GiB, e.g. 80")
    compiled = _compiled(_switches(options, mlp_tiled(model, config, options)))
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


@functools.lru_cache(maxsize=8)
def _compiled_categories(exact: bool, tiled: bool) -> dict[str, Callable[..., float]]:
    counted = counted_tensors("memo", exact, tiled)
    return {cat: _lambdified(_bytes([x for x in counted if x.category == cat])) for cat in CATEGORIES}


def category_bytes(model: ModelSpec, config: ParallelConfig, options: MemoryOptions) -> dict[str, float]:
    """One layer's skeletal bytes per GPU per MEMO category: S_input, S_attn, S_other (MEMO 4.1)."""
    values = symbol_values(model, config, options)
    tiled = mlp_tiled(model, config, options)
    return {cat: float(fn(*values)) for cat, fn in _compiled_categories(options.exact, tiled).items()}


def attention_transfer_bytes(model: ModelSpec, config: ParallelConfig, dtype_bytes: int) -> tuple[float, float]:
    """(Size(kv), Size(q) + Size(k) + Size(v) + Size(out)) in bytes for one GPU (LoongTrain 4.5.3-4)."""
    values = symbol_values(model, config, MemoryOptions(dtype_bytes=dtype_bytes))
    return float(_lambdified(KV_CHUNK_BYTES)(*values)), float(_lambdified(ALLTOALL_HELD_BYTES)(*values))


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
        """Bytes per MEMO category (``input``, ``attention``, ``other``) of ``field``."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for x in self.tensors:
            totals[x.category] += getattr(x, field)
        return totals


def layer_activations(model: ModelSpec, seq: int, batch: int, dtype_bytes: int, policy: str,
                      alpha: float = 0.0, hp: int = 1, cp: int = 1,
                      tiled: bool = False) -> LayerActivations:
    """Exact bytes one transformer layer saves for its backward, per tensor and category.

    Counts every tensor of ``LAYER_TENSORS`` (eq. 12's plus the lse and RMSNorm statistics),
    for the Llama of this project (RMSNorm, RoPE, SwiGLU, GQA, causal SDPA) on one GPU of a
    ``hp x cp`` grid.  ``none``: all saved.  ``sc++``: layer input, attention output and lse
    saved, the others recomputed.  ``memo``: the layer input and attention output + lse
    offloaded; of each "other" tensor the first floor(alpha * s_local) tokens of every sequence
    offloaded, the rest recomputed (the last two layers, which MEMO does not swap, would keep
    their bytes on device instead).  ``full`` saves the layer input only; ``tiled``: no MLP
    intermediate (the tiled region keeps its input only).
    """
    options = MemoryOptions(activations=policy, alpha=alpha, dtype_bytes=dtype_bytes)   # validates
    config = ParallelConfig(seq=seq, cp=cp, hp=hp, micro_batch=batch)
    config.validate(model)
    values = {symbol: sp.nsimplify(x) for symbol, x in zip(SYMBOLS, symbol_values(model, config, options))
              if symbol not in (alpha, n_ring_buffers)}
    local_seq = seq // (cp * hp)
    alpha_tokens = math.floor(alpha * local_seq)
    stored = stored_tensors(policy, exact=True, tiled=tiled)
    tensors = []
    for x in counted_tensors(policy, exact=True, tiled=tiled):
        size = sp.nsimplify(LOCAL_TOKENS * x.per_token).subs(values)
        if not size.is_Integer:
            raise LoongConfigError(f"{x.name} of {model.name} takes {size} bytes per GPU",
                                   "tensor sizes must be whole bytes", "choose divisible sizes")
        size = int(size)
        if size == 0:       # a tensor this family does not have (router logits of a dense layer)
            continue
        per_sequence_token = size // (batch * local_seq)
        if x in stored:
            saved, recomputed = size, 0
        elif policy == "memo":
            saved = per_sequence_token * batch * alpha_tokens
            recomputed = size - saved
        else:
            saved, recomputed = 0, size
        offloaded = saved if policy in ("memo", "full_offload") else 0
        tensors.append(SavedTensor(x.name, x.category, size, saved, offloaded, recomputed, x.what))
    return LayerActivations(policy, alpha, tuple(tensors))
