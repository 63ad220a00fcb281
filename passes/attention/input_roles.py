"""Which graph inputs are the positions and the attention mask: found by how they flow, not by name.

A step function names its arguments as it likes (``def step(ids, pos, labels)``) and Dynamo
names the graph inputs after them, so a name proves nothing.  Two uses do:

* RoPE's angle.  A rotary embedding takes the cosine and sine (or ``torch.polar``) of the
  positions times its frequencies.  An integer graph input that is the only integer input such
  an angle is computed from, reaching it as a number, is the positions (``rope_positions``).
  "As a number" leaves out what a value is only looked up by: token ids reach every hidden
  state, but as the index of the embedding lookup, never as a factor of an angle.
* The mask.  ``Prover`` reads each graph input a mask is computed from in a role: RoPE's
  positions as the positions, any other input in each role its shape allows (the positions
  only when RoPE names none), and keeps the one reading the probes prove (``mask_proof``)
  that depends on every input it reads as its role says: an input is the positions when the
  mask's documents follow its restarts, the attention mask when the keys where it is 0 are
  seen by nobody.  An input read otherwise (token ids, labels) makes the mask unproven: what
  the mask does with values no probe holds is unknown.  No reading or several: refused.

Positions must be the token layout's whatever reads them (RoPE rotates by them; the document
ids are built from them), so each call checks them at run time (``loong_compile/checks/inputs.py``):
the attention pass leaves every input found to be positions, and how, as the fact
``POSITION_INPUTS`` for that check.  Positions used only as an index (a learned position
embedding, a precomputed cos/sin table) cannot be told from token ids by their flow; the check
also takes the input named ``position_ids`` for those.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from loong_compile._compat.dynamo import is_module_state
from loong_compile.passes.attention.mask_proof import (
    PADDING, POSITIONS, MaskMeaning, MaskNotProven, MaskSubgraph)
# the fact the attention pass provides: {graph input index: how it was found to be positions}
from loong_compile.passes.base import POSITION_INPUTS
from loong_compile.passes.fx.op_sets import ANGLES
from loong_compile.passes.fx.subgraphs import Scope

# The fact of whether the graph computes documents in the balanced order exactly (checks/inputs.py):
# every attention call causal, its mask documents from the positions without key padding
BALANCED_EXACT = "balanced_documents_exact"
ROPE, DOCUMENTS, KEY_PADDING = "RoPE's angle", "the masks' documents", "the masks' key padding"
ROLE_NAMES = {POSITIONS: "position_ids", PADDING: "the 2-D attention_mask"}

# the operands that only index a value: (call_function or call_method name) -> positions
_INDEX_OPERANDS = {"gather": (2,), "index_select": (2,), "take": (1,), "take_along_dim": (1,)}
_INDEX_KWARGS = ("index", "indices")


class Prover:
    """Proves the masks of one graph, each once (layers share their mask), and which graph
    inputs they read as the positions and as the attention mask."""

    def __init__(self, scopes: list[Scope], rope: Sequence[torch.fx.Node] = ()):
        """``rope``: the graph inputs RoPE's angle is computed from (``rope_positions``),
        which are the positions whatever a mask reads."""
        self.outer = {ph: arg for scope in scopes for ph, arg in scope.operands.items()}
        self.rope = tuple(rope)
        self.read_as: dict[str, torch.fx.Node] = {}  # role -> the input proven masks read in it
        self._proven: dict[torch.fx.Node, MaskMeaning | MaskNotProven] = {}

    def input(self, role: str) -> torch.fx.Node | None:
        """The graph input in ``role``: the one a proven mask read in it, else RoPE's positions."""
        found = self.read_as.get(role)
        return self.rope[0] if found is None and role == POSITIONS and self.rope else found

    def prove(self, mask: torch.fx.Node) -> MaskMeaning:
        """What ``mask`` means, proven on probes; MaskNotProven says why not."""
        while mask in self.outer:  # a body's operand: the caller's value
            mask = self.outer[mask]
        if mask not in self._proven:
            try:
                self._proven[mask] = self._prove(mask)
            except MaskNotProven as e:
                self._proven[mask] = e
        found = self._proven[mask]
        if isinstance(found, MaskNotProven):
            raise found
        return found

    def _prove(self, mask: torch.fx.Node) -> MaskMeaning:
        subgraph = MaskSubgraph(mask, self.outer)
        proven, failed = [], []
        for roles in self._readings(subgraph):
            tried = [n for n in roles if self._role(n) is None]
            try:
                meaning = subgraph.prove(roles)
                # an input read but not as its role's structure: what the mask does with it is
                # proven for the probes' values only (tokens equal to an id no probe holds)
                idle = [n.name for n in roles if not meaning.reads(roles[n])]
                if idle:
                    raise MaskNotProven(f"it is {meaning.describe()}, yet reads {', '.join(idle)} "
                                        "(what it does with values no probe holds is unproven)")
                proven.append((roles, meaning))
            except MaskNotProven as e:
                failed.append((roles, tried, e))
        if len(proven) == 1:
            roles, meaning = proven[0]
            self.read_as.update({role: n for n, role in roles.items() if meaning.reads(role)})
            return meaning
        if proven:
            raise MaskNotProven("it fits more than one reading of its inputs (" + "; ".join(
                f"{_reading(roles, list(roles))}: {m.describe()}" for roles, m in proven) + ")")
        if len(failed) == 1 and not failed[0][1]:  # nothing tried: the proof's own words
            raise failed[0][2]
        rope = (f"; the positions are {', '.join(n.name for n in self.rope)}, from which RoPE's "
                "angle is computed" if self.rope else "")
        raise MaskNotProven("; ".join(f"reading {_reading(roles, tried)}, {e}"
                                      for roles, tried, e in failed) + rope)

    def _role(self, node: torch.fx.Node) -> str | None:
        if node in self.rope:
            return POSITIONS
        return next((role for role, n in self.read_as.items() if n is node), None)

    def _readings(self, subgraph: MaskSubgraph) -> list[dict[torch.fx.Node, str]]:
        """Each assignment of roles to the inputs of ``subgraph`` worth probing: known roles
        kept, every other input in each free role its shape allows, no role twice."""
        known = {n: self._role(n) for n in subgraph.inputs if self._role(n) is not None}
        free = [r for r in (POSITIONS, PADDING) if r not in known.values()
                and r not in self.read_as and not (r == POSITIONS and self.rope)]
        unknown = [n for n in subgraph.inputs if n not in known]
        choices = []
        for n in unknown:
            fits = [r for r in free if _fits(n, r, subgraph)]
            if not fits:
                raise MaskNotProven(self._neither(n, subgraph.length))
            choices.append(fits)
        readings = [known | dict(zip(unknown, combo)) for combo in itertools.product(*choices)
                    if len(set(combo)) == len(combo)]
        if not readings:
            raise MaskNotProven(f"it reads the graph inputs {', '.join(n.name for n in unknown)}, "
                                "more than one for a role (position_ids, the 2-D attention_mask)")
        return readings

    def _neither(self, node: torch.fx.Node, length: int) -> str:
        value = node.meta.get("example_value")
        what = ("a parameter or buffer of the model" if is_module_state(node) else
                f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor)
                else f"a {type(value).__name__}")
        taken = {r: n.name for r, n in self.read_as.items()}
        if self.rope:
            taken.setdefault(POSITIONS, ", ".join(n.name for n in self.rope) + " (RoPE's angle)")
        held = "".join(f"; {ROLE_NAMES[r]} is {name}" for r, name in taken.items())
        return (f"it is computed from the graph input {node.name} ({what}), which is neither "
                f"position_ids nor the 2-D attention_mask (arguments of the call of (batch, "
                f"{length}), position_ids of integers){held}")


def rope_positions(gm: torch.fx.GraphModule, scopes: list[Scope]) -> list[torch.fx.Node]:
    """The graph inputs an angle (cos, sin, polar; in the graph or an inline HOP body) is
    computed from as numbers, from one integer input alone, in graph order."""
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    outer = {ph: arg for scope in scopes for ph, arg in scope.operands.items()}
    found: set[torch.fx.Node] = set()
    for scope in scopes:
        for node in scope.module.graph.nodes:
            angle = _angle(node)
            if angle is not None:
                sources = _integer_sources(angle, outer, set(inputs))
                if len(sources) == 1:
                    found |= sources
    return [n for n in inputs if n in found]


def roles_found(gm: torch.fx.GraphModule, prover: Prover, state: dict[str, Any]) -> dict[str, Any]:
    """Leave the fact ``POSITION_INPUTS`` in ``state``; the report's account of the roles."""
    how: dict[torch.fx.Node, list[str]] = {n: [ROPE] for n in prover.rope}
    if (documents := prover.read_as.get(POSITIONS)) is not None:
        how.setdefault(documents, []).append(DOCUMENTS)
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    state[POSITION_INPUTS] = {inputs.index(n): ", ".join(why) for n, why in how.items()}
    padding = prover.read_as.get(PADDING)
    return {POSITIONS: [{"input": n.name, "found_by": why} for n, why in how.items()],
            PADDING: None if padding is None else {"input": padding.name,
                                                   "found_by": [KEY_PADDING]}}


def _reading(roles: dict[torch.fx.Node, str], nodes: list[torch.fx.Node]) -> str:
    return ", ".join(f"{n.name} as {ROLE_NAMES[roles[n]]}" for n in nodes)


def _fits(node: torch.fx.Node, role: str, subgraph: MaskSubgraph) -> bool:
    """Whether ``node`` is an argument of the call shaped as ``role`` for the mask: one row or
    one per row of the mask, of its length."""
    value = node.meta.get("example_value")
    if is_module_state(node) or not isinstance(value, torch.Tensor) or value.dim() != 2 \
            or value.shape[0] not in (1, subgraph.batch) or value.shape[1] != subgraph.length:
        return False
    return role == PADDING or _is_integer(node)


def _name(node: torch.fx.Node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", "")


def _angle(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op not in ("call_function", "call_method") or _name(node) not in ANGLES:
        return None
    place = ANGLES[_name(node)]
    operand = node.args[place] if len(node.args) > place else None
    return operand if isinstance(operand, torch.fx.Node) else None


def _index_operands(node: torch.fx.Node) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The operands of ``node`` (positions, keywords) that are only used as indices."""
    if node.target is operator.getitem:
        return (1,), ()
    if node.target is F.embedding:
        return (0,), ("input",)
    if node.target is torch.embedding:
        return (1,), _INDEX_KWARGS
    if node.op in ("call_function", "call_method"):
        return _INDEX_OPERANDS.get(_name(node), ()), _INDEX_KWARGS
    return (), ()


def _integer_sources(angle: torch.fx.Node, outer: dict, inputs: set) -> set[torch.fx.Node]:
    """The integer graph inputs ``angle`` is computed from as numbers (not only as indices)."""
    sources: set[torch.fx.Node] = set()
    todo, seen = [angle], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if isinstance(outer.get(n), torch.fx.Node):  # a body's operand: the caller's value
                todo.append(outer[n])
            elif n in inputs and _is_integer(n):
                sources.add(n)
            continue
        places, keywords = _index_operands(n)
        operands = [a for i, a in enumerate(n.args) if i not in places]
        operands += [v for k, v in n.kwargs.items() if k not in keywords]
        torch.fx.node.map_arg(operands, todo.append)
    return sources


def _is_integer(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point \
        and not value.dtype.is_complex and value.dtype is not torch.bool
