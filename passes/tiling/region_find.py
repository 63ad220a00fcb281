"""Which nodes of a Dynamo graph a tiled region is: a token-local bulge.

A *local* node is one the token analysis (``passes/fx/token_analysis.py``) proves acts on each
token alone: it reads token data, has no finding, is no sum over tokens (``partial``), no exact
mixer (attention, a scan), no higher-order op, no loong op, draws no random numbers, and writes
in place only into a tensor the region made.

The *closure* of a token value ``v`` (the entry) is what ``v`` alone computes: each local node
all of whose token inputs are ``v`` or already in the closure (and token-shaped constants with no
inputs, copied in), in graph order, until the data that grew wider than ``v`` (a bulge: an
MLP's gate and up projections) is back to ``v``'s width or less (its down projection, an
experts' weighted sum): such a node *closes* its path, nothing after it joins.  Weights and
other values without tokens are read from outside.

A closure *qualifies* as a region when it holds a bulge, every value it hands out (its *exits*)
is a floating tensor with tokens no wider than ``v``, and its *interior* (the values that live
only inside it: what tiling frees) takes more bytes than ``v`` and the exits.  The MLP of any
family qualifies, from the norm before it (SwiGLU, GeGLU, GELU with a bias, a mixture of
experts on the rank's tokens); attention's projections do not (their outputs are wider than their
input, or no wider inside).  Of overlapping regions the one with the narrowest entry is kept
(transformers' RMSNorm upcasts to float32 before its weight: the entry after the cast back to
bf16 is half the bytes), then the earliest (the norm recomputed with the MLP).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.autocast import autocast_nodes
from loong_compile.passes.fx.nodes import draws_random, example_value, op_name
from loong_compile.passes.fx.op_sets import EXPANDS, RESHAPES
from loong_compile.passes.fx.row_ops import writes
from loong_compile.passes.fx.subgraphs import hop_name
from loong_compile.passes.fx.token_analysis import TokenAnalysis

Node = torch.fx.Node

# the most nodes one closure may hold (a graph whose every node is token-local and equally wide
# would otherwise be walked from every entry)
MAX_NODES = 4000
# ops whose result shares its input's storage: no bytes of their own in the interior
_VIEWS = RESHAPES | EXPANDS | {"transpose", "permute", "t", "chunk", "split", "unbind", "narrow",
                               "select", "getitem", "detach", "contiguous", "to", "type_as"}


@dataclasses.dataclass(eq=False)
class Closure:
    """What one entry computes alone, in graph order, with its exits, the outside values it
    reads (``others``) and the token-shaped constants it copies in."""

    entry: Node
    nodes: list[Node]
    exits: list[Node]
    others: list[Node]
    constants: list[Node]
    interior_bytes: int
    bulge: bool

    def qualifies(self) -> str | None:
        """None if the closure is a region worth tiling, else why not."""
        width = value_bytes(self.entry)
        if not self.bulge:
            return "no value in it is wider than its input"
        for node in self.exits:
            value = example_value(node)
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                return f"{node.name} leaves it and is not a floating tensor"
            if value_bytes(node) > width:
                return f"{node.name} leaves it wider than its input"
        if self.interior_bytes <= width + sum(value_bytes(n) for n in self.exits):
            return "its intermediates are no larger than its input and outputs"
        return None


def value_bytes(node: Any) -> int:
    """Bytes of a node's example value (the tensors of a tuple summed); 0 for other values."""
    value = example_value(node)
    values = value if isinstance(value, (tuple, list)) else [value]
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor) and isinstance(v.numel(), int):
            total += v.numel() * v.element_size()
    return total


class Finder:
    """The closures of a graph's token values, from one token analysis of its top level."""

    def __init__(self, graph: torch.fx.Graph, analysis: TokenAnalysis, mixers: frozenset):
        self.graph = graph
        self.analysis = analysis
        self.mixers = mixers
        self.flagged = {node for node, _, _ in analysis.findings}
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        # regions run as the op's own code: not under an autocast or no_grad of the graph's
        self.quiet = autocast_nodes(graph) | _grad_off(graph)

    def local(self, node: Node) -> bool:
        return (node.op in ("call_function", "call_method") and node in self.analysis.tainted
                and node not in self.flagged and node not in self.analysis.partial
                and node not in self.quiet and node.target not in self.mixers
                and hop_name(node) is None and not _loong_op(node.target)
                and not draws_random(node))

    def data(self, node: Node) -> bool:
        """Token data: a token input or computed from one (not a value that is only shaped like
        tokens: a factory's, or a weight's whose size is a multiple of the tokens)."""
        return node in self.analysis.rows.data or (
            node.op == "placeholder" and node in self.analysis.tainted)

    def entries(self) -> list[Node]:
        """Token values a region may start from: tensors with a token axis."""
        return [n for n in self.graph.nodes if n in self.analysis.tainted
                and isinstance(example_value(n), torch.Tensor) and self.analysis.axes(n)]

    def closure(self, entry: Node) -> Closure:
        width = value_bytes(entry)
        inside: dict[Node, None] = {}
        grown: set[Node] = set()
        closed: set[Node] = set()
        constants: dict[Node, None] = {}
        todo = [(self.order[u], u) for u in entry.users]
        heapq.heapify(todo)
        while todo and len(inside) < MAX_NODES:
            _, node = heapq.heappop(todo)
            if node in inside or not self.local(node):
                continue
            tokens = [a for a in node.all_input_nodes if a in self.analysis.tainted]
            made = [a for a in tokens if a is not entry and a not in inside]
            # token data from elsewhere stops the closure; a value only shaped like tokens is
            # read from outside (a weight's view) or, made from nothing, copied in
            if any(self.data(a) for a in made) or any(a in closed for a in tokens):
                continue
            if writes(node) and node.args and node.args[0] not in inside:
                continue
            constants.update(dict.fromkeys(a for a in made if not a.all_input_nodes))
            inside[node] = None
            wider = value_bytes(node) > width or any(a in grown for a in tokens)
            if wider and value_bytes(node) <= width and self.analysis.axes(node) \
                    and _floating(node):   # an index (an experts' offsets) closes nothing
                closed.add(node)
            elif wider:
                grown.add(node)
            for user in node.users:
                if user not in inside:
                    heapq.heappush(todo, (self.order[user], user))
        nodes = sorted(inside, key=self.order.__getitem__)
        exits = [n for n in nodes if any(u not in inside for u in n.users)]
        others = sorted({a for n in nodes for a in n.all_input_nodes
                         if a not in inside and a is not entry and a not in constants},
                        key=self.order.__getitem__)
        interior = sum(value_bytes(n) for n in nodes
                       if n not in exits and op_name(n) not in _VIEWS)
        return Closure(entry, nodes, exits, others, list(constants), interior, bool(grown))

    def regions(self) -> tuple[list[Closure], list[tuple[Closure, str]]]:
        """The qualifying closures kept (no two overlapping; the narrowest entry, then the
        earliest, first), and the bulges that did not qualify, with why."""
        kept, rejected, candidates = [], [], []
        for entry in self.entries():
            closure = self.closure(entry)
            if not closure.bulge:
                continue
            why = closure.qualifies()
            if why is None:
                candidates.append(closure)
            else:
                rejected.append((closure, why))
        taken: set[Node] = set()
        for closure in sorted(candidates, key=lambda c: (value_bytes(c.entry), self.order[c.entry])):
            if taken.isdisjoint(closure.nodes) and closure.entry not in taken:
                kept.append(closure)
                taken.update(closure.nodes)
        kept.sort(key=lambda c: self.order[c.entry])
        # a bulge a kept region holds was tiled: the narrower closures around it are no news
        rejected = [(c, why) for c, why in rejected if taken.isdisjoint(c.nodes)]
        return kept, _distinct(rejected)


def _distinct(rejected: list[tuple[Closure, str]]) -> list[tuple[Closure, str]]:
    """One rejected closure per bulge (the largest: the others are inside it)."""
    out: list[tuple[Closure, str]] = []
    for closure, why in sorted(rejected, key=lambda r: -len(r[0].nodes)):
        if all(set(closure.nodes).isdisjoint(c.nodes) for c, _ in out):
            out.append((closure, why))
    return out


def _floating(node: Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _loong_op(target: Any) -> bool:
    """An op the passes emitted (opaque to the analysis: the LM head's, a sequence value)."""
    return getattr(target, "__module__", "").startswith("loong_compile") or (
        getattr(target, "namespace", None) == "loong")


def _grad_off(graph: torch.fx.Graph) -> set[Node]:
    """Nodes under the graph's own ``torch.no_grad()`` (``_set_grad_enabled(False)`` until
    ``(True)``): a region cut out of them would run its recompute with gradients."""
    off, quiet = False, set()
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_set_grad_enabled":
            off = node.args[0] is False
        elif off:
            quiet.add(node)
    return quiet
