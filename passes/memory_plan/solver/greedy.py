"""Greedy plans: best-fit (or first-fit) placement over live ranges in a given order.

Each buffer, in turn, goes into a free gap among the already placed buffers
whose live ranges overlap its own: the smallest gap it fits (best fit) or the
lowest (first fit), else on top.  The result depends strongly on the order, so
:func:`greedy_plan` tries several classic orders and keeps the lowest arena.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loong_compile.passes.memory_plan.solver.problem import Instance


def place_in_order(inst: Instance, order: Sequence[int], best_fit: bool = True) -> list[int]:
    """Offsets (units) from placing the buffers of ``inst`` one by one in ``order``."""
    sizes, overlaps = inst.sizes, inst.overlaps
    offsets = [0] * inst.n
    placed = [False] * inst.n
    for i in order:
        size = sizes[i]
        taken = sorted((offsets[j], offsets[j] + sizes[j]) for j in overlaps[i] if placed[j])
        choice, choice_gap, top = None, None, 0
        for lo, hi in taken:
            gap = lo - top
            if gap >= size and (choice is None or (best_fit and gap < choice_gap)):
                choice, choice_gap = top, gap
                if not best_fit:
                    break
            top = max(top, hi)
        offsets[i] = top if choice is None else choice
        placed[i] = True
    return offsets


def _orders(inst: Instance) -> dict[str, list[int]]:
    """Named placement orders (all deterministic)."""
    s, lo, hi, crowd = inst.sizes, inst.starts, inst.ends, inst.crowd
    keys: dict[str, Callable[[int], tuple]] = {
        "size": lambda k: (-s[k], lo[k] - hi[k], k),
        "length": lambda k: (lo[k] - hi[k], -s[k], k),
        "area": lambda k: (-s[k] * (hi[k] - lo[k]), k),
        "crowd": lambda k: (-crowd[k], -s[k], lo[k] - hi[k], k),
        "start": lambda k: (lo[k], -s[k], k),
    }
    return {name: sorted(range(inst.n), key=key) for name, key in keys.items()}


def greedy_plan(inst: Instance) -> tuple[list[int], str]:
    """The lowest-arena greedy plan over several orders and both fit rules.

    Returns the offsets (units) and the name of the order/rule that won.
    """
    best, best_name = [0] * inst.n, "empty"
    best_arena = None
    for name, order in _orders(inst).items():
        for best_fit in (True, False):
            offsets = place_in_order(inst, order, best_fit)
            arena = inst.arena(offsets)
            if best_arena is None or arena < best_arena:
                best, best_arena = offsets, arena
                best_name = f"greedy ({'best' if best_fit else 'first'} fit by {name})"
            if best_arena == inst.lower_bound:
                return best, best_name
    return best, best_name
