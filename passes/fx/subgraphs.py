"""Higher-order-op bodies: where in a Dynamo graph attention and token mixing can hide.

Dynamo keeps the body of a higher-order op (activation checkpointing, an ``autograd.Function``,
``cond``, flex_attention's score and mask functions) in a submodule of the graph module, called
through the HOP's node.  The passes that must see every call (the attention rewrite, the token
analysis) walk the top-level graph and every body through ``graph_scopes``.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

# Bodies that run exactly as written, once per call, on the operands in order: a rewrite inside
# them is a rewrite of the model.  (Activation checkpointing replays its body in the backward,
# with the same collectives on every rank.)
INLINE_HOPS = ("tag_activation_checkpoint", "wrap")


@dataclasses.dataclass
class Scope:
    """One graph to search: the top level (``hop`` None) or a HOP body."""

    module: torch.fx.GraphModule
    hop: str | None = None
    caller: torch.fx.Node | None = None
    operands: dict[torch.fx.Node, object] = dataclasses.field(default_factory=dict)
    """Body placeholder -> the caller's argument it receives (inline HOPs only)."""

    @property
    def inline(self) -> bool:
        return self.hop is None or self.hop in INLINE_HOPS


def hop_name(node: torch.fx.Node) -> str | None:
    """The higher-order op a node calls, or None."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.target.name()
    return None


def graph_scopes(gm: torch.fx.GraphModule) -> list[Scope]:
    """The top-level graph, then every HOP body under it (depth first), each once."""
    scopes = [Scope(gm)]
    seen: set[int] = {id(gm)}
    for scope in scopes:  # grows while iterating: bodies of bodies
        for node in scope.module.graph.nodes:
            name = hop_name(node)
            if name is None:
                continue
            bodies = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
            for attr in bodies:
                body = getattr(scope.module, attr.target, None)
                if not isinstance(body, torch.fx.GraphModule) or id(body) in seen:
                    continue
                seen.add(id(body))
                scopes.append(Scope(body, name, node, _operands(body, node, attr, name)))
    return scopes


def _operands(body: torch.fx.GraphModule, caller: torch.fx.Node, attr: torch.fx.Node,
              name: str) -> dict[torch.fx.Node, object]:
    if name not in INLINE_HOPS:
        return {}
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    args = list(caller.args[caller.args.index(attr) + 1:])
    return dict(zip(placeholders, args))


def parent_of(scope: Scope, scopes: list[Scope]) -> Scope:
    """The scope whose graph calls ``scope``'s body."""
    return next(s for s in scopes if s.module.graph is scope.caller.graph)


def add_operand(scope: Scope, outer: torch.fx.Node, name: str) -> torch.fx.Node:
    """Pass ``outer`` (a node of the caller's graph) into an inline body as a new last operand;
    returns the body's placeholder for it."""
    graph = scope.module.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    with graph.inserting_after(placeholders[-1]) if placeholders else \
            graph.inserting_before(next(iter(graph.nodes))):
        inner = graph.placeholder(name)
    inner.meta["example_value"] = outer.meta.get("example_value")
    scope.caller.args = (*scope.caller.args, outer)
    scope.operands[inner] = outer
    return inner


def drop_unused_operands(scopes: list[Scope]) -> int:
    """Remove the dead code of every scope, innermost first, and the inline bodies' operands
    their body no longer reads (an attention mask after the rewrite), so that what computed
    them dies in the caller too.  Returns how many operands were dropped."""
    dropped = 0
    for scope in reversed(scopes):
        _eliminate_dead_code(scope.module.graph)
        if scope.hop is None or not scope.inline:
            continue
        args = list(scope.caller.args)
        first = 1 + next(i for i, a in enumerate(args) if isinstance(a, torch.fx.Node)
                         and a.op == "get_attr"
                         and getattr(scope.caller.graph.owning_module, a.target) is scope.module)
        for index, placeholder in reversed(list(enumerate(
                scope.module.graph.find_nodes(op="placeholder")))):
            if not placeholder.users:
                del args[first + index]
                scope.module.graph.erase_node(placeholder)
                scope.operands.pop(placeholder, None)
                dropped += 1
        scope.caller.args = tuple(args)
    return dropped


# Augmented assignments write into their left operand; Dynamo records them as these functions.
_IN_PLACE_OPERATORS = frozenset((operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                 operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                                 operator.iand, operator.ior, operator.ixor, operator.ilshift,
                                 operator.irshift))


def _writes_in_place(node: torch.fx.Node) -> bool:
    """Whether a torch-IR node writes into an input: an in-place method or function (``copy_``,
    ``torch.relu_``), an augmented assignment, or ``inplace=True``."""
    if node.op not in ("call_method", "call_function"):
        return False
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):  # and_, not_: pure
        return node.target in _IN_PLACE_OPERATORS
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True


def _eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """FX's dead-code elimination of this graph alone (each scope gets its own call), keeping
    in-place writes: FX counts a method call pure, yet in torch IR ``k[..., :d].copy_(x)`` (how
    transformers' DeepSeek-V3 fills its keys) is unused as a value and needed for what it wrote."""
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure() and not _writes_in_place(node):
            graph.erase_node(node)
