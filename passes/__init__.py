"""Graph passes of loong_compile (installed as ``loong_compile.passes``), one subpackage per
stage of the pipeline, in the order they run:

=====================  ==========================  =====================================
subpackage             stage(s)                    what it does
=====================  ==========================  =====================================
``attention``          dynamo                      attention calls -> 2D-Attention
``loss``               dynamo                      the label shift and a loss's mean ->
                                                   the sequence's
``scans``              dynamo                      short convolutions, gated DeltaNet,
                                                   Mamba-2 -> exact ops across ranks
``safety``             dynamo                      nothing else mixes a rank's tokens
``tiling``             dynamo                      token-local regions (an MLP, the LM head
                                                   and its loss) a tile of tokens at a time
``activations``        joint, split                checkpoint / offload / token-slice
                                                   recompute (MEMO)
``schedule``           post_grad, schedule         when exchanges and host copies start
                                                   and are waited on
``memory_plan``        inductor                    static offsets of Inductor's buffers
=====================  ==========================  =====================================

``base`` holds the stages, the pass contract and the facts several stage folders name; ``fx``
the FX facts the stages share (node readers, op-name sets, walks, module paths, emitting
calls).  A stage folder imports from these and from ``loong_compile``, never from another
stage folder.  Each pass class declares the facts it ``requires``, ``provides`` and
``uses`` (checked when the backend assembles the pipeline); each subpackage's docstring says
what its stage needs from earlier ones and leaves for later ones.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def library_passes() -> list:
    """The library's passes, in pipeline order; each decides from the config whether it applies."""
    from loong_compile.passes.activations.checkpoint import SelectiveCheckpointPass
    from loong_compile.passes.activations.classify import ActivationsPass
    from loong_compile.passes.activations.offload import OffloadPass
    from loong_compile.passes.activations.recompute import TokenSliceRecomputePass
    from loong_compile.passes.attention.attention_2d import Attention2DPass
    from loong_compile.passes.attention.eager_attention import EagerAttentionPass
    from loong_compile.passes.attention.made_positions import MadePositionsPass
    from loong_compile.passes.loss.sequence_loss import SequenceLossPass
    from loong_compile.passes.memory_plan.plan_pass import MemoryPlanPass
    from loong_compile.passes.safety.checkpoint_breaks import CheckpointBreakPass
    from loong_compile.passes.safety.token_locality import TokenLocalityPass
    from loong_compile.passes.scans.causal_conv import CausalConvPass
    from loong_compile.passes.scans.gated_delta import GatedDeltaPass
    from loong_compile.passes.scans.mamba2 import Mamba2Pass
    from loong_compile.passes.schedule.comm_overlap import CommOverlapPass
    from loong_compile.passes.schedule.exchange_order import ExchangeOrderPass
    from loong_compile.passes.schedule.prefetch_order import PrefetchOrderPass
    from loong_compile.passes.tiling.lm_head import LMHeadLossPass
    from loong_compile.passes.tiling.regions import TokenTilingPass

    return [
        # dynamo
        CheckpointBreakPass(),   # first: a graph cut at checkpointing is refused as it is
        EagerAttentionPass(),
        Attention2DPass(),
        MadePositionsPass(),
        SequenceLossPass(),
        CausalConvPass(),
        GatedDeltaPass(),
        Mamba2Pass(),
        TokenLocalityPass(),
        LMHeadLossPass(),
        TokenTilingPass(),
        # joint, split
        SelectiveCheckpointPass(),
        ActivationsPass(),
        TokenSliceRecomputePass(),
        OffloadPass(),
        # post_grad, schedule
        CommOverlapPass(),
        ExchangeOrderPass(),     # first at its stage: it orders Inductor's nodes as they came
        PrefetchOrderPass(),
        # inductor
        MemoryPlanPass(),
    ]


@functools.lru_cache(maxsize=1)
def library_source_digest() -> str:
    """One hash of every .py file of loong_compile and its passes: part of every cache key of
    code our hooks generate (a change to a pass or an op is a cache miss)."""
    import loong_compile

    roots = {Path(loong_compile.__file__).parent, Path(__file__).parent}
    h = hashlib.sha256()
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()
