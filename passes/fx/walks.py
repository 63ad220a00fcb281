"""Walks over a graph: what a value is computed from, what only returns it, which nodes are the
backward, and graph order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.fx

from loong_compile.passes.fx.nodes import op_name


def ancestors(roots: Iterable[Any], stop: Callable[[torch.fx.Node], bool] | None = None,
              inputs: Callable[[torch.fx.Node], Iterable[Any]] | None = None
              ) -> dict[torch.fx.Node, None]:
    """The nodes ``roots`` are computed from, the roots included, in the order first reached
    (an ordered set).  A node for which ``stop`` holds is neither included nor walked past;
    ``inputs`` gives a node's inputs (default: its ``all_input_nodes``; e.g. a body's
    placeholder -> the outer node it stands for).  Non-node roots and inputs are skipped."""
    found: dict[torch.fx.Node, None] = {}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if not isinstance(node, torch.fx.Node) or node in found or (stop and stop(node)):
            continue
        found[node] = None
        todo.extend(node.all_input_nodes if inputs is None else inputs(node))
    return found


def only_returned(node: torch.fx.Node, top: torch.fx.Graph) -> bool:
    """Whether a value reaches nothing but the top-level graph's outputs (through views)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output" and user.graph is not top:
                return False  # a HOP body's result is used by its caller
            if user.op == "output" or user in seen:
                continue
            if op_name(user) not in ("getitem", "view", "contiguous", "reshape"):
                return False
            seen.add(user)
            todo.append(user)
    return True


def tangent_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes of a joint graph that depend on a tangent: the backward; all others are forward."""
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def first_in_order(nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    """The earliest of ``nodes`` (of one graph) in graph order: FX nodes compare by their place,
    so no walk over the graph (the passes call this per saved value: a walk made it quadratic)."""
    return min(nodes)


def last_in_order(nodes: Iterable[torch.fx.Node]) -> torch.fx.Node:
    """The latest of ``nodes`` (of one graph) in graph order."""
    return max(nodes)
