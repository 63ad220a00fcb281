"""Tree search for a plan within a given capacity, over canonical solutions only.

Any plan can be pushed down ("gravity") until every buffer rests on the
floor or on a buffer below it; listing those buffers by offset, each one sits
exactly on the highest top among the earlier ones it overlaps in time.  So it
suffices to search over *orders*: place buffers one at a time, each at the
lowest offset its already placed neighbours allow, offsets never decreasing
(ties broken by index, so each plan is met once).  This is the canonical-
solution search of MiniMalloc (Moffitt, ASPLOS 2023); the pruning rules are
the ones that paper describes:

* monotone floor: once a buffer is placed at ``x``, no later buffer goes
  below ``x``, so space under ``x`` that is still free in some section is lost;
  a section whose floor (at least ``x``) plus the sizes still to place in it
  exceeds the capacity ends the branch;
* unallocated floor: nothing goes below the lowest offset the unplaced
  buffers of a section can still take, which raises that section's floor;
* dominance: a buffer is never placed at or above the top that another
  unplaced buffer would have at its own lowest offset (placing that one first
  is never worse);
* dynamic order: children are tried lowest offset first, then by a static
  preorder (the buffer's index after :func:`preorder`);
* decomposition: a step boundary no unplaced buffer crosses splits what is
  left into independent pieces, solved one after the other.

The search answers one question: is there a plan with arena <= capacity?
``FOUND`` with offsets, ``INFEASIBLE`` (the tree was exhausted: a proof), or
``LIMIT`` (node budget or deadline spent).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from loong_compile.passes.memory_plan.solver.problem import Instance

FOUND, INFEASIBLE, LIMIT = "found", "infeasible", "limit"

# Static preorders (the tie-break after the lowest offset): keys that put the
# buffers with the least freedom first.  "crowd" is the largest total live
# in any section the buffer spans.
PREORDERS = ("crowd-length-area", "length-crowd-area", "crowd-area-length",
             "size-length", "area-crowd", "length-size")


def _preorder_keys(inst: Instance) -> dict[str, np.ndarray]:
    length = [e - s for s, e in zip(inst.starts, inst.ends)]
    return {
        "crowd": np.array(inst.crowd, dtype=float),
        "length": np.array(length, dtype=float),
        "area": np.array([z * d for z, d in zip(inst.sizes, length)], dtype=float),
        "size": np.array(inst.sizes, dtype=float),
    }


def preorder(inst: Instance, name: str) -> list[int]:
    """Buffer indices of ``inst`` sorted by the named key list (each descending)."""
    value = _preorder_keys(inst)
    keys = [value[k] for k in name.split("-")]
    return sorted(range(inst.n), key=lambda k: tuple(-v[k] for v in keys) + (k,))


def _random_preorder(inst: Instance, keys: dict[str, np.ndarray], rng) -> list[int]:
    """A random mix of the preorder keys, each buffer's score jittered by up to 20 %."""
    weights = rng.dirichlet(np.ones(len(keys)))
    score = sum(w * v / max(v.max(), 1.0) for w, v in zip(weights, keys.values()))
    score = score * rng.uniform(0.8, 1.2, size=inst.n)
    return np.argsort(-score, kind="stable").tolist()


class CanonicalSearch:
    """Depth-first search over canonical plans of one instance, in one preorder.

    The search state lives in numpy arrays indexed by preorder rank; every
    placement is logged so that any number of them can be taken back.
    """

    def __init__(self, inst: Instance, order: Sequence[int]):
        # Renumber buffers so that the preorder is the index order.
        self.inst = inst
        self.order = list(order)
        rank = {k: r for r, k in enumerate(self.order)}
        n = self.n = inst.n
        self.sizes = np.array([inst.sizes[k] for k in self.order], dtype=np.int64)
        self.lo = inst.sec_lo[self.order]
        self.hi = inst.sec_hi[self.order]
        self.nbrs = [np.array(sorted(rank[j] for j in inst.overlaps[k]), dtype=np.int64)
                     for k in self.order]
        # The buffers covering each section, flattened section by section, so
        # one np.minimum.reduceat gives every section's lowest unplaced offset.
        n_sections = len(inst.section_totals)
        members = [[] for _ in range(n_sections)]
        for r in range(n):
            for sec in range(self.lo[r], self.hi[r]):
                members[sec].append(r)
        self.section_members = np.array([r for m in members for r in m], dtype=np.int64)
        self.section_starts = np.cumsum([0] + [len(m) for m in members[:-1]], dtype=np.int64)
        # Buffers crossing each boundary between section k and k + 1.
        self.initial_cuts = np.zeros(max(n_sections - 1, 0), dtype=np.int64)
        for r in range(n):
            self.initial_cuts[self.lo[r]:self.hi[r] - 1] += 1
        self.nodes = 0

    def run(self, capacity: int, node_limit: int | None = None,
            deadline: float | None = None) -> tuple[str, list[int] | None]:
        """Search for a plan with arena <= ``capacity`` (units)."""
        if self.n == 0:
            return FOUND, []
        if int(self.inst.section_totals.max()) > capacity:
            return INFEASIBLE, None
        self.capacity, self.node_limit, self.deadline = capacity, node_limit, deadline
        self.nodes = 0
        n = self.n
        self.placed = np.zeros(n, dtype=bool)
        # Lowest offset each unplaced buffer can take now; a placed buffer's offset.
        self.min_off = np.zeros(n, dtype=np.int64)
        self.key_off = self.min_off.copy()          # min_off, or "unplaced_big" once placed
        self.floor = np.zeros(len(self.inst.section_totals), dtype=np.int64)
        self.total = self.inst.section_totals.astype(np.int64).copy()
        self.cuts = self.initial_cuts.copy()
        self.log: list[tuple] = []
        # The timeline may already fall apart into independent pieces.
        status = self._solve_pieces(np.arange(n, dtype=np.int64), 0, len(self.floor), 0, -1)
        if status != FOUND:
            return status, None
        offsets = [0] * n
        for r, k in enumerate(self.order):
            offsets[k] = int(self.min_off[r])
        return FOUND, offsets

    _BIG = np.iinfo(np.int64).max // 4

    def _place(self, i: int) -> None:
        off = int(self.min_off[i])
        top = off + int(self.sizes[i])
        lo, hi = self.lo[i], self.hi[i]
        nb = self.nbrs[i]
        nb = nb[~self.placed[nb]]  # unplaced neighbours: their lowest offset rises to top
        old_nb = self.min_off[nb]
        new_nb = np.maximum(old_nb, top)
        self.min_off[nb] = new_nb
        self.key_off[nb] = new_nb
        self.placed[i] = True
        self.key_off[i] = self._BIG
        old_floor = self.floor[lo:hi].copy()
        self.floor[lo:hi] = top
        self.total[lo:hi] -= self.sizes[i]
        self.cuts[lo:hi - 1] -= 1
        self.log.append((i, nb, old_nb, old_floor))

    def _undo_to(self, mark: int) -> None:
        while len(self.log) > mark:
            i, nb, old_nb, old_floor = self.log.pop()
            lo, hi = self.lo[i], self.hi[i]
            self.cuts[lo:hi - 1] += 1
            self.total[lo:hi] += self.sizes[i]
            self.floor[lo:hi] = old_floor
            self.placed[i] = False
            self.key_off[i] = self.min_off[i]
            self.min_off[nb] = old_nb
            self.key_off[nb] = old_nb

    def _candidates(self, ids: np.ndarray, sec_lo: int, sec_hi: int,
                    last_off: int, last_id: int) -> list[int]:
        """Unplaced buffers of ``ids`` that may come next, lowest offset first."""
        key_off = self.key_off[ids]
        keep = key_off < self._BIG
        ids, key_off = ids[keep], key_off[keep]
        if not len(ids):
            return []
        # Dominance, and the monotone floor: placing at x lifts every section
        # of the piece to x, and its remaining total must still fit above.
        limit = min(int((key_off + self.sizes[ids]).min()),
                    self.capacity - int(self.total[sec_lo:sec_hi].max()) + 1)
        keys = key_off * (self.n + 1) + ids
        ok = (key_off < limit) & (keys > last_off * (self.n + 1) + last_id)
        return ids[ok][np.argsort(keys[ok], kind="stable")].tolist()

    def _lowest(self, sec_lo: int, sec_hi: int) -> np.ndarray:
        """Per section of [sec_lo, sec_hi): the lowest offset of its unplaced buffers (BIG if none).

        Every section of a piece has members (an empty section is a piece of
        its own), so no reduceat segment is empty.
        """
        starts = self.section_starts
        flat_lo = starts[sec_lo]
        flat_hi = starts[sec_hi] if sec_hi < len(starts) else len(self.section_members)
        values = self.key_off[self.section_members[flat_lo:flat_hi]]
        return np.minimum.reduceat(values, starts[sec_lo:sec_hi] - flat_lo)

    def _solve_pieces(self, ids: np.ndarray, sec_lo: int, sec_hi: int,
                      last_off: int, last_id: int) -> str:
        """Solve the unplaced buffers of ``ids`` (sections [sec_lo, sec_hi)) piece by piece.

        A boundary no unplaced buffer crosses splits the problem: the pieces on
        either side share no buffer, so each is solved on its own (a failure in
        one never re-opens the choices made in another).
        """
        ids = ids[~self.placed[ids]]
        cut_at = np.flatnonzero(self.cuts[sec_lo:sec_hi - 1] == 0) + sec_lo + 1
        if not len(cut_at):
            return self._dfs(ids, sec_lo, sec_hi, last_off, last_id)
        bounds = np.concatenate(([sec_lo], cut_at, [sec_hi]))
        piece = np.searchsorted(cut_at, self.lo[ids], side="right")
        for p in range(len(bounds) - 1):
            members = ids[piece == p]
            if len(members):
                status = self._dfs(members, int(bounds[p]), int(bounds[p + 1]), last_off, last_id)
                if status != FOUND:
                    return status
        return FOUND

    def _dfs(self, ids: np.ndarray, sec_lo: int, sec_hi: int, last_off: int, last_id: int) -> str:
        """Place every buffer of ``ids`` (all unplaced, within sections [sec_lo, sec_hi))."""
        capacity = self.capacity
        remaining = len(ids)
        # Each frame: [candidates, next position, log mark of the child tried last]
        stack = [[self._candidates(ids, sec_lo, sec_hi, last_off, last_id), 0, None]]
        while stack:
            frame = stack[-1]
            if frame[2] is not None:
                self._undo_to(frame[2])
                frame[2] = None
                remaining += 1
            if frame[1] >= len(frame[0]):
                stack.pop()
                continue
            self.nodes += 1
            if (self.node_limit is not None and self.nodes > self.node_limit) or \
                    (self.deadline is not None and self.nodes % 64 == 0
                     and time.monotonic() > self.deadline):
                return LIMIT
            i = frame[0][frame[1]]
            frame[1] += 1
            off = int(self.min_off[i])
            if off + int(self.sizes[i]) > capacity:
                continue
            frame[2] = len(self.log)
            self._place(i)
            remaining -= 1
            if remaining == 0:
                return FOUND
            # Every section must still hold what is left to place in it, above
            # the highest of: its placed tops, the monotone floor ``off``, and
            # the lowest offset any of its unplaced buffers can still take.
            need = (np.maximum(np.maximum(self.floor[sec_lo:sec_hi], off),
                               np.minimum(self._lowest(sec_lo, sec_hi), capacity))
                    + self.total[sec_lo:sec_hi])
            if int(need.max()) > capacity:
                continue
            if np.any(self.cuts[self.lo[i]:self.hi[i] - 1] == 0):
                status = self._solve_pieces(ids, sec_lo, sec_hi, off, i)
                if status != INFEASIBLE:
                    return status
                continue
            children = self._candidates(ids, sec_lo, sec_hi, off, i)
            if children:
                stack.append([children, 0, None])
        return INFEASIBLE


def _luby(i: int) -> int:
    """The i-th term (i >= 1) of the Luby sequence 1 1 2 1 1 2 4 1 1 2 ...: restart lengths
    within a log factor of the best fixed restart length for heavy-tailed searches."""
    while True:
        k = (i + 1).bit_length() - 1          # largest k with 2**k - 1 <= i
        if i == (1 << k) - 1:
            return 1 << (k - 1)
        i -= (1 << k) - 1                     # recurse into the copy of the prefix


# Capacities tried, as multiples of the lower bound (only those below the incumbent).
RUNGS = (1.0, 1.01, 1.025, 1.05, 1.075, 1.1, 1.15, 1.2, 1.3, 1.5, 2.0)


def improve_by_search(inst: Instance, offsets: list[int], deadline: float,
                      seed: int = 0) -> tuple[list[int], int, int]:
    """Lower the arena of a valid plan by canonical search until ``deadline``.

    Runs short searches (restarts with Luby-sequence node budgets), each for one
    capacity below the incumbent's arena (cycling through :data:`RUNGS` times
    the lower bound) and one preorder (cycling through :data:`PREORDERS` and
    random mixes of their keys).  Such searches have heavy-tailed run times:
    one order finds a plan in a few hundred nodes where another never does,
    so many short tries beat one long one.  A capacity a search exhausts is
    infeasible, which raises the proven bound.  Returns ``(offsets, bound, nodes)``.
    """
    rng = np.random.default_rng(seed)
    best, high = list(offsets), inst.arena(offsets)
    low = inst.lower_bound
    keys = _preorder_keys(inst)
    nodes, tries = 0, 0
    fixed = [CanonicalSearch(inst, preorder(inst, name)) for name in PREORDERS]
    while low < high and time.monotonic() < deadline:
        # Capacities: the bound; a quarter and half of the way up to the
        # incumbent (a success cuts the gap a lot); and 2 % below the incumbent
        # (a small step, found far more often when the big ones are out of reach).
        gap = high - low
        rungs = sorted({low, low + gap // 4, low + gap // 2, max(low, high - high // 50)} - {high})
        capacity = rungs[tries % len(rungs)]
        # Cycle through the fixed preorders and one fresh random preorder.
        slot = (tries // len(rungs)) % (len(fixed) + 1)
        search = fixed[slot] if slot < len(fixed) else \
            CanonicalSearch(inst, _random_preorder(inst, keys, rng))
        tries += 1
        status, found = search.run(capacity, 4 * inst.n * _luby(tries), deadline)
        nodes += search.nodes
        if status == FOUND:
            best, high = found, inst.arena(found)
        elif status == INFEASIBLE:
            low = capacity + 1
    return best, low, nodes
