"""MEMO's alpha: the fraction of each "other" skeletal activation's tokens to swap to host.

MEMO (§4.1, eqs. 1-3), per transformer layer::

    max  alpha
    s.t. (S_input + S_attn + alpha * S_other) / B <= T_layer          (the copy hides behind compute)
         (n - 2) * (S_input + S_attn + alpha * S_other) <= M_CPU      (host memory holds it)
         0 <= alpha <= 1

``n - 2``: the last two layers start their backward right after their forward and are not
swapped; here that count is ``resident_layers`` (default 2).  The LP is solved with pyomo +
HiGHS, the planner's solver stack.  ``B``, ``T_layer`` and ``M_CPU`` come from options or are
measured at compile time (``passes/activations/measure.py``, which also makes ranks agree on
them).  No torch here: the LP runs in ``loong plan`` too.
"""

from __future__ import annotations

import dataclasses
import time

_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class AlphaInputs:
    """The LP's inputs.  Bytes are per transformer layer (one rank's share)."""

    s_input: int
    s_attention: int
    s_other: int
    layers: int                 # n
    resident_layers: int        # layers never swapped (MEMO: 2)
    bandwidth: float            # B, bytes/s
    layer_time: float           # T_layer, seconds
    host_memory: float          # M_CPU, bytes

    @property
    def swapped_layers(self) -> int:
        return max(self.layers - self.resident_layers, 0)

    def transfer_bytes(self, alpha: float) -> float:
        """Bytes one swapped layer sends to the host at ``alpha``."""
        return self.s_input + self.s_attention + alpha * self.s_other


@dataclasses.dataclass(frozen=True)
class AlphaDecision:
    """The chosen alpha, how it was chosen and what it costs."""

    alpha: float
    feasible: bool              # both budgets hold at ``alpha``
    binding: str                # the constraint that limits alpha (or why there is none)
    transfer_seconds: float     # per swapped layer, at alpha
    host_bytes: float           # all swapped layers, at alpha
    message: str
    solve_seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _budgets(inputs: AlphaInputs, alpha: float) -> tuple[float, float]:
    """(copy time, host bytes) at ``alpha``."""
    per_layer = inputs.transfer_bytes(alpha)
    return per_layer / inputs.bandwidth, inputs.swapped_layers * per_layer


def evaluate_alpha(inputs: AlphaInputs, alpha: float, how: str = "forced by the alpha option") -> AlphaDecision:
    """The decision record for a given ``alpha`` (a forced one): which budgets it keeps."""
    seconds, host = _budgets(inputs, alpha)
    over = [name for name, ok in (("bandwidth", seconds <= inputs.layer_time * (1 + 1e-9)),
                                  ("host_memory", host <= inputs.host_memory * (1 + 1e-9))) if not ok]
    message = (f"alpha={alpha:g} {how}; " + ("both budgets hold" if not over else
               f"exceeds the {' and '.join(over)} budget: copies may stall compute or fill host memory"))
    return AlphaDecision(alpha, not over, how, seconds, host, message)


def solve_alpha(inputs: AlphaInputs, time_limit: float = 10.0) -> AlphaDecision:
    """Solve MEMO's LP.  Infeasible even at alpha=0 -> ``feasible=False`` and alpha=0 with a
    message naming the budget that swapping inputs and attention outputs alone exceeds (the
    caller then degrades to full recompute without offload)."""
    if inputs.swapped_layers == 0:
        return AlphaDecision(1.0, True, "no layer is swapped", 0.0, 0.0,
                             f"all {inputs.layers} layers are resident (resident_layers="
                             f"{inputs.resident_layers}): nothing goes to the host")
    import pyomo.environ as pyo

    start = time.perf_counter()
    # Scale bytes to O(1) so HiGHS sees well-conditioned coefficients.
    scale = float(max(inputs.s_input + inputs.s_attention + inputs.s_other, 1))
    fixed = (inputs.s_input + inputs.s_attention) / scale
    other = inputs.s_other / scale
    m = pyo.ConcreteModel()
    m.alpha = pyo.Var(bounds=(0.0, 1.0))
    m.objective = pyo.Objective(expr=m.alpha, sense=pyo.maximize)
    m.bandwidth = pyo.Constraint(expr=fixed + other * m.alpha <= inputs.bandwidth * inputs.layer_time / scale)
    m.host_memory = pyo.Constraint(
        expr=inputs.swapped_layers * (fixed + other * m.alpha) <= inputs.host_memory / scale)
    solver = pyo.SolverFactory("highs")
    solver.config.time_limit = time_limit
    result = solver.solve(m, load_solutions=False)
    seconds = time.perf_counter() - start
    if result.solver.termination_condition != pyo.TerminationCondition.optimal:
        base_time, base_host = _budgets(inputs, 0.0)
        over = []
        if base_time > inputs.layer_time:
            over.append(f"bandwidth budget (copy {base_time:.3g} s > layer time {inputs.layer_time:.3g} s)")
        if base_host > inputs.host_memory:
            over.append(f"host memory budget ({base_host:.4g} B > {inputs.host_memory:.4g} B)")
        reason = " and the ".join(over) or str(result.solver.termination_condition)
        return AlphaDecision(0.0, False, "infeasible", base_time, base_host,
                             "swapping layer inputs and attention outputs alone already exceeds the "
                             f"{reason}; the policy degrades to full recompute without offload",
                             seconds)
    m.solutions.load_from(result)
    alpha = min(max(float(pyo.value(m.alpha)), 0.0), 1.0)
    copy_seconds, host = _budgets(inputs, alpha)
    slack = {"bandwidth": 1 - copy_seconds / inputs.layer_time,
             "host_memory": 1 - host / inputs.host_memory if inputs.host_memory > 0 else 0.0}
    tight = min(slack, key=slack.get)
    binding = tight if slack[tight] <= 1e-6 or alpha < 1 - _TOL else "alpha <= 1"
    return AlphaDecision(alpha, True, binding, copy_seconds, host,
                         f"alpha={alpha:.4g} from MEMO's LP; limited by {binding}", seconds)
