"""Row permutations proven undone: the expert dispatch of a mixture-of-experts layer.

transformers' ``grouped_mm`` experts (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3) run, on the
N = rows · k (token, expert) pairs of a rank (row r of the pairs belongs to token r // k)::

    ids_s, P = sort(ids)                        # P: a permutation of the N pair rows
    x_s, w_s = hidden[P // k], weights[P]       # the pairs' rows in P's order
    offs = cumsum(histc(ids_s, bins=G, min=0, max=G - 1))
    y_s = grouped_mm(x_s, W, offs) ...          # rows [offs[g-1], offs[g]) times W[g]
    inv = empty_like(P); inv[P] = arange(N)     # P's inverse
    out = (y_s * w_s)[inv].view(rows, k, H).sum(1)

The token analysis refuses the sort (it moves tokens).  This module proves such a dispatch
token-local as a whole: every value between the sort and the gather by ``inv`` is ``Y[P]``
for a value ``Y`` the token analysis accepts, and that gather gives back ``Y``.  Why each
step keeps it so:

- ``P``, the indices of an ascending sort of a 1-D token tensor (the key), is a permutation
  of [0, N): ``Z[P]`` of a token tensor Z of N rows is permuted; so is ``hidden[P // k]``
  (= ``repeat_interleave(hidden, k)[P]``) when the key flattens a (rows of hidden, k) tensor,
  and ``key[P]`` (the sort's values) is the key permuted and sorted.
- An op that treats every row alike commutes with P, ``f(Y[P]) = f(Y)[P]`` (``row_ops``
  says which do), and gathering a weight by permuted ids gives permuted rows.  The token
  analysis still checks these ops, along the rows too.
- ``grouped_mm(x_s, W, offs)`` multiplies row r by ``W[g]`` for the group g holding r.  With
  ``ids_s`` ascending, every id in [0, G) (the indices of a topk or argmax over an axis of at
  most G) and ``offs`` the running count of each id 0..G-1 among those same ``ids_s``
  (histc's G bins of width (G-1)/G hold one integer each), that group is ``ids_s[r]``: the
  row's result depends on its own row alone, so the product is row-wise.  A sort may order
  equal ids either way: no result depends on a row's place.
- ``inv[P] = arange(N)`` on a fresh (N,) tensor writes each entry once (P is a permutation):
  ``inv[P[i]] = i``, so ``inv`` is P's inverse and ``(Y[P])[inv] = Y``.
- Nothing else touches these values: no other in-place write (``inv``'s one write comes
  before every read of it), no graph output, no subgraph call.  Anything else fails the
  proof, and the sort is refused as before.

Which rows belong together is read from sizes, as everywhere in the token analysis (a view
keeps the order of the tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from loong_compile.passes.fx.module_paths import module_path, source_line
from loong_compile.passes.fx.nodes import example_value, node_arg, op_name
from loong_compile.passes.fx.op_sets import COPIES, EXPANDS, INT_CASTS, RESHAPES, VIEWS
from loong_compile.passes.fx.tokens import counts_tokens
from loong_compile.passes.fx.row_ops import CASTS, why_not_rowwise, writes
from loong_compile.passes.fx.token_ops import custom_op

Node = torch.fx.Node

PROOF = "proof"  # a step of the dispatch itself: the token checks skip it

# what a 1-D key is a view or a copy of: the same values
_VIEWS = VIEWS | COPIES
# ... and what makes a view of another tensor (an in-place update through it changes that one)
_VIEWS_OF_ANOTHER = _VIEWS | RESHAPES | EXPANDS | {
    "transpose", "permute", "narrow", "select", "getitem", "chunk", "split", "unbind"}
_UPDATES = {"add", "sub", "mul", "div"}   # in place, on rows the graph made (_updates_own_rows)
_FRESH = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros",
          "new_ones", "new_full", "empty", "zeros", "ones", "full"}
_GROUPED_MATMULS = {"grouped_mm"}
# transformers' float32 stand-in for torch._grouped_mm under compile: its source computes the
# same product (rows [offs[g-1], offs[g]) times weight[g], the rows after offs[-1] zero)
_GROUPED_MATMUL_OPS = {"transformers::grouped_mm_fallback"}


@dataclasses.dataclass(eq=False)
class Permutation:
    """One sort's permutation P of its key's N rows, and what the proof found about it."""

    sort: Node
    key: Node
    rows: int
    slots: int           # rows of the key per token (k)
    bound: int | None    # the key's ids lie in [0, bound)
    matmuls: int = 0
    inverted_at: Node | None = None
    failure: tuple[Node, str] | None = None


@dataclasses.dataclass(eq=False)
class Fact:
    """What a value is to P: ``sort`` (sort's result pair), ``perm`` (P), ``token`` (P // k),
    ``rows`` (Y[P]), ``sorted`` (key[P], ascending), ``counts`` / ``offsets`` (of the G ids
    among key[P]), ``blank`` (a fresh (N,) tensor), ``inverse`` (P's inverse)."""

    kind: str
    perm: Permutation
    groups: int = 0


class _Unproven(Exception):
    pass


class RowPermutations:
    """The facts of the permutations met so far in one token analysis (graph order)."""

    def __init__(self, tokens: Any, tainted: set[Node]):
        self.tokens = tokens
        self.tainted = tainted  # token data, as the token analysis found it
        self.data: set[Node] = set()  # computed from the token inputs (not token-sized constants)
        self.facts: dict[Node, Fact] = {}
        self.perms: list[Permutation] = []

    def visit(self, node: Node) -> str | None:
        """PROOF for a step of a dispatch (the token checks skip it), else None (they decide:
        no permutation reaches the node, or the node treats permuted rows alike)."""
        if any(a in self.data or a.op == "placeholder" and a in self.tainted
               for a in node.all_input_nodes):
            self.data.add(node)
        facts = {a: self.facts[a] for a in node.all_input_nodes if a in self.facts}
        if not facts:
            return self._sort(node)
        perms = {id(f.perm): f.perm for f in facts.values()}
        try:
            if len(perms) > 1:
                raise _Unproven("it combines rows of two permutations")
            (perm,) = perms.values()
            return self._step(node, facts, perm)
        except _Unproven as why:
            for perm in perms.values():
                perm.failure = perm.failure or (node, str(why))
            return PROOF

    def defers(self, node: Node) -> bool:
        """Whether ``node`` is an ``arange`` that only fills P's inverse (checked at the fill)."""
        user = next(iter(node.users), None)
        return op_name(node) == "arange" and len(node.users) == 1 and op_name(user) == "setitem" \
            and user.args[2] is node and self._kind(user.args[1]) == "perm"

    def proven(self) -> list[str]:
        return [f"expert dispatch proven token-local at {source_line(p.sort)} (module "
                f"{module_path(p.sort)}): {p.rows} rows permuted, {p.matmuls} grouped matmuls "
                f"by the sorted ids' groups, inverted at {source_line(p.inverted_at)}"
                for p in self.perms if p.failure is None and p.inverted_at is not None]

    def unproven(self) -> list[tuple[Node, str]]:
        """(sort, why) for each permutation the proof does not cover."""
        return [(p.sort, _why(p)) for p in self.perms if p.failure or p.inverted_at is None]

    # -- the steps ---------------------------------------------------------------------------

    def _sort(self, node: Node) -> str | None:
        """An ascending sort of a 1-D token tensor along its rows starts a permutation."""
        name = op_name(node)
        key = node.args[0] if node.args else node.kwargs.get("input")
        value = example_value(key)
        if name not in ("sort", "argsort") or key not in self.tainted \
                or not isinstance(value, torch.Tensor) or value.dim() != 1 \
                or not isinstance(value.shape[0], int) \
                or not counts_tokens(value.shape[0], self.tokens) \
                or node_arg(node, "dim", 1, -1) not in (0, -1) \
                or node_arg(node, "descending", 2, False) is not False:
            return None
        perm = Permutation(node, key, value.shape[0], _slots(key), _bound(key))
        self.perms.append(perm)
        self.facts[node] = Fact("sort" if name == "sort" else "perm", perm)
        return PROOF

    def _step(self, node: Node, facts: dict[Node, Fact], perm: Permutation) -> str | None:
        name = op_name(node)
        if node.op == "output":
            raise _Unproven("permuted rows leave the graph")
        if writes(node) and name != "setitem" and not self._updates_own_rows(node):
            raise _Unproven(f"{name} writes into permuted rows in place")
        if name == "getitem" and self._kind(node.args[0]) == "sort":
            self.facts[node] = Fact(("sorted", "perm")[node.args[1]], perm)
            return PROOF
        if name in ("floordiv", "floor_divide") and self._kind(node.args[0]) == "perm" \
                and isinstance(node.args[1], int) and node.args[1] > 0:
            self.facts[node] = Fact("token", perm, node.args[1])
            return PROOF
        if name in ("getitem", "index_select") and isinstance(self._index(node), Node) \
                and self._index(node) in facts:
            return self._gather(node, perm)
        if name == "histc":
            return self._counts(node, perm)
        if name == "cumsum" and self._kind(node.args[0]) == "counts":
            if node_arg(node, "dim", 1, None) not in (0, -1):
                raise _Unproven("the running count is not along the ids' groups")
            self.facts[node] = Fact("offsets", perm, self.facts[node.args[0]].groups)
            return PROOF
        if _grouped_matmul(node):
            return self._grouped_mm(node, perm)
        if name in _FRESH and self._kind(node.args[0]) == "perm":
            self.facts[node] = Fact("blank", perm)
            return PROOF
        if name == "setitem":
            return self._invert(node, perm)
        return self._rowwise(node, facts, perm)

    def _gather(self, node: Node, perm: Permutation) -> str:
        source, index = node.args[0], self._index(node)
        kind, fact = self._kind(index), self.facts[index]
        rows = example_value(source).shape[0] if isinstance(example_value(source), torch.Tensor) \
            else None
        aligned = source in self.tainted and source not in self.facts
        if kind == "perm" and aligned and rows == perm.rows:
            self.facts[node] = Fact("sorted" if source is perm.key else "rows", perm)
        elif kind == "token" and aligned and fact.groups == perm.slots \
                and rows * fact.groups == perm.rows and counts_tokens(rows, self.tokens):
            self.facts[node] = Fact("rows", perm)
        elif kind in ("rows", "sorted") and source not in self.data:
            self.facts[node] = Fact("rows", perm)  # a weight's rows chosen by permuted ids
        elif kind == "inverse" and self._kind(source) in ("rows", "sorted"):
            perm.inverted_at = node  # (Y[P])[P^-1] = Y: the rows are the tokens' again
        else:
            raise _Unproven(f"{op_name(node)} by {kind} gathers rows the proof cannot align "
                            "with the tokens")
        return PROOF

    def _counts(self, node: Node, perm: Permutation) -> str:
        bins = node_arg(node, "bins", 1, 100)
        low, high = node_arg(node, "min", 2, 0), node_arg(node, "max", 3, 0)
        if self._kind(node.args[0]) != "sorted" or not isinstance(bins, int) or bins < 2 \
                or (low, high) != (0, bins - 1) or perm.bound is None or perm.bound > bins \
                or not _holds(example_value(node).dtype, perm.rows + 1):
            raise _Unproven("histc does not count each id 0..G-1 of the sorted ids exactly (ids "
                            "from a topk over at most G, bins=G, min=0, max=G-1)")
        self.facts[node] = Fact("counts", perm, bins)
        return PROOF

    def _grouped_mm(self, node: Node, perm: Permutation) -> str:
        rows, weight = node.args[0], node.args[1]
        offsets = node_arg(node, "offs", 2, None)
        bias = node.kwargs.get("bias")
        fact = self.facts.get(offsets)
        if self._kind(rows) not in ("rows", "sorted") or fact is None or fact.kind != "offsets":
            raise _Unproven("grouped_mm's groups are not the running counts of the sorted ids "
                            "of the rows it multiplies")
        if weight in self.data or bias in self.data or example_value(rows).dim() != 2 \
                or example_value(weight).dim() != 3 \
                or example_value(weight).shape[0] != fact.groups:
            raise _Unproven("grouped_mm is not rows (N, K) times one (K, M) weight per group")
        perm.matmuls += 1
        self.facts[node] = Fact("rows", perm)
        return PROOF

    def _invert(self, node: Node, perm: Permutation) -> str:
        target, index, value = node.args
        fresh = (self._kind(target) == "blank" or op_name(target) in _FRESH
                 and not target.all_input_nodes) \
            and tuple(example_value(target).shape) == (perm.rows,)
        later = _later(node)
        if not (fresh and self._kind(index) == "perm" and _is_arange(value, perm.rows)
                and all(u is node or u in later for u in target.users)):
            raise _Unproven("the write is not inv[P] = arange(N) into a fresh (N,) tensor read "
                            "only after it")
        self.facts[target] = Fact("inverse", perm)
        return PROOF

    def _rowwise(self, node: Node, facts: dict[Node, Fact], perm: Permutation) -> None:
        name = op_name(node)
        kinds = {f.kind for f in facts.values()}
        if not kinds <= {"rows", "sorted"}:
            raise _Unproven(f"{name} reads {' and '.join(sorted(kinds))} of the permutation, "
                            "which the proof does not follow")
        why = why_not_rowwise(node, facts, perm.rows, self.data)
        if why:
            raise _Unproven(why)
        exact = name in CASTS and self._kind(node.args[0]) == "sorted" \
            and _holds(example_value(node).dtype, perm.bound)
        self.facts[node] = Fact("sorted" if exact else "rows", perm)
        return None  # row-wise: the token checks still apply, along the rows too

    def _updates_own_rows(self, node: Node) -> bool:
        """An in-place elementwise op (``out.add_(bias)`` after a grouped matmul) on permuted
        rows the graph made itself, not a view of another tensor: as its out-of-place form, it
        changes each row alone (``_rowwise`` then checks the operands)."""
        target = node.args[0] if node.args else None
        return (op_name(node).removesuffix("_") in _UPDATES and self._kind(target) == "rows"
                and isinstance(target, Node) and target.op == "call_function"
                and op_name(target) not in _VIEWS_OF_ANOTHER)

    # -- reading nodes -----------------------------------------------------------------------

    def _kind(self, node: Any) -> str | None:
        fact = self.facts.get(node) if isinstance(node, Node) else None
        return fact.kind if fact else None

    @staticmethod
    def _index(node: Node) -> Any:
        if op_name(node) == "index_select":
            return node_arg(node, "index", 2, None) if node_arg(node, "dim", 1, None) == 0 else None
        return node.args[1]


def _why(perm: Permutation) -> str:
    if perm.failure is None:
        return "its rows are never gathered back by the permutation's inverse"
    node, reason = perm.failure
    return f"{reason} ({node.name} at {source_line(node)})"


def _slots(key: Node) -> int:
    """Rows of the 1-D key per token: the last size of the tensor it flattens (1 if none)."""
    while op_name(key) in _VIEWS and example_value(key).dim() == 1 and key.args:
        key = key.args[0]
    value = example_value(key)
    return value.shape[-1] if value.dim() >= 2 else 1


def _bound(key: Node) -> int | None:
    """An upper bound on the key's values when they are indices (of a topk or argmax)."""
    while op_name(key) in _VIEWS | INT_CASTS and key.args:
        key = key.args[0]
    source = key.args[0] if op_name(key) == "getitem" and key.args[1] == 1 else key
    name = op_name(source)
    if name not in ("topk", "argmax") or source is key and name == "topk":
        return None
    value = example_value(source.args[0])
    dim = node_arg(source, "dim", 2 if name == "topk" else 1, -1 if name == "topk" else None)
    return value.numel() if dim is None else value.shape[dim]


def _grouped_matmul(node: Node) -> bool:
    return op_name(node) in _GROUPED_MATMULS or custom_op(node.target) in _GROUPED_MATMUL_OPS


def _holds(dtype: torch.dtype, bound: int | None) -> bool:
    """Whether ``dtype`` holds every integer in [0, bound) exactly."""
    if bound is None:
        return False
    if dtype.is_floating_point:
        return bound <= 2 / torch.finfo(dtype).eps
    return dtype != torch.bool and bound - 1 <= torch.iinfo(dtype).max


def _is_arange(node: Any, rows: int) -> bool:
    """``arange(N)``: 0, 1, ..., N - 1."""
    return op_name(node) == "arange" and not ({"start", "end", "step"} & set(node.kwargs)) \
        and tuple(node.args) in ((rows,), (0, rows), (0, rows, 1))


def _later(node: Node) -> set[Node]:
    later, at = set(), node.next
    while at.op != "root":
        later.add(at)
        at = at.next
    return later
