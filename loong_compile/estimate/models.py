"""Model shapes the estimator needs: presets and any Hugging Face ``config.json`` of the common
decoder families (dense, GQA/MQA, explicit ``head_dim``, tied embeddings, MoE with shared
experts, sliding-window layers, biases, QK-norms).

Only the numbers that enter the formulas are kept (the 4D-estimator paper's Table 1:
``h, a, k, h_ffn, L, v``, plus what the families add).  Parameter counts follow what
transformers builds from the same config (``tests/estimate/test_model_specs.py`` checks them on the
meta device).  A ``model_type`` the reader does not know is an error naming it; nothing is
downloaded.
"""

from __future__ import annotations

import dataclasses

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.masking import causal_pairs, kv_chunk_fraction
from loong_compile.parallel.rules import head_violation

QK_NORMS = ("none", "head", "full")   # none; RMSNorm over head_dim (Qwen3, Gemma3); over all heads (OLMo2)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A pre-norm decoder with RoPE and a gated (SwiGLU/GeGLU) FFN.

    hidden (h), layers (L), heads (a), kv_heads (k), ffn (h_ffn of dense layers), vocab (v);
    head_dim (0: h/a); tied_embeddings: the LM head is the embedding.  MoE: ``experts`` routed
    experts of width ``expert_ffn``, ``experts_per_token`` of them active per token, shared
    experts of total width ``shared_expert_ffn`` (with a sigmoid gate when
    ``shared_expert_gate``), in every layer but the first ``dense_layers``.  Biases:
    ``qkv_bias`` (q, k, v projections), ``o_bias``, ``mlp_bias``.  ``norms_per_layer``
    RMSNorm weights of width h per layer, ``qk_norm`` one of ``QK_NORMS``.
    ``sliding_window`` tokens (0: none) in ``local_layers`` of the layers.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0
    tied_embeddings: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    dense_layers: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norms_per_layer: int = 2
    qk_norm: str = "none"
    sliding_window: int = 0
    local_layers: int = 0

    def __post_init__(self) -> None:
        if self.head_dim == 0 and isinstance(self.hidden, int) and isinstance(self.heads, int) \
                and self.heads > 0 and self.hidden % self.heads == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        for field in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                rule = (f"without head_dim, hidden ({self.hidden}) must be a multiple of heads ({self.heads})"
                        if field == "head_dim" else f"{field} must be a positive integer")
                raise self._error(f"{field}={value!r}", rule, f"fix {field} in the model config")
        for field in ("experts", "experts_per_token", "expert_ffn", "shared_expert_ffn", "dense_layers",
                      "norms_per_layer", "sliding_window", "local_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self._error(f"{field}={value!r}", f"{field} must be an integer >= 0", f"fix {field}")
        gqa = head_violation(self.heads, self.kv_heads, hp=1)
        if gqa:
            raise self._error(gqa.what, gqa.rule, "fix num_key_value_heads")
        if self.experts and not (1 <= self.experts_per_token <= self.experts and self.expert_ffn >= 1):
            raise self._error(f"experts={self.experts}, experts_per_token={self.experts_per_token}, "
                              f"expert_ffn={self.expert_ffn}",
                              "an MoE needs 1 <= experts_per_token <= experts and expert_ffn >= 1",
                              "fix num_experts_per_tok / moe_intermediate_size")
        if self.dense_layers > self.layers or self.local_layers > self.layers:
            raise self._error(f"dense_layers={self.dense_layers}, local_layers={self.local_layers}",
                              f"at most the {self.layers} layers", "fix the layer pattern")
        if self.qk_norm not in QK_NORMS:
            raise self._error(f"qk_norm={self.qk_norm!r}", f"qk_norm is one of {', '.join(QK_NORMS)}",
                              "fix qk_norm")

    def _error(self, what: str, rule: str, fix: str) -> LoongConfigError:
        return LoongConfigError(f"model {self.name!r}: {what}", rule, fix)

    # --- parameters (what transformers instantiates) -----------------------------------
    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def attention_params(self) -> int:
        """q, k, v, o projections (and their biases) of one layer."""
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        return (2 * h * q + 2 * h * kv + (q + 2 * kv) * self.qkv_bias + h * self.o_bias)

    def _gated_ffn(self, width: int) -> int:
        return 3 * self.hidden * width + (2 * width + self.hidden) * self.mlp_bias

    @property
    def dense_ffn_params(self) -> int:
        return self._gated_ffn(self.ffn)

    @property
    def moe_ffn_params(self) -> int:
        """Every expert, the router and the shared experts of one MoE layer."""
        if not self.experts:
            return 0
        shared = self._gated_ffn(self.shared_expert_ffn) if self.shared_expert_ffn else 0
        return (self.experts * 3 * self.hidden * self.expert_ffn + self.hidden * self.experts
                + shared + self.hidden * self.shared_expert_gate)

    @property
    def norm_params(self) -> int:
        """RMSNorm weights of one layer (the block norms and the QK-norms)."""
        qk = {"none": 0, "head": 2 * self.head_dim,
              "full": (self.heads + self.kv_heads) * self.head_dim}[self.qk_norm]
        return self.norms_per_layer * self.hidden + qk

    @property
    def layer_matmul_params(self) -> float:
        """Projection weights per layer, averaged over dense and MoE layers (split by TP)."""
        return self.attention_params + (self.dense_layers * self.dense_ffn_params
                                        + self.moe_layers * self.moe_ffn_params
                                        + (self.layers - self.dense_layers - self.moe_layers)
                                        * self.dense_ffn_params) / self.layers

    @property
    def parameters(self) -> int:
        """All parameters, tied embeddings counted once (as ``model.num_parameters()``)."""
        ffn = (self.layers - self.moe_layers) * self.dense_ffn_params + self.moe_layers * self.moe_ffn_params
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.hidden + self.layers * (self.attention_params + self.norm_params) + ffn

    # --- per-token work -----------------------------------------------------------------
    @property
    def activated_ffn(self) -> float:
        """FFN intermediate width one token passes through, averaged over layers (MoE: the
        ``experts_per_token`` routed experts plus the shared ones)."""
        moe = self.experts_per_token * self.expert_ffn + self.shared_expert_ffn
        return ((self.layers - self.moe_layers) * self.ffn + self.moe_layers * moe) / self.layers

    @property
    def activated_layer_params(self) -> float:
        """Projection weights one token multiplies per layer (averaged): 2 FLOPs each forward."""
        gate = self.hidden * (self.experts + self.shared_expert_gate) if self.experts else 0
        moe = self.attention_params + 3 * self.hidden * (self.experts_per_token * self.expert_ffn
                                                         + self.shared_expert_ffn) + gate
        dense = self.attention_params + self.dense_ffn_params
        return ((self.layers - self.moe_layers) * dense + self.moe_layers * moe) / self.layers

    def attended_pairs(self, seq: int, doc_length: int = 0) -> float:
        """Causal (query, key) pairs per sequence per layer, averaged over layers, counted as
        LoongTrain and Megatron count FLOPs: s^2/2, and in sliding-window layers w^2/2 + (s - w) w;
        with packed documents of ``doc_length`` tokens, that per document."""
        return self._per_layer(lambda window: causal_pairs(seq, window, doc_length))

    def kv_fraction(self, seq: int, cp: int, doc_length: int = 0) -> float:
        """The CP P2P bytes of a layer over the Double-Ring's, averaged over layers: 1 for dense
        layers (the ring), the masked direct exchange's share for windowed or packed ones."""
        return self._per_layer(lambda window: kv_chunk_fraction(seq, cp, window, doc_length)
                               if window or doc_length else 1.0)

    def _per_layer(self, value) -> float:
        local = value(self.sliding_window) if self.local_layers else 0.0
        return ((self.layers - self.local_layers) * value(None) + self.local_layers * local) / self.layers

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "parameters": self.parameters}
