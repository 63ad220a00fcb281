"""The DSA mixed-integer program of MEMO section 4.2, in pyomo, solved by HiGHS.

    min M
    s.t. A_i + S_i <= M                               every buffer i
         A_i + S_i <= A_j + z_ij * U                  every pair (i, j) live at a common step
         A_j + S_j <= A_i + (1 - z_ij) * U
         L <= M <= U,  A_i >= 0,  z_ij binary

``A_i`` is buffer i's address, ``z_ij = 0`` puts i below j.  Departures from
the paper's text, all of which keep its optimum:

* ``U``, the big-M, is the arena of the incumbent (heuristic) plan, not the
  device capacity: no better plan puts anything above it, and a small big-M
  makes a much tighter LP relaxation.  ``L``, the lower bound (largest total
  live at one step), bounds ``M`` from below for the same reason.
* Identical buffers (same size and live range) are interchangeable, so their
  order is fixed by index (``z_ij = 0``, no binary), which removes the
  symmetric copies of every solution.
* The model is warm-started with the incumbent: every variable, ``z`` included,
  is set consistently, which HiGHS needs to accept the start.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict

from loong_compile.passes.memory_plan.solver.problem import Instance


@dataclasses.dataclass(frozen=True)
class MipResult:
    """What the MIP returned: ``status`` is "optimal", "time_limit" or "error"."""

    status: str
    offsets: list[int] | None   # a valid plan (units), None if the solver gave none
    bound: int                  # proven lower bound on the arena (units)
    solve_time: float
    message: str = ""


def identical_chains(inst: Instance) -> dict[tuple[int, int], bool]:
    """Overlapping pairs ``(i, j)``, ``i < j``, of identical buffers: i is put below j."""
    groups = defaultdict(list)
    for k in range(inst.n):
        groups[(inst.sizes[k], inst.starts[k], inst.ends[k])].append(k)
    fixed = {}
    for members in groups.values():
        for a, i in enumerate(members):
            for j in members[a + 1:]:
                fixed[(i, j)] = True
    return fixed


def _symmetric_start(inst: Instance, offsets: list[int]) -> list[int]:
    """The same plan with identical buffers swapped so that offsets grow with index."""
    groups = defaultdict(list)
    for k in range(inst.n):
        groups[(inst.sizes[k], inst.starts[k], inst.ends[k])].append(k)
    out = list(offsets)
    for members in groups.values():
        for k, off in zip(members, sorted(offsets[m] for m in members)):
            out[k] = off
    return out


def _make_solver(time_limit: float):
    """HiGHS through pyomo's appsi interface (highspy), configured for one solve."""
    from pyomo.contrib.appsi.solvers import Highs

    solver = Highs()
    if not solver.available():
        raise RuntimeError("pyomo's appsi HiGHS interface reports highspy unavailable")
    solver.config.time_limit = time_limit
    solver.config.load_solution = False
    solver.config.warmstart = True
    solver.config.stream_solver = False
    # The objective is integral at every vertex: a gap below one unit is a proof.
    solver.highs_options = {"mip_rel_gap": 0.0, "mip_abs_gap": 1.0 - 1e-6}
    return solver


def solve_mip(inst: Instance, incumbent: list[int], time_limit: float) -> MipResult:
    """Solve the DSA MIP of ``inst`` within ``time_limit`` seconds, warm-started."""
    import pyomo.environ as pyo

    t0 = time.monotonic()
    n, sizes = inst.n, inst.sizes
    start = _symmetric_start(inst, incumbent)
    upper, lower = inst.arena(start), inst.lower_bound
    fixed = identical_chains(inst)
    free_pairs = [p for p in inst.pairs if p not in fixed]

    m = pyo.ConcreteModel()
    m.A = pyo.Var(range(n), domain=pyo.NonNegativeReals,
                  bounds=lambda _, i: (0, upper - sizes[i]))
    m.M = pyo.Var(domain=pyo.Reals, bounds=(lower, upper))
    m.z = pyo.Var(range(len(free_pairs)), domain=pyo.Binary)
    m.obj = pyo.Objective(expr=m.M, sense=pyo.minimize)
    m.peak = pyo.Constraint(range(n), rule=lambda m, i: m.A[i] + sizes[i] <= m.M)
    m.below = pyo.Constraint(range(len(free_pairs)), rule=lambda m, p: (
        m.A[free_pairs[p][0]] + sizes[free_pairs[p][0]]
        <= m.A[free_pairs[p][1]] + m.z[p] * upper))
    m.above = pyo.Constraint(range(len(free_pairs)), rule=lambda m, p: (
        m.A[free_pairs[p][1]] + sizes[free_pairs[p][1]]
        <= m.A[free_pairs[p][0]] + (1 - m.z[p]) * upper))
    fixed_list = sorted(fixed)
    m.chain = pyo.Constraint(range(len(fixed_list)), rule=lambda m, p: (
        m.A[fixed_list[p][0]] + sizes[fixed_list[p][0]] <= m.A[fixed_list[p][1]]))

    for i in range(n):
        m.A[i].set_value(start[i])
    m.M.set_value(upper)
    for p, (i, j) in enumerate(free_pairs):
        m.z[p].set_value(0 if start[i] + sizes[i] <= start[j] else 1)

    # Hand the model to HiGHS first: translating it takes about as long as
    # building it, and must not eat into the solver's own time limit.
    solver = _make_solver(time_limit)
    solver.set_instance(m)
    solver.config.time_limit = max(time_limit - (time.monotonic() - t0), 0.01)
    results = solver.solve(m)
    status = results.termination_condition.name
    bound = lower
    if results.best_objective_bound is not None and math.isfinite(results.best_objective_bound):
        bound = max(lower, math.ceil(results.best_objective_bound - 1e-6))
    offsets = None
    if results.best_feasible_objective is not None:
        results.solution_loader.load_vars()
        offsets = inst.compact([m.A[i].value for i in range(n)])
    if status == "optimal":
        bound = inst.arena(offsets) if offsets is not None else bound
        return MipResult("optimal", offsets, bound, time.monotonic() - t0)
    if status in ("maxTimeLimit", "maxIterations", "objectiveLimit"):
        return MipResult("time_limit", offsets, bound, time.monotonic() - t0)
    return MipResult("error", offsets, bound, time.monotonic() - t0,
                     f"HiGHS ended with {status}")
