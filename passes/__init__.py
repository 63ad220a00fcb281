"""Graph passes of loong_compile (installed as ``loong_compile.passes``).

``library_passes()`` lists them in pipeline order.  Each pass class declares the facts it
``requires`` and ``provides`` (see ``base``); each pass module's docstring says the stage it
runs at, what it matches and what it emits.
"""

from __future__ import annotations


def library_passes() -> list:
    from loong_compile.passes.activations import ActivationsPass
    from loong_compile.passes.attention_2d import Attention2DPass
    from loong_compile.passes.checkpoint import SelectiveCheckpointPass
    from loong_compile.passes.comm_overlap import CommOverlapPass
    from loong_compile.passes.loss.lm_head import LMHeadLossPass
    from loong_compile.passes.memory_plan import MemoryPlanPass
    from loong_compile.passes.offload import OffloadPass
    from loong_compile.passes.recompute import TokenSliceRecomputePass
    from loong_compile.passes.token_locality import TokenLocalityPass

    return [
        Attention2DPass(),
        TokenLocalityPass(),
        LMHeadLossPass(),
        SelectiveCheckpointPass(),
        ActivationsPass(),
        TokenSliceRecomputePass(),
        OffloadPass(),
        CommOverlapPass(),
        MemoryPlanPass(),
    ]
