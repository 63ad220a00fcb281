"""Model specs from Hugging Face config.json files: parameter counts equal what transformers builds
from the same config (instantiated on the meta device), MoE / sliding-window facts, refusals."""

import json
from pathlib import Path

import pytest
import torch

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.hf_config import spec_from_config
from loong_compile.estimate.presets import load_model

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
PUBLISHED = sorted(DATA.glob("*.json"))

# Small configs of the families' other switches: biases, shared experts, dense layers inside
# an MoE, alternating local/global layers.
SYNTHETIC = {
    "llama-biases": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100,
                     "attention_bias": True, "mlp_bias": True, "head_dim": 32},
    "qwen2-moe-shared": {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                         "vocab_size": 100, "num_experts": 6, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                         "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    "qwen3-moe-dense-first": {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3,
                              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24,
                              "intermediate_size": 80, "vocab_size": 100, "num_experts": 4,
                              "num_experts_per_tok": 1, "moe_intermediate_size": 16, "mlp_only_layers": [0],
                              "tie_word_embeddings": True},
    "gemma2-alternating": {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 4,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                           "intermediate_size": 96, "vocab_size": 100, "sliding_window": 8},
}


def transformers_parameters(config: dict) -> int:
    fields = dict(config)
    model_type = fields.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return model.num_parameters()     # tied parameters once


def test_the_published_configs_are_all_there():
    names = {p.stem for p in PUBLISHED}
    assert names == {"llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "gemma3-4b-text", "mistral-7b",
                     "mixtral-8x7b", "phi-3-mini-4k", "olmo2-7b"}


@pytest.mark.parametrize("path", PUBLISHED, ids=[p.stem for p in PUBLISHED])
def test_parameter_count_equals_transformers(path):
    spec = load_model(str(path))
    assert spec.parameters == transformers_parameters(json.loads(path.read_text()))


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_parameter_count_equals_transformers_for_family_switches(name):
    assert spec_from_config(SYNTHETIC[name], name).parameters == transformers_parameters(SYNTHETIC[name])


def test_the_issue_cases():
    """Mixtral is 46.7 B, not a dense 7.2 B; Qwen3-0.6B and Gemma3-4B honour head_dim and tie once."""
    mixtral = load_model(str(DATA / "mixtral-8x7b.json"))
    assert round(mixtral.parameters / 1e9, 1) == 46.7
    # 2 of 8 experts per token: about 12.9 B parameters touched per token
    active = mixtral.layers * mixtral.activated_layer_params + 2 * mixtral.vocab * mixtral.hidden
    assert round(active / 1e9, 1) == 12.9
    assert round(load_model(str(DATA / "qwen3-0.6b.json")).parameters / 1e9, 3) == 0.596
    assert round(load_model(str(DATA / "gemma3-4b-text.json")).parameters / 1e9, 2) == 3.88


def test_sliding_windows():
    gemma = load_model(str(DATA / "gemma3-4b-text.json"))
    assert (gemma.sliding_window, gemma.local_layers) == (1024, 34 - 34 // 6)   # 5 local : 1 global
    seq = 131072
    full = seq * seq / 2
    local = 1024 * 1024 / 2 + (seq - 1024) * 1024
    assert gemma.attended_pairs(seq) == pytest.approx((29 * local + 5 * full) / 34, rel=1e-12)
    assert load_model("llama3.1-8b").attended_pairs(seq) == full
    assert load_model(str(DATA / "qwen3-8b.json")).local_layers == 0    # use_sliding_window false


def test_gemma3_multimodal_config_reads_its_text_part():
    text = json.loads((DATA / "gemma3-4b-text.json").read_text())
    spec = spec_from_config({"model_type": "gemma3", "text_config": text}, "gemma3-4b")
    assert spec.parameters == load_model(str(DATA / "gemma3-4b-text.json")).parameters


@pytest.mark.parametrize("config,named", [
    ({"model_type": "falcon", "hidden_size": 64}, "model_type='falcon'"),
    ({"hidden_size": 64}, "model_type=None"),
    ({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}, "lacks num_attention_heads"),
    ({**SYNTHETIC["qwen2-moe-shared"], "shared_expert_intermediate_size": None},
     "lacks shared_expert_intermediate_size"),
])
def test_unknown_or_incomplete_configs_are_refused(config, named):
    with pytest.raises(LoongConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        spec_from_config(config, "x")


def test_unreadable_config_files_name_the_file(tmp_path):
    with pytest.raises(LoongConfigError, match="model config .*missing.json' does not exist"):
        load_model(str(tmp_path / "missing.json"))
    listed = tmp_path / "listed.json"
    listed.write_text("[1, 2]")
    with pytest.raises(LoongConfigError, match="holds list"):
        load_model(str(listed))
