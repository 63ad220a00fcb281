"""Selective Checkpoint++ (LoongTrain §5.2): the recompute policy of the joint graph.

Stage ``joint`` (AOTAutograd's joint graph, right before the min-cut partition), every policy.

Tags forward nodes with PyTorch's standard ``node.meta["recompute"] = CheckpointPolicy``,
which the min-cut partitioner honours:

- every policy but ``full`` / ``full_offload``: the attention op and its outputs (out, lse) are
  MUST_SAVE, so the attention (the distributed ring, once rewritten) is never recomputed in the
  backward;
- ``sc++``: each transformer layer's input, and each layer value that code outside every
  layer reads (the last layer's output, read by the final norm), are MUST_SAVE; every other
  node inside a layer is PREFER_RECOMPUTE: the backward recomputes the layer from its input
  and the saved attention outputs.  Random ops stay MUST_SAVE (recomputing one would draw
  new numbers);
- ``memo``: layer inputs MUST_SAVE too (the offload and token-slice recompute start from
  them); the rest is left to the partition and rewritten by ``recompute`` / ``offload``;
- ``full`` / ``full_offload``: as ``sc++``, but the attention is recomputed too: a layer keeps
  its input alone (``full_offload``: on the host, by ``offload``).  The recomputed attention
  runs its collectives again in the backward, in the same order on every rank (one graph);
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


# The policies that recompute each layer from what they save (the others leave it to the
# partition), and of them those that recompute its attention too
CHECKPOINTED = ("sc++", "full", "full_offload")
ATTENTION_RECOMPUTED = ("full", "full_offload")


class SelectiveCheckpointPass(Pass):
    name, stage = "selective_checkpoint", "joint"

    def run(self, joint: torch.fx.GraphModule, ctx: Any) -> dict[str, Any]:
        graph = joint.graph
        backward = tangent_dependent(graph)
        layers = find_layers(graph, is_forward=lambda n: n not in backward)
        policy = ctx.config.activations
        must_save: list[torch.fx.Node] = []
        attention = [n for n in graph.nodes if n not in backward and is_attention(n)]
        checkpointed = policy in CHECKPOINTED
        if policy not in ATTENTION_RECOMPUTED:
            for node in attention:
                must_save += [node, *getitem_users(node)]
        if policy != "none":
            must_save += [n for ns in layers.inputs.values() for n in ns]
        if checkpointed:
            must_save += sorted(layers.leaving, key=lambda n: n.name)
            must_save += [m for n in layers.node_layer if is_random(n) for m in (n, *getitem_users(n))]
        saved = set(must_save)
        recompute = [n for n in layers.node_layer if n not in saved] if checkpointed else []
        for node in recompute:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        if policy in ATTENTION_RECOMPUTED:   # not a preference: their outputs are not saved
            for node in attention:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        for node in saved:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        return {
            "matched": {"attention": [n.name for n in attention], "layers": layers.names},
            "changed": {"must_save": len(saved), "prefer_recompute": len(recompute)},
            "layer_inputs": {layers.names[i]: [n.name for n in ns] for i, ns in layers.inputs.items()},
        }
