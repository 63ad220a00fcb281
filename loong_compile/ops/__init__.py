"""Runtime ops that the graph passes emit, grouped by what they compute:

=============  ================================================================================
``attention``  2D-Attention: the SeqAlltoAll (``alltoall``), the Double-Ring (``ring``), masked
               attention over one CP group (``masked``), the local kernels (``kernels``,
               ``flex``), sinks, and the fake kernels and autograd each op pair shares
               (``op_pair``); the entry point is ``attention_2d``
``masks``      the step's mask, made once: global document ids (``documents``), which blocks hold
               allowed pairs (``blocks``), the per-step plan every masked call reads (``step``)
``scans``      token mixers with a state, exact on a rank's tokens: ``causal_conv``,
               ``gated_scan`` (Mamba-2, gated DeltaNet) and their one all-gather (``exchange``)
``sequence``   what a rank's graph needs of the whole sequence: the next token's label, the
               sequence's label count, the layout's positions
``tiling``     token tiling: a token-local region (``region``: an MLP, recomputed per tile in
               the backward) or the LM head and its loss (``lm_head``: gradient in the
               forward) run a tile of tokens at a time
``offload``    saved activations to the host and back; ``exposure`` measures what a wait blocks
``comm``       point-to-point transfers and the byte counters of all traffic
=============  ================================================================================

Importing this package registers the custom ops (``torch.ops.loong.*``: the ring and masked
attention pairs, ``masked_attention_plan``, ``sequence_document_ids``, ``lm_head_loss``,
``tiled_region`` and its backward,
``next_token_labels``, ``sequence_label_count``, ``layout_positions``).  ``seq_all_to_all`` and
the scans are functional collectives and torch ops around them, traced through by AOTAutograd.
Runtime ops never import passes.
"""

from loong_compile.ops.attention.alltoall import seq_all_to_all
from loong_compile.ops.attention.attention_2d import attention_2d, check_attention_inputs
from loong_compile.ops.attention.ring import merge_partial, ring_attention_bwd, ring_attention_fwd
from loong_compile.ops.comm import comm_counters, reset_comm_counters
from loong_compile.ops.masks.documents import sequence_document_ids
from loong_compile.ops.masks.step import masked_attention_plan
from loong_compile.ops.scans.causal_conv import causal_conv1d
from loong_compile.ops.scans.gated_scan import gated_scan
from loong_compile.ops.sequence import layout_positions, next_token_labels, sequence_label_count
from loong_compile.ops.tiling.lm_head import lm_head_loss
from loong_compile.ops.tiling.region import tiled_region

__all__ = [
    "attention_2d", "causal_conv1d", "check_attention_inputs", "comm_counters", "gated_scan",
    "layout_positions", "lm_head_loss",
    "masked_attention_plan", "merge_partial", "next_token_labels", "sequence_label_count",
    "reset_comm_counters", "ring_attention_bwd", "ring_attention_fwd", "seq_all_to_all",
    "sequence_document_ids", "tiled_region",
]
