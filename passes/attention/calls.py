"""The attention call a site makes, read alike from its three forms, and the refusal that names it.

The forms: ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
enable_gqa)``, ``ops.attention.sinks.sdpa_with_sinks`` (``eager_attention``'s form of gpt-oss's chain: one
sink logit per head) and flash-attn's ``flash_attn_func`` as Dynamo traces it (``flash_match``).
What a call asks that 2D-Attention cannot give is refused here: flash-attn's window, softcap,
ALiBi slopes or probabilities, a live dropout, settings that are not constants.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile.errors import LoongUnsupportedError
from loong_compile.ops.attention.sinks import sdpa_with_sinks
from loong_compile.passes.attention.flash_match import FlashAttnCall, match_flash_attn
from loong_compile.passes.attention.kv_repeat import shape
from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.nodes import example_value

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
                sdpa_with_sinks)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False, "sinks": None}
SINKS_PARAMS = ("query", "key", "value", "sinks", "attn_mask", "scale")
# flash_attn_func's settings 2D-Attention does not apply, at their defaults
FLASH_EXTRAS = {"window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None,
                "return_attn_probs": False}


@dataclasses.dataclass
class AttentionCall:
    """One call's operands and settings, as SDPA names them; ``flash``: flash-attn's, whose
    tensors are (B, S, H, D) and whose output is item 0 of a tuple."""

    node: torch.fx.Node
    q: Any
    k: Any
    v: Any
    causal: Any
    scale: Any
    dropout_p: Any
    enable_gqa: Any
    attn_mask: Any = None
    sinks: Any = None
    flash: bool = False

    @property
    def tokens(self) -> int | None:
        """This rank's tokens (the queries' sequence axis); None for a dynamic length (reading it
        would add a guard)."""
        size = shape(self.q)[1 if self.flash else 2]
        return size if isinstance(size, int) else None


def is_site(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an attention call of one of the three forms."""
    return node.op == "call_function" and (node.target in SDPA_TARGETS
                                           or match_flash_attn(node) is not None)


def masked(node: torch.fx.Node) -> bool:
    """Whether an SDPA call (not flash-attn's, which takes no mask) has an ``attn_mask`` node."""
    return node.target in SDPA_TARGETS and isinstance(_bind(node)["attn_mask"], torch.fx.Node)


def read_call(node: torch.fx.Node) -> AttentionCall:
    """The call ``node`` makes; refused for flash-attn's settings 2D-Attention does not apply."""
    flash = match_flash_attn(node)
    if flash is not None:
        _refuse_flash_extras(node, flash)
        return AttentionCall(node, flash.q, flash.k, flash.v, flash.causal, flash.softmax_scale,
                             flash.dropout_p, enable_gqa=True, flash=True)
    args = _bind(node)
    return AttentionCall(node, args["query"], args["key"], args["value"], args["is_causal"],
                         args["scale"], args["dropout_p"], args["enable_gqa"], args["attn_mask"],
                         args["sinks"])


def constant_settings(call: AttentionCall, causal: Any) -> tuple[Any, bool]:
    """``(scale, specialised)`` once the call's settings are proven ones 2D-Attention applies:
    no dropout, ``causal`` (the mask's when it has one) and the scale constants.

    A model's ``scaling`` is a Python float; when a second model runs the same attention code
    with another one (transformers' shared ``sdpa_attention_forward``), Dynamo's automatic
    dynamic recompiles with the float as a symbol.  Still one number per call: reading its
    value (``specialised``) adds a guard on it, so another value compiles anew instead of
    reusing this graph."""
    if not (isinstance(call.dropout_p, (int, float)) and call.dropout_p == 0):
        refuse(call.node, f"dropout_p={call.dropout_p!r}; attention dropout over a sharded "
                          "sequence would not equal one process's",
               "set the attention dropout to 0 (e.g. attention_dropout=0.0 in the model config)")
    scale, specialised = call.scale, False
    value = example_value(scale)
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        scale, specialised = float(value), True
    if not isinstance(causal, bool) or not (scale is None or isinstance(scale, (int, float))):
        refuse(call.node, f"is_causal={causal!r} / scale={scale!r} are not constants",
               "pass Python bool/float values")
    return scale, specialised


def refuse(node: torch.fx.Node, reason: str, fix: str, error=LoongUnsupportedError) -> NoReturn:
    raise error(
        f"attention call {node.name} at {source_line(node)} (module {module_path(node)})",
        f"it cannot be distributed exactly: {reason}", fix)


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    bound = dict(SDPA_DEFAULTS)
    bound.update(zip(SINKS_PARAMS if node.target is sdpa_with_sinks else SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _refuse_flash_extras(node: torch.fx.Node, call: FlashAttnCall) -> None:
    settings = {"window_size": tuple(call.window_size), "softcap": call.softcap,
                "alibi_slopes": call.alibi_slopes, "return_attn_probs": call.reads_attn_probs}
    for key, value in settings.items():
        if value != FLASH_EXTRAS[key]:
            refuse(node, f"flash_attn_func's {key}={value!r} is not supported by 2D-Attention",
                   f"leave {key} at its default {FLASH_EXTRAS[key]!r}")
