"""What an op of an AOTAutograd or Inductor graph is: the attention op, a collective, a random
op; and a node's FLOPs (by PyTorch's formulas, attention's own)."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

# The attention ops: PyTorch's SDPA kernels (what a single process traces) and 2D-Attention's
# two forward ops, the ring (causal or full) and the masked one (padding, packed documents,
# windows): a layer is found by its attention op, so one missing here leaves its layers to no
# policy.  Looked up by name, so a missing op (loong_compile.ops not imported, a kernel absent
# from this build) is simply not in the set.
ATTENTION_OP_NAMES = (
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "loong.ring_attention_fwd",
    "loong.masked_attention_fwd",
)


def attention_ops() -> frozenset:
    """The OpOverloadPackets that count as "the attention op" (forward, returning out and lse)."""
    found = []
    for name in ATTENTION_OP_NAMES:
        namespace, op = name.split(".")
        try:
            found.append(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


def is_attention(node: torch.fx.Node, ops: frozenset | None = None) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (
        attention_ops() if ops is None else ops)


# Ops that communicate: running one again in the backward would replay the collective (and
# every rank would have to replay it alike).  By name, like the attention ops.
COLLECTIVE_NAMESPACES = ("_c10d_functional",)
COLLECTIVE_OP_NAMES = ("loong.ring_attention_fwd", "loong.ring_attention_bwd",
                       "loong.masked_attention_fwd", "loong.masked_attention_bwd")


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` communicates, or is a result (``getitem``) of an op that does."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return is_collective(node.args[0])
    name = getattr(node.target, "name", None)
    name = name() if callable(name) else ""
    qualified = name.split("::")[0] + "." + name.split("::")[-1].split(".")[0] if "::" in name else ""
    return qualified in COLLECTIVE_OP_NAMES or qualified.split(".")[0] in COLLECTIVE_NAMESPACES


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers (running it again gives other values).  PyTorch's
    attention ops are tagged so for their dropout: without it (``dropout_p`` 0, training LLMs'
    rule) they give the same values again and can be recomputed."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if is_attention(node):
        named = node.normalized_arguments(None, normalize_to_only_use_kwargs=True)
        return named is None or named.kwargs.get("dropout_p", 0.0) != 0.0
    return True


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one node from its fake values: matmuls via PyTorch's flop formulas, attention
    as 2·B·H·Sq·Sk·(D + D_v) (scores, then values; half of it when causal); everything else
    counts as 0."""
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
        return 0
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    if is_attention(node):
        q, k, v = vals[0], vals[1], vals[2]
        named = node.normalized_arguments(None, normalize_to_only_use_kwargs=True)
        named = named.kwargs if named is not None else {}
        b, h, sq, d = q.shape
        # the ring op sees one KV chunk at a time; its queries meet all cp chunks
        flops = 2 * b * h * sq * k.shape[-2] * (d + v.shape[-1]) * named.get("cp", 1)
        return flops // 2 if named.get("is_causal", False) else flops
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        return 0
    kwargs = {k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs.items()}
    try:
        return int(formula(*vals, out_val=node.meta.get("val"), **kwargs))
    except (TypeError, ValueError, AttributeError):
        return 0
