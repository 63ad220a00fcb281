"""Whether a graph receives anything of the batch it runs on (read by the backend for the
blind-graph input check, ``loong_compile/checks/blocks.py``).

A block compiled on its own holds attention but takes only hidden states and RoPE's tables:
nothing in it tells the batch's documents or padding.  A graph sees the batch when it holds the
document ids of a mask the attention pass proved (``sequence_document_ids``), makes its own
positions (``made_positions``), or embeds token ids (an integer input reaching an embedding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx

from loong_compile.ops import attention_2d, sequence_document_ids
from loong_compile.passes.fx.nodes import example_value, is_weight, op_name
from loong_compile.passes.fx.op_sets import COPIES, DTYPE_CASTS, EXPANDS, INT_CASTS, RESHAPES
from loong_compile.passes.fx.walks import ancestors

# what an index passes through on its way into an embedding (GPT-2 views its ids first)
_KEEPS_INDEX = COPIES | DTYPE_CASTS | INT_CASTS | RESHAPES | EXPANDS | {"getitem"}


def blind_to_the_batch(gm: torch.fx.GraphModule, made_positions: Sequence[int]) -> bool:
    """Whether ``gm`` (after the dynamo stage) holds attention and nothing that tells it the
    batch: no document ids of a proven mask, no positions it makes, no token ids it embeds."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    targets = {n.target for graph in graphs for n in graph.nodes if n.op == "call_function"}
    return (attention_2d in targets and sequence_document_ids not in targets
            and not made_positions and not any(_embeds(n) for n in gm.graph.find_nodes(
                op="placeholder")))


def _embeds(placeholder: torch.fx.Node) -> bool:
    """Whether an integer graph input (not a weight) reaches an embedding as its index."""
    value = example_value(placeholder)
    if (is_weight(placeholder) or not isinstance(value, torch.Tensor)
            or value.dtype.is_floating_point or value.dtype == torch.bool):
        return False
    # ``ancestors`` walked forward: through the ops that keep the index, up to an embedding
    reached = ancestors([placeholder], inputs=lambda node: [
        user for user in node.users if user.op in ("call_function", "call_method")
        and op_name(user) in _KEEPS_INDEX | {"embedding"}])
    return any(node.op != "placeholder" and op_name(node) == "embedding" for node in reached)
