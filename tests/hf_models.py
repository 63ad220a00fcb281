"""Tiny Hugging Face models built from their config classes (no download), for the trust matrix.

Every architecture gets the same small sizes (one layer, two for Gemma3's and Exaone4's sliding
+ full pair; width 32, 4 heads of 8, 2 KV heads where the model has GQA), no dropout, and a
window only when a case asks for one.  One layer keeps the matrix's compile time down; what a layer computes is the
same in every layer.
"""

from __future__ import annotations

import torch

VOCAB = 64
WIDTH = 32
LAYERS = 1


def _common(attn: str) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=48,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, attn_implementation=attn, attention_dropout=0.0)


def _llama(attn, window):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_common(attn)))


def _qwen2(attn, window):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**_common(attn), use_sliding_window=window is not None,
                                        sliding_window=window, max_window_layers=0))


def _qwen3(attn, window):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**_common(attn), head_dim=8,
                                        use_sliding_window=window is not None,
                                        sliding_window=window, max_window_layers=0))


def _mistral(attn, window):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_common(attn), sliding_window=window))


def _gemma3(attn, window):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return Gemma3ForCausalLM(Gemma3TextConfig(
        **_common(attn) | {"num_hidden_layers": 2}, head_dim=8, sliding_window=window or 4096,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8))


def _phi3(attn, window):
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**_common(attn), sliding_window=window, resid_pdrop=0.0,
                                      embd_pdrop=0.0, pad_token_id=0))


def _olmo2(attn, window):
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM(Olmo2Config(**_common(attn)))


def _gpt_neox(attn, window):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = _common(attn)
    cfg.pop("num_key_value_heads")
    return GPTNeoXForCausalLM(GPTNeoXConfig(**cfg, hidden_dropout=0.0, rotary_pct=0.5))


def _gpt2(attn, window):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
                                      n_positions=256, attn_implementation=attn, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _starcoder2(attn, window):
    from transformers import Starcoder2Config, Starcoder2ForCausalLM
    return Starcoder2ForCausalLM(Starcoder2Config(**_common(attn), sliding_window=window,
                                                  residual_dropout=0.0, embedding_dropout=0.0))


def _exaone4(attn, window):
    # alternating layers (sliding, then full): the full layer keeps the config's window in its
    # module's ``sliding_window`` and applies none (its type says so)
    from transformers import Exaone4Config, Exaone4ForCausalLM
    return Exaone4ForCausalLM(Exaone4Config(
        **_common(attn) | {"num_hidden_layers": 2}, sliding_window=window or 4096,
        layer_types=["sliding_attention", "full_attention"]))


def _deepseek_v3(attn, window, experts: bool = False):
    # MLA: q/k heads of 24 (16 without RoPE + 8 with, interleaved), v heads of 16, keys and values
    # from a rank-16 latent, queries from a rank-16 one (q_lora_rank, as DeepSeek-V3 itself), as
    # many KV heads as heads; the MLP dense in every layer, or (``experts``) DeepSeek-V3's own
    # mixture: 4 routed experts, 2 per token, one shared, grouped top-k routing
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **_common(attn) | {"num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=0 if experts else LAYERS, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=24, n_group=2, topk_group=1))


def _deepseek_v3_moe(attn, window):
    return _deepseek_v3(attn, window, experts=True)


def _mixtral(attn, window):
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**_common(attn), num_local_experts=4,
                                            num_experts_per_tok=2))


def _qwen3moe(attn, window):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_common(attn), head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[]))


def _olmoe(attn, window):
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(**_common(attn), num_experts=4, num_experts_per_tok=2))


ARCHITECTURES = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "gemma3": _gemma3,
    "phi3": _phi3, "olmo2": _olmo2, "gpt_neox": _gpt_neox, "gpt2": _gpt2,
    "starcoder2": _starcoder2, "exaone4": _exaone4, "deepseek_v3": _deepseek_v3,
    "mixtral": _mixtral, "qwen3moe": _qwen3moe, "olmoe": _olmoe, "deepseek_v3_moe": _deepseek_v3_moe,
}
# mixtures of experts: transformers' grouped_mm experts (4 experts, 2 per token) have no float64
# kernel on CPU (torch.nn.functional.grouped_mm takes float32, bfloat16 and float16)
MOE = ("mixtral", "qwen3moe", "olmoe", "deepseek_v3_moe")
WINDOWED = ("qwen2", "qwen3", "mistral", "gemma3", "phi3", "starcoder2", "exaone4")


def build(arch: str, attn: str = "sdpa", window: int | None = None,
          dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """The model in train mode, weights drawn from ``seed``, cast to ``dtype``."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch](attn, window)
    return model.to(dtype).train()
