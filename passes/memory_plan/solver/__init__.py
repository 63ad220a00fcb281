"""The memory plan's solver: offline Dynamic Storage Allocation (MEMO section 4.2), no torch.

``plan(buffers)`` gives every buffer a byte offset (greedy, canonical tree
search, then the MIP in pyomo + HiGHS); ``plan_bilevel(buffers)`` does it per
transformer layer first and then with layers as blocks; ``plan_pools(buffers,
backgrounds)`` splits a graph's buffers into pools over time so that the
graph's peak memory never rises above allocating each buffer on its own.
Every plan returned has passed ``verify``.  ``draw_plan`` pictures one.
"""

from loong_compile.passes.memory_plan.solver.bilevel import BilevelPlan, plan_bilevel
from loong_compile.passes.memory_plan.solver.draw import draw_plan
from loong_compile.passes.memory_plan.solver.pools import PoolPlan, plan_pools
from loong_compile.passes.memory_plan.solver.problem import (
    Buffer, LoongPlanError, LoongPlanOverlapError, MemoryPlan, lower_bound, verify,
)
from loong_compile.passes.memory_plan.solver.solve import plan

Plan = MemoryPlan  # the name before stop 29; estimate's ranking had it too

__all__ = [
    "BilevelPlan", "Buffer", "LoongPlanError", "LoongPlanOverlapError", "MemoryPlan", "Plan", "PoolPlan",
    "draw_plan", "lower_bound", "plan", "plan_bilevel", "plan_pools", "verify",
]
