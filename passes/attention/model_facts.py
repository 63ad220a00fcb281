"""What the model decided from the sequence length before Dynamo saw a tensor.

Model code reads the length of the tokens it is given, and under hp*cp > 1 that is a rank's
local share.  Some decisions never reach the graph: transformers skips a sliding-window mask
when the (local) length fits the window and emits ``is_causal=True`` instead, and a
``dynamic`` / ``longrope`` RoPE picks its frequencies from the (local) length.  This module
reads those settings from the modules Dynamo traced (``compiled_module``, ``module_of``) so
the attention pass can compare them with the *global* length and refuse what differs.
"""

from __future__ import annotations

from typing import Any

import torch

from loong_compile._compat.dynamo import dynamo_frame_self, frame_root
from loong_compile.passes.fx_util import module_path_parts
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def compiled_module(gm: torch.fx.GraphModule) -> torch.nn.Module | None:
    """The model whose code Dynamo traced: the compiled frame's ``self``, else the module its
    module paths start from (a step function's ``model``, or transformers 5.24's ``forward``
    wrapper, whose frame holds the model as ``args[0]``); None for a plain function."""
    frame_self = dynamo_frame_self()
    if frame_self is not None:
        return frame_self
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            root = frame_root(str(path))
            if isinstance(root, torch.nn.Module):
                return root
    return None


def traced_in(node: torch.fx.Node) -> str | None:
    """The path of the innermost module a node was traced in, or None outside every one."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else None


def module_of(root: torch.nn.Module | None, node: torch.fx.Node) -> torch.nn.Module | None:
    """The innermost module a node was traced in, walked along its module path from the
    path's root in the compiled frame (whatever Dynamo named it: ``L['self']``,
    ``L['args'][0]``, ``G['model']``) or else from ``root``; ``root`` itself for code outside
    every submodule; None where the path leads nowhere."""
    path = traced_in(node)
    if path is None:
        return root
    # the path's own root first: a step function may call more than one module
    start = frame_root(path)
    module: Any = start if isinstance(start, torch.nn.Module) else root
    if module is None:
        return None
    for name in module_path_parts(path):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module if isinstance(module, torch.nn.Module) else None


def sliding_window(attention: torch.nn.Module | None, root: torch.nn.Module | None) -> int | None:
    """The sliding window (tokens back, including the query) an attention module applies, or None.

    transformers keeps it on the attention module (``self.sliding_window``: Qwen2/3, Gemma2/3,
    None on full-attention layers) or only in the config (Mistral, Mixtral, Phi3, Starcoder2).
    """
    if attention is not None and hasattr(attention, "sliding_window"):
        return _positive_int(attention.sliding_window)
    config = getattr(attention, "config", None) or getattr(root, "config", None)
    if config is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(attention, "layer_idx", None)
    if layer_types and isinstance(layer, int) and layer < len(layer_types) \
            and layer_types[layer] != "sliding_attention":
        return None
    return _positive_int(getattr(config, "sliding_window", None))


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
