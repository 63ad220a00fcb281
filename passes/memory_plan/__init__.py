"""Stage ``inductor``: the memory plan, static offsets for the buffers Inductor allocates
(``memory_plan=True``; docs/memory_plan.md).

Needs: Inductor's wrapper code of each compiled graph (forward, backward, inference), after
every earlier stage; ``_compat.pool_planner`` hands over its intermediates, live ranges and
allocation lines as plain data.  Leaves: each intermediate in a pool at an offset, or on its
own; the graph's inputs and outputs keep their normal allocation.  The report's record gives
the arena against the lower bound and Inductor's pools, and the peaks.

==================  =====================================================================
``plan_pass``       the pass (``MemoryPlanPass``), its report, plain Inductor's patches
``request``         ``PoolRequest``: one graph's buffers as the pass sees them, built from
                    what Inductor's wrapper shows; the hook's config patches
``background``      the bytes everything else holds at each step, replayed from the wrapper
``solver/``         the DSA solver (no torch): ``plan``, ``plan_bilevel``, ``plan_pools``,
                    ``verify``, ``draw_plan``
==================  =====================================================================
"""
