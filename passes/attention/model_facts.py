"""What the model decided from the sequence length before Dynamo saw a tensor.

Model code reads the length of the tokens it is given, and under hp*cp > 1 that is a rank's
local share.  Some decisions never reach the graph: transformers skips a sliding-window mask
when the (local) length fits the window and emits ``is_causal=True`` instead, and a
``dynamic`` / ``longrope`` RoPE picks its frequencies from the (local) length.  This module
reads those settings from the modules Dynamo traced (``passes/fx/traced_modules.py``) so the
attention pass can compare them with the *global* length and refuse what differs.
"""

from __future__ import annotations

from typing import Any

import torch


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnknownLayerType(ValueError):
    """A layer whose attention type is none of full, sliding-window and chunked attention."""


FULL_LAYER, WINDOWED_LAYER, CHUNKED_LAYER = "full_attention", "sliding_attention", "chunked_attention"


def layer_type(attention: torch.nn.Module | None, config: Any) -> str | None:
    """The layer's attention type as the model picks its mask (``full_attention`` or
    ``sliding_attention``), or None where the model has no per-layer types.

    transformers picks each layer's mask by ``config.layer_types[layer_idx]``; a module's own
    ``sliding_window`` does not say it (Exaone4 keeps the config's window on its full-attention
    layers too, beside ``is_sliding``).
    """
    types, index = getattr(config, "layer_types", None), getattr(attention, "layer_idx", None)
    if types and isinstance(index, int) and 0 <= index < len(types):
        return str(types[index])
    own = getattr(attention, "layer_type", None)
    if isinstance(own, str):
        return own
    sliding = getattr(attention, "is_sliding", None)
    if isinstance(sliding, bool):
        return WINDOWED_LAYER if sliding else FULL_LAYER
    return None


def sliding_window(attention: torch.nn.Module | None, root: torch.nn.Module | None) -> int | None:
    """The sliding window (tokens back, including the query) an attention module applies, or None.

    The layer's type decides whether it has one (``layer_type``); the window is the module's
    ``sliding_window`` (Qwen2/3, Gemma2/3, Exaone4) or the config's (Mistral, Mixtral, Phi3,
    Starcoder2, which keep it only there).  Raises ``UnknownLayerType`` for another type.
    """
    config = getattr(attention, "config", None) or getattr(root, "config", None)
    kind = layer_type(attention, config)
    if kind in (FULL_LAYER, CHUNKED_LAYER):
        return None
    if kind not in (None, WINDOWED_LAYER):
        if _no_window_or_chunk_anywhere(attention, config):
            return None     # Falcon-H1's "hybrid" layers: full attention beside a Mamba-2 mixer
        raise UnknownLayerType(kind)
    if attention is not None and hasattr(attention, "sliding_window"):
        return _positive_int(attention.sliding_window) or (
            _positive_int(getattr(config, "sliding_window", None)) if kind == WINDOWED_LAYER else None)
    if config is None or (kind is None and getattr(config, "use_sliding_window", True) is False):
        return None
    return _positive_int(getattr(config, "sliding_window", None))


def _no_window_or_chunk_anywhere(attention: torch.nn.Module | None, config: Any) -> bool:
    """Neither the module nor its config keeps a window or a chunk size: whatever its layer type
    is called, the layer can mask nothing but causally (its mask, where the graph has one, is
    proven from the graph as every mask is)."""
    places = (attention, config)
    return not any(getattr(p, name, None) for p in places
                   for name in ("sliding_window", "attention_chunk_size"))


def chunk_size(attention: torch.nn.Module | None, root: torch.nn.Module | None) -> int | None:
    """The block of tokens a chunked-attention layer (Llama 4: ``layer_types`` entry
    ``chunked_attention``) keeps its queries in: the config's ``attention_chunk_size``; None for
    any other layer."""
    config = getattr(attention, "config", None) or getattr(root, "config", None)
    if layer_type(attention, config) != CHUNKED_LAYER:
        return None
    return _positive_int(getattr(config, "attention_chunk_size", None))


def length_dependent_rope(root: torch.nn.Module | None) -> tuple[str, int] | None:
    """``(rope_type, threshold)`` when the model's RoPE changes with the sequence length, or None."""
    config = getattr(root, "config", None)
    if config is None:
        return None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return None
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type not in LENGTH_DEPENDENT_ROPE:
        return None
    threshold = (params.get("original_max_position_embeddings")
                 or getattr(config, "original_max_position_embeddings", None)
                 or getattr(config, "max_position_embeddings", None))
    return rope_type, int(threshold) if threshold else 0


def _positive_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
