"""Reading a Hugging Face ``config.json`` into a ``ModelSpec``, family by family.

Each supported ``model_type`` names the fields its transformers class reads and the defaults
that class applies when a field is absent (tied embeddings, biases, sliding-window layout).
A ``model_type`` not listed here, or a required field that is missing, is an error naming
it: a wrong parameter count would be silently wrong memory.
"""

from __future__ import annotations

from pathlib import Path

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.json_input import read_json_object
from loong_compile.estimate.models import ModelSpec

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _sliding_all(config: dict, layers: int) -> int:
    """Mistral / Mixtral / Phi-3: every layer uses the window when one is set."""
    return layers if config.get("sliding_window") else 0


def _qwen_sliding(config: dict, layers: int) -> int:
    """Qwen2/3: layers from ``max_window_layers`` on use the window, if ``use_sliding_window``."""
    if not (config.get("use_sliding_window") and config.get("sliding_window")):
        return 0
    return sum(1 for i in range(layers) if i >= config.get("max_window_layers", layers))


def _pattern_sliding(every: int):
    """Gemma2/3: ``layer_types`` if given, else every ``sliding_window_pattern``-th layer is global."""
    def count(config: dict, layers: int) -> int:
        if not config.get("sliding_window"):
            return 0
        if config.get("layer_types"):
            return sum(1 for x in config["layer_types"] if x == "sliding_attention")
        pattern = config.get("sliding_window_pattern", every)
        return sum(1 for i in range(layers) if (i + 1) % pattern)
    return count


def _no_sliding(config: dict, layers: int) -> int:
    return 0


def _sparse_layers(config: dict, layers: int, experts_key: str) -> int:
    """Qwen-MoE: layer i is sparse unless listed in ``mlp_only_layers`` or off the sparse step."""
    if not config.get(experts_key):
        return 0
    only_mlp = set(config.get("mlp_only_layers") or ())
    step = config.get("decoder_sparse_step", 1)
    return sum(1 for i in range(layers) if i not in only_mlp and (i + 1) % step == 0)


# model_type -> (tied-embeddings default, biases (qkv, o) from, norms per layer, qk_norm, sliding)
FAMILIES = {
    "llama": (False, "attention_bias", 2, "none", _no_sliding),
    "mistral": (False, None, 2, "none", _sliding_all),
    "mixtral": (False, None, 2, "none", _sliding_all),
    "phi3": (False, None, 2, "none", _sliding_all),
    "qwen2": (False, "qkv", 2, "none", _qwen_sliding),
    "qwen2_moe": (False, "qkv", 2, "none", _qwen_sliding),
    "qwen3": (False, "attention_bias", 2, "head", _qwen_sliding),
    "qwen3_moe": (False, "attention_bias", 2, "head", _qwen_sliding),
    "olmo2": (False, "attention_bias", 2, "full", _no_sliding),
    "gemma": (True, "attention_bias", 2, "none", _no_sliding),
    "gemma2": (True, "attention_bias", 4, "none", _pattern_sliding(2)),
    "gemma3_text": (True, "attention_bias", 4, "head", _pattern_sliding(6)),
}


def _moe_fields(model_type: str, config: dict, layers: int) -> dict:
    if model_type == "mixtral":
        experts = _need(config, "num_local_experts", model_type)
        return dict(experts=experts, experts_per_token=_need(config, "num_experts_per_tok", model_type),
                    expert_ffn=config["intermediate_size"])
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    sparse = _sparse_layers(config, layers, "num_experts")
    if not sparse:
        return {}
    fields = dict(experts=_need(config, "num_experts", model_type),
                  experts_per_token=_need(config, "num_experts_per_tok", model_type),
                  expert_ffn=_need(config, "moe_intermediate_size", model_type),
                  dense_layers=layers - sparse)
    if model_type == "qwen2_moe":
        fields.update(shared_expert_ffn=_need(config, "shared_expert_intermediate_size", model_type),
                      shared_expert_gate=True)
    return fields


def _need(config: dict, key: str, model_type: str):
    if config.get(key) is None:
        raise LoongConfigError(f"{model_type} config lacks {key}", f"a {model_type} model needs {key}",
                               f"add {key} to the config.json")
    return config[key]


def spec_from_config(config: dict, name: str) -> ModelSpec:
    """A ``ModelSpec`` from a parsed config.json (a multimodal Gemma3 config: its text part)."""
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        config = {"model_type": "gemma3_text", **config["text_config"]}
        model_type = "gemma3_text"
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise LoongConfigError(f"model config {name!r}: model_type={model_type!r}",
                               f"the estimator reads the families {known}; an unknown family's parameters "
                               "and activations cannot be counted exactly",
                               "pass a config of a supported family, or build a ModelSpec by hand")
    missing = [key for key in REQUIRED if config.get(key) is None]
    if missing:
        raise LoongConfigError(f"model config {name!r} lacks {', '.join(missing)}",
                               f"a {model_type} config.json needs " + ", ".join(REQUIRED),
                               "pass the model's complete config.json")
    tied_default, bias_from, norms, qk_norm, sliding = FAMILIES[model_type]
    layers = config["num_hidden_layers"]
    if bias_from == "qkv":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(config.get(bias_from, False)) if bias_from else False
    local_layers = sliding(config, layers)
    return ModelSpec(
        name=name, hidden=config["hidden_size"], layers=layers, heads=config["num_attention_heads"],
        kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        ffn=config["intermediate_size"], vocab=config["vocab_size"], head_dim=config.get("head_dim") or 0,
        tied_embeddings=bool(config.get("tie_word_embeddings", tied_default)),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(config.get("mlp_bias", False)),
        norms_per_layer=norms, qk_norm=qk_norm,
        sliding_window=(config.get("sliding_window") or 0) if local_layers else 0,
        local_layers=local_layers, **_moe_fields(model_type, config, layers))


def spec_from_hf_config(path: Path) -> ModelSpec:
    config = read_json_object(path, "model config", "a Hugging Face config.json")
    name = path.stem if path.stem != "config" else path.parent.name or "config"
    return spec_from_config(config, name)
