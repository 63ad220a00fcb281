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
schedule   ``ScheduleRequest``: Inductor's scheduler   inductor
           nodes of one graph, before fusion; passes
           set their order and ordering-only holds
inductor   ``memory_plan.request.PoolRequest``: one    inductor
           compiled graph's intermediate buffers,
           their live ranges and the bytes held
           beside them, in Inductor's wrapper codegen
=========  ==========================================  =========================

Contracts: each pass class declares ``requires`` and ``provides``, tuples of named *facts*
(and ``uses``: facts it reads when a running pass provides them, as long as that pass runs
before it).
A fact is something one pass establishes for later ones: a value it leaves in
``PassContext.state`` under the fact's name (a constant the providing pass's module owns,
e.g. ``activations.ACTIVATION_PLAN``; this module's when passes of several stage folders name
it, e.g. ``ATTENTION_SITES``), or a property of the graph it rewrote.  When the
backend assembles the pipeline (after ``disable_passes`` and each pass's ``enabled(config)``)
it checks the schedule: every fact an enabled pass requires must be provided by an enabled
pass running before it (an earlier stage, or earlier in the list at the same stage);
otherwise ``check_contracts`` raises ``LoongConfigError`` naming both passes and the option.
The library's table is in docs/architecture.md ("Pass contracts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import torch.fx

from loong_compile.config import LoongConfig
from loong_compile.errors import LoongConfigError

STAGES = ("dynamo", "joint", "split", "post_grad", "schedule", "inductor")

# The facts of the rewrites that combine tokens across ranks.  Each names the graph's property
# (every attention call is 2D-Attention; the scans' matched calls are their exact ops) and
# leaves in ``PassContext.state`` the ops its rewrites emit (``add_exact_mixers``), which the
# token analysis lets combine a rank's tokens (``exact_mixers``).
ATTENTION_SITES = "attention_sites"
SCAN_SITES = "scan_sites"
# The graph inputs the attention pass found to be positions ({input index: how}): the backend's
# input check compares them with the layout, and the scans read their documents from them.
POSITION_INPUTS = "position_inputs"


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


class ScheduleItem(NamedTuple):
    """One of Inductor's scheduler nodes, in Inductor's order: ``kind`` is "start" (a
    collective), "wait" (its wait), "nop" or "kernel"; ``op`` the fallback op's qualified name
    ("" for generated kernels); ``inputs`` the positions of the nodes it depends on."""

    name: str
    kind: str
    op: str
    inputs: tuple[int, ...]


@dataclasses.dataclass
class ScheduleRequest:
    """The graph of the ``schedule`` stage: one compiled graph's scheduler nodes before fusion.
    Passes rewrite ``order`` (positions into ``items``) and add ``holds`` ``(node, other)``:
    ``node`` runs after ``other``, an ordering-only dependency fusion respects."""

    items: list[ScheduleItem]
    order: list[int] = dataclasses.field(default_factory=list)
    holds: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.items = [ScheduleItem(*item) for item in self.items]
        self.order = self.order or list(range(len(self.items)))

    def __str__(self) -> str:
        held: dict[int, list[int]] = {}
        for node, other in self.holds:
            held.setdefault(node, []).append(other)
        lines = [f"{p:5d} {self.items[p].name} {self.items[p].kind} {self.items[p].op}"
                 f" <- {list(self.items[p].inputs)}"
                 + (f" after {[self.items[o].name for o in held[p]]}" if p in held else "")
                 for p in self.order]
        return "\n".join(lines)


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the graph: the config, the mesh, where it runs."""

    config: LoongConfig
    mesh: Any = None              # LoongMesh, or None in a single process
    rank: int = 0
    graph_id: int = 0
    graph_kind: str = "forward"   # forward | backward | joint | inference | split
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Facts one pass leaves for a later one of the same compile (e.g. the activation plan),
    keyed by the fact's name (a constant owned by the providing pass)."""


def add_exact_mixers(ctx: PassContext, fact: str, ops: Sequence[Any]) -> None:
    """Leave ``ops`` under ``fact``: ops a rewrite emits that combine a rank's tokens with the
    other ranks' exactly."""
    ctx.state[fact] = ctx.state.get(fact, frozenset()) | frozenset(ops)


def exact_mixers(ctx: PassContext) -> frozenset:
    """The ops the rewrites that ran so far declared exact (``add_exact_mixers``)."""
    return frozenset().union(*(ctx.state.get(fact, ()) for fact in (ATTENTION_SITES, SCAN_SITES)))


class GraphPass(Protocol):
    name: ClassVar[str]
    stage: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]    # facts an earlier pass must provide
    provides: ClassVar[tuple[str, ...]]    # facts this pass establishes
    uses: ClassVar[tuple[str, ...]]        # facts read if a running pass provides them

    def enabled(self, config: LoongConfig) -> bool:
        """Whether the pass applies under this config (before ``disable_passes``)."""

    def run(self, graph: Any, ctx: PassContext) -> dict[str, Any]:
        """Rewrite ``graph`` in place; return the summary for the report."""


class Pass:
    """The base of the library's passes: the defaults of ``GraphPass`` (no facts required,
    provided or used; enabled under every config).  A subclass sets ``name`` and ``stage``,
    overrides what differs and implements ``run``."""

    name: ClassVar[str]
    stage: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    uses: ClassVar[tuple[str, ...]] = ()

    def enabled(self, config: LoongConfig) -> bool:
        return True

    def run(self, graph: Any, ctx: PassContext) -> dict[str, Any]:
        raise NotImplementedError


class ShardedPass(Pass):
    """A pass for a sequence split over ranks: enabled when ``hp * cp > 1`` (a rank then holds
    only its tokens, which is what these passes make exact or refuse)."""

    def enabled(self, config: LoongConfig) -> bool:
        return config.sp > 1


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
        for fact in getattr(p, "uses", ()):
            late = [q.name for q in schedule[schedule.index(p) + 1:] if fact in getattr(q, "provides", ())]
            if late and fact not in provided:
                raise LoongConfigError(
                    f"pass {p.name!r} reads {fact!r}, provided by pass {late[0]!r}, which runs after it",
                    "a fact a pass reads is provided before it, or not at all",
                    f"run {late[0]!r} before {p.name!r} (its stage or its place in the pass list)")
        provided.update(getattr(p, "provides", ()))
