"""Selective Checkpoint++ (LoongTrain §5.2): the recompute policy of the joint graph.

Stage ``joint`` (AOTAutograd's joint graph, right before the min-cut partition), every policy.

Tags forward nodes with PyTorch's standard ``node.meta["recompute"] = CheckpointPolicy``,
which the min-cut partitioner honours:

- every policy: the attention op and its outputs (out, lse) are MUST_SAVE, so the attention
  (the distributed ring, once rewritten) is never recomputed in the backward;
- ``sc++``: each transformer layer's input, and each layer value that code outside every
  layer reads (the last layer's output, read by the final norm), are MUST_SAVE; every other
  node inside a layer is PREFER_RECOMPUTE: the backward recomputes the layer from its input
  and the saved attention outputs.  Random ops stay MUST_SAVE (recomputing one would draw
  new numbers);
- ``memo``: layer inputs MUST_SAVE too (the offload and token-slice recompute start from
  them); the rest is left to the partition and rewritten by ``recompute`` / ``offload``;
- ``none``: nothing else.

Emits: only tags.  Summary: the attention nodes found, how many nodes got each tag.
"""

from __future__ import annotations

from typing import Any

import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from loong_compile.passes.fx.aten_ops import is_attention, is_random
from loong_compile.passes.fx.nodes import getitem_users
from loong_compile.passes.fx.walks import tangent_dependent
from loong_compile.passes.activations.layers import find_layers
from loong_compile.passes.base import Pass


class SelectiveCheckpointPass(Pass):
    name, stage = "selective_checkpoint", "joint"

    def run(self, joint: torch.fx.GraphModule, ctx: Any) -> dict[str, Any]:
        graph = joint.graph
        backward = tangent_dependent(graph)
        layers = find_layers(graph, is_forward=lambda n: n not in backward)
        policy = ctx.config.activations
        must_save: list[torch.fx.Node] = []
        attention = [n for n in graph.nodes if n not in backward and is_attention(n)]
        for node in attention:
            must_save += [node, *getitem_users(node)]
        if policy in ("sc++", "memo"):
            must_save += [n for ns in layers.inputs.values() for n in ns]
        if policy == "sc++":
            must_save += sorted(layers.leaving, key=lambda n: n.name)
            must_save += [m for n in layers.node_layer if is_random(n) for m in (n, *getitem_users(n))]
        saved = set(must_save)
        recompute = [n for n in layers.node_layer if n not in saved] if policy == "sc++" else []
        for node in recompute:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        for node in saved:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        return {
            "matched": {"attention": [n.name for n in attention], "layers": layers.names},
            "changed": {"must_save": len(saved), "prefer_recompute": len(recompute)},
            "layer_inputs": {layers.names[i]: [n.name for n in ns] for i, ns in layers.inputs.items()},
        }
