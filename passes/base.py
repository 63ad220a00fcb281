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

Contracts: each pass class declares ``requires`` and ``provides``, tuples of named *facts*.
A fact is something one pass establishes for later ones: a value it leaves in
``PassContext.state`` under the fact's name (a constant the providing pass's module owns,
e.g. ``activations.ACTIVATION_PLAN``), or a property of the graph it rewrote (e.g.
``attention_2d.ATTENTION_SITES``: every attention call is the 2D-Attention op).  When the
backend assembles the pipeline (after ``disable_passes`` and each pass's ``enabled(config)``)
it checks the schedule: every fact an enabled pass requires must be provided by an enabled
pass running before it (an earlier stage, or earlier in the list at the same stage);
otherwise ``check_contracts`` raises ``LoongConfigError`` naming both passes and the option.
The library's table is in docs/architecture.md ("Pass contracts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch.fx

from loong_compile.errors import LoongConfigError

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
    """Facts one pass leaves for a later one of the same compile (e.g. the activation plan),
    keyed by the fact's name (a constant owned by the providing pass)."""


class GraphPass(Protocol):
    name: ClassVar[str]
    stage: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]    # facts an earlier pass must provide (may be absent: none)
    provides: ClassVar[tuple[str, ...]]    # facts this pass establishes (may be absent: none)

    def enabled(self, config: Any) -> bool:
        """Whether the pass applies under this config (before ``disable_passes``)."""

    def run(self, graph: Any, ctx: PassContext) -> dict[str, Any]:
        """Rewrite ``graph`` in place; return the summary for the report."""


def check_contracts(schedule: Sequence[GraphPass], off: dict[str, str], passes: Sequence[GraphPass]) -> None:
    """Raise ``LoongConfigError`` if a pass of ``schedule`` (the enabled passes, in pipeline
    order) requires a fact no pass before it provides.  ``off`` gives, per pass name left out
    of the schedule, why (``disable_passes`` or not enabled by the config); ``passes`` is
    every pass, to name the one that would have provided the fact."""
    provided: set[str] = set()
    for p in schedule:
        for fact in getattr(p, "requires", ()):
            if fact in provided:
                continue
            providers = [q for q in passes if fact in getattr(q, "provides", ())]
            if not providers:
                raise LoongConfigError(
                    f"pass {p.name!r} requires {fact!r}, which no pass in the pipeline provides",
                    "every fact a pass requires is provided by an earlier enabled pass",
                    f"add a pass that provides {fact!r}, or leave {p.name!r} out of the pipeline")
            provider = providers[0]
            why = off.get(provider.name, f"runs after {p.name!r}")
            if why == "disable_passes":
                fix = (f"remove {provider.name!r} from disable_passes, or add {p.name!r} to it "
                       "or change the option that enables it")
            else:
                fix = (f"change the options so that {provider.name!r} runs before {p.name!r}, "
                       f"or add {p.name!r} to disable_passes")
            raise LoongConfigError(
                f"pass {p.name!r} requires {fact!r}, provided by pass {provider.name!r}, "
                f"which does not run before it ({why})",
                "every fact a pass requires is provided by an earlier enabled pass", fix)
        provided.update(getattr(p, "provides", ()))
