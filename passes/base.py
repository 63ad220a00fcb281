"""The pass contract: what every graph transformation of loong_compile looks like.

A pass is an object with a ``name``, the ``stage`` it runs at and
``run(graph, ctx) -> summary``.  The backend calls it at its stage, times it and
records the summary in the report.  ``summary`` is a JSON-able dict; by
convention it carries ``matched`` (what the pass looked for and found),
``changed`` (what it rewrote) and any numbers behind its decisions.

Stages, in pipeline order (see docs/architecture.md):

=========  ==========================================  =========================
stage      graph handed to ``run``                     lowerings that run it
=========  ==========================================  =========================
dynamo     the Dynamo FX graph (torch IR)              all
joint      AOTAutograd's joint forward+backward graph  inductor, aot_eager
split      ``SplitGraphs``: forward and backward        inductor, aot_eager
           graphs right after the partition, and the
           values saved between them
post_grad  Inductor's post-grad ``torch.fx.Graph``      inductor
           (forward and backward separately)
inductor   ``_compat.PoolRequest``: one compiled       inductor
           graph's intermediate buffers, their live
           ranges and the bytes held beside them,
           inside Inductor's wrapper codegen
=========  ==========================================  =========================
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import torch.fx

STAGES = ("dynamo", "joint", "split", "post_grad", "inductor")


@dataclasses.dataclass
class SplitGraphs:
    """Forward and backward graphs as the partitioner produced them.

    The forward's outputs end with the values saved for backward; the
    backward's placeholders start with them (AOTAutograd's convention).
    Passes may rewrite both graphs, keeping that correspondence.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    num_fwd_outputs: int

    def saved_values(self) -> list[torch.fx.Node]:
        """The forward-graph nodes whose values are saved for the backward."""
        outputs = self.forward.graph.find_nodes(op="output")[0].args[0]
        return [n for n in outputs[self.num_fwd_outputs:] if isinstance(n, torch.fx.Node)]


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the graph: the config, the mesh, where it runs."""

    config: Any                   # LoongConfig
    mesh: Any = None              # LoongMesh, or None in a single process
    rank: int = 0
    graph_id: int = 0
    graph_kind: str = "forward"   # forward | backward | joint | inference | split
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Facts one pass leaves for a later one of the same compile (e.g. the attention nodes it
    rewrote), keyed by the producing pass's name."""


class GraphPass(Protocol):
    name: ClassVar[str]
    stage: ClassVar[str]

    def enabled(self, config: Any) -> bool:
        """Whether the pass applies under this config (before ``disable_passes``)."""

    def run(self, graph: Any, ctx: PassContext) -> dict[str, Any]:
        """Rewrite ``graph`` in place; return the summary for the report."""
