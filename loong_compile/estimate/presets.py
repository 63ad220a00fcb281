"""The models ``loong`` knows by name, and what a ``--model`` argument leads to: a preset, an
alias of one, or a Hugging Face config.json."""

from __future__ import annotations

from pathlib import Path

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.hf_config import spec_from_hf_config
from loong_compile.estimate.models import ModelSpec

# Llama-2-7B / Llama-3.1 from their published config.json files; "7b-mha" and
# "7b-gqa" are LoongTrain's evaluation models (§6.1: LLaMA2-7B with H=32, and H_kv=8 for GQA).
PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    ModelSpec("llama3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    ModelSpec("llama3.1-70b", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    ModelSpec("7b-mha", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    ModelSpec("7b-gqa", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=11008, vocab=32000),
    # one-GPU models (issue 36: benchmarks/longest_sequence.py), from their config.json files
    ModelSpec("llama3.2-1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
              head_dim=64, tied_embeddings=True),
    ModelSpec("llama3.2-3b", hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256,
              head_dim=128, tied_embeddings=True),
    ModelSpec("qwen2.5-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960,
              vocab=151936, tied_embeddings=True, qkv_bias=True),
    ModelSpec("qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944,
              vocab=152064, qkv_bias=True),
)}
ALIASES = {"llama-3.2-1b": "llama3.2-1b", "llama-3.2-3b": "llama3.2-3b",
           "qwen2.5-1.5b-instruct": "qwen2.5-1.5b", "qwen2.5-7b-instruct": "qwen2.5-7b",
           "llama3-8b": "llama3.1-8b", "llama3-70b": "llama3.1-70b", "llama-2-7b": "llama2-7b",
           "llama-3.1-8b": "llama3.1-8b", "llama-3.1-70b": "llama3.1-70b"}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset (case-insensitive; see ``PRESETS`` and ``ALIASES``) or a Hugging Face config.json path."""
    key = name_or_path.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return spec_from_hf_config(path)
    names = ", ".join(sorted(PRESETS) + sorted(ALIASES))
    raise LoongConfigError(f"unknown model {name_or_path!r}", f"a model is one of {names}, "
                           "or the path of a Hugging Face config.json",
                           "pick a preset or pass --model path/to/config.json")
