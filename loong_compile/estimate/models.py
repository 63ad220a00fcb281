"""Model shapes the estimator needs, and presets for common Llama models.

Only the numbers that enter the formulas are kept (the 4D-estimator paper's
Table 1: ``h, a, k, h_ffn, L, v``).  ``load_model`` accepts a preset name or
the path of a Hugging Face ``config.json``; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from loong_compile.errors import LoongConfigError


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, GQA, untied embedding / LM head).

    hidden (h), heads (a), kv_heads (k), ffn (h_ffn), layers (L), vocab (v).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoongConfigError(f"model {self.name!r}: {field}={value!r}",
                                       f"{field} must be a positive integer",
                                       f"fix {field} in the model config")
        if self.hidden % self.heads:
            raise LoongConfigError(f"model {self.name!r}: hidden={self.hidden} with heads={self.heads}",
                                   "hidden must be a multiple of heads",
                                   "fix hidden_size or num_attention_heads")
        if self.heads % self.kv_heads:
            raise LoongConfigError(f"model {self.name!r}: heads={self.heads}, kv_heads={self.kv_heads}",
                                   "heads must be a multiple of kv_heads (GQA groups)",
                                   "fix num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Llama-2-7B / Llama-3.1 from their published config.json files; "7b-mha" and
# "7b-gqa" are LoongTrain's evaluation models (§6.1: LLaMA2-7B with H=32, and H_kv=8 for GQA).
PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    ModelSpec("llama3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    ModelSpec("llama3.1-70b", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    ModelSpec("7b-mha", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    ModelSpec("7b-gqa", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=11008, vocab=32000),
)}
ALIASES = {"llama3-8b": "llama3.1-8b", "llama3-70b": "llama3.1-70b", "llama-2-7b": "llama2-7b",
           "llama-3.1-8b": "llama3.1-8b", "llama-3.1-70b": "llama3.1-70b"}

# Hugging Face LlamaConfig keys -> ModelSpec fields.
_HF_KEYS = {"hidden_size": "hidden", "num_hidden_layers": "layers",
            "num_attention_heads": "heads", "intermediate_size": "ffn", "vocab_size": "vocab"}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset (case-insensitive; see ``PRESETS`` and ``ALIASES``) or a Hugging Face config.json path."""
    key = name_or_path.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return _from_hf_config(path)
    names = ", ".join(sorted(PRESETS) + sorted(ALIASES))
    raise LoongConfigError(f"unknown model {name_or_path!r}", f"a model is one of {names}, "
                           "or the path of a Hugging Face config.json",
                           "pick a preset or pass --model path/to/config.json")


def _from_hf_config(path: Path) -> ModelSpec:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoongConfigError(f"model config {str(path)!r} does not exist", None,
                               "pass the path of an existing config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LoongConfigError(f"model config {str(path)!r} is not readable JSON ({exc})", None,
                               "pass a Hugging Face config.json") from None
    missing = [key for key in _HF_KEYS if key not in config]
    if missing:
        raise LoongConfigError(f"model config {str(path)!r} lacks {', '.join(missing)}",
                               "a Llama config.json needs " + ", ".join(_HF_KEYS),
                               "pass a LlamaConfig-style config.json")
    fields = {field: config[key] for key, field in _HF_KEYS.items()}
    fields["kv_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    return ModelSpec(name=path.stem if path.stem != "config" else path.parent.name or "config",
                     **fields)
