"""Tiny Hugging Face models built from their config classes (no download), for the trust matrix.

Every architecture gets the same small sizes (one layer, two where layers differ by type:
a sliding + full pair, a layer with RoPE + one without, a linear-attention + a full one;
width 32, 4 heads of 8, 2 KV heads where the model has GQA), no dropout, and a
window only when a case asks for one.  One layer keeps the matrix's compile time down; what a layer computes is the
same in every layer.
"""

from __future__ import annotations

import functools

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


# Dense families whose layers differ from Llama's in what they do with positions, windows or
# scales (issue 23): each is token-local outside its attention, so each must be exact.
def _cohere2(attn, window):
    # local/global pattern: sliding layers rotate q/k, the full layer has no RoPE (NoPE); Cohere's
    # parallel block (attention and MLP read one norm) and its logit_scale
    from transformers import Cohere2Config, Cohere2ForCausalLM
    return Cohere2ForCausalLM(Cohere2Config(
        **_common(attn) | {"num_hidden_layers": 2}, sliding_window=window or 4096,
        layer_types=["sliding_attention", "full_attention"], logit_scale=0.5))


def _smollm3(attn, window):
    # NoPE layers: the second layer applies no rotary embedding
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    return SmolLM3ForCausalLM(SmolLM3Config(**_common(attn) | {"num_hidden_layers": 2},
                                            no_rope_layers=[1, 0], pad_token_id=0))


def _phi(attn, window):
    # partial rotary (half of each head), parallel attention and MLP
    from transformers import PhiConfig, PhiForCausalLM
    return PhiForCausalLM(PhiConfig(**_common(attn), partial_rotary_factor=0.5))


def _gptj(attn, window):
    # parallel block, rotary on the first 4 of 8 dims, interleaved (rotate_every_two)
    from transformers import GPTJConfig, GPTJForCausalLM
    return GPTJForCausalLM(GPTJConfig(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
                                      rotary_dim=4, n_positions=256, attn_implementation=attn))


def _cohere(attn, window):
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(CohereConfig(**_common(attn), logit_scale=0.5))


def _falcon(attn, window):
    # parallel attention and MLP, grouped KV heads (the new decoder architecture)
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, ffn_hidden_size=48,
        max_position_embeddings=256, attn_implementation=attn))


def _granite(attn, window):
    # every multiplier away from 1: embeddings, residuals, the attention scale, the logits
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(**_common(attn), embedding_multiplier=2.0,
                                            residual_multiplier=0.5, attention_multiplier=0.2,
                                            logits_scaling=4.0))


ARCHITECTURES = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "gemma3": _gemma3,
    "phi3": _phi3, "olmo2": _olmo2, "gpt_neox": _gpt_neox, "gpt2": _gpt2,
    "starcoder2": _starcoder2, "exaone4": _exaone4, "deepseek_v3": _deepseek_v3,
    "cohere2": _cohere2, "smollm3": _smollm3, "phi": _phi, "gptj": _gptj, "cohere": _cohere,
    "falcon": _falcon, "granite": _granite,
    "mixtral": _mixtral, "qwen3moe": _qwen3moe, "olmoe": _olmoe, "deepseek_v3_moe": _deepseek_v3_moe,
}
# mixtures of experts: transformers' grouped_mm experts (4 experts, 2 per token) have no float64
# kernel on CPU (torch.nn.functional.grouped_mm takes float32, bfloat16 and float16)
MOE = ("mixtral", "qwen3moe", "olmoe", "deepseek_v3_moe")


# Architectures that mix tokens outside attention (a scan, a convolution), made exact across ranks
# by the scans stage (passes/scans/).  MLPs dense, so that what is judged is the mixing.
def _qwen3_next(attn, window):
    # gated delta rule (a causal conv1d and a chunked recurrence) in the linear-attention layer
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        **_common(attn) | {"num_hidden_layers": 2}, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, mlp_only_layers=[0, 1]))


def _qwen3_5(attn, window):
    # Qwen3-Next's gated DeltaNet layer beside attention, without experts, in a model that
    # numbers its tokens on four rotary axes (position_ids expanded to (4, batch, tokens))
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        **_common(attn) | {"num_hidden_layers": 2}, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4))


def _falcon_h1(attn, window):
    # Mamba2 mixer (a causal conv1d and a selective scan) beside attention in every layer
    from transformers import FalconH1Config, FalconH1ForCausalLM
    return FalconH1ForCausalLM(FalconH1Config(
        **_common(attn), mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
        mamba_d_conv=4, mamba_chunk_size=16))


def _bamba(attn, window):
    # IBM's Bamba: Mamba-2 mixers (the same transformers fallback as Falcon-H1's) with attention on
    # the layers attn_layer_indices names: a Mamba-2 layer, then an attention layer
    from transformers import BambaConfig, BambaForCausalLM
    return BambaForCausalLM(BambaConfig(
        **_common(attn) | {"num_hidden_layers": 2}, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16))


# Attention that is neither full nor windowed: chunked (Llama 4), with sinks (gpt-oss), with a
# softcapped score (Gemma 2: refused by name).  Float32 where the experts' grouped_mm needs it.
def _llama4(attn, window):
    # chunked attention (tokens see only their own chunk of 16) on the first layer, NoPE (and its
    # attention temperature) on the second, whose MLP is a mixture of experts
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM(Llama4TextConfig(
        **_common(attn) | {"num_hidden_layers": 2}, head_dim=8, intermediate_size_mlp=48,
        attention_chunk_size=16, moe_layers=[1], num_local_experts=4, num_experts_per_tok=1,
        no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"]))


def _gpt_oss(attn, window):
    # attention sinks: a learned logit per head joins each softmax (eager only: transformers
    # refuses sdpa for it)
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM(GptOssConfig(
        **_common(attn) | {"num_hidden_layers": 2}, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=window or 4096,
        layer_types=["sliding_attention", "full_attention"]))


def _gemma2(attn, window):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(
        **_common(attn) | {"num_hidden_layers": 2}, head_dim=8, query_pre_attn_scalar=8,
        attn_logit_softcapping=50.0, sliding_window=window or 4096))


def _lfm2(attn, window):
    # a short causal convolution (kernel 4: ops/scans/causal_conv.py across ranks) in the first layer,
    # attention in the second
    from transformers import Lfm2Config, Lfm2ForCausalLM
    return Lfm2ForCausalLM(Lfm2Config(
        **_common(attn) | {"num_hidden_layers": 2}, layer_types=["conv", "full_attention"],
        conv_L_cache=4))


# token mixers with a state that the scans stage makes exact
SCAN_ARCHITECTURES = {"lfm2": _lfm2, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5,
                      "falcon_h1": _falcon_h1, "bamba": _bamba}
ATTENTION_VARIANTS = {"llama4": _llama4, "gpt_oss": _gpt_oss, "gemma2": _gemma2}
WINDOWED = ("qwen2", "qwen3", "mistral", "gemma3", "phi3", "starcoder2", "exaone4", "cohere2")


def build(arch: str, attn: str = "sdpa", window: int | None = None,
          dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """The model in train mode, weights drawn from ``seed``, cast to ``dtype``."""
    torch.manual_seed(seed)
    model = (ARCHITECTURES | SCAN_ARCHITECTURES | ATTENTION_VARIANTS)[arch](
        attn, window)
    return model.to(dtype).train()


@functools.cache
def dynamo_traces_checkpointing() -> bool:
    """Whether Dynamo traces transformers' gradient checkpointing of a layer in one graph, as on
    transformers <= 5.24 without the kernels package; since 5.25 (which requires it) the hub-kernel
    wrapper of the attention changes a global inside the checkpointed body, and Dynamo breaks the
    graph there."""
    model = build("llama", dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        torch.compile(model, backend="eager", fullgraph=True)(torch.zeros(1, 8, dtype=torch.long),
                                                              use_cache=False)
        return True
    except torch._dynamo.exc.Unsupported:
        return False
    finally:
        torch.compiler.reset()
