"""Runtime ops that the graph passes emit: 2D-Attention and its pieces.

Importing this package registers the custom ops ``torch.ops.loong.ring_attention_fwd``
(returns ``(out, lse)``) and ``ring_attention_bwd``, ``masked_attention_fwd`` /
``masked_attention_bwd`` with ``masked_attention_plan`` (the step's mask, made once),
``sequence_document_ids`` and ``lm_head_loss`` (the token-chunked
LM head and loss), and (``ops/sequence.py``) ``next_token_labels``, ``sequence_label_count`` and
``layout_positions``, what a rank's graph needs of the whole sequence.  ``seq_all_to_all`` is functional
collectives (``_c10d_functional``), not an op of ours; so are the scans' ``causal_conv1d`` and
``gated_scan`` (``ops/causal_conv.py``, ``ops/gated_scan.py``): torch ops around one all-gather,
traced through by AOTAutograd.
"""

from loong_compile.ops.alltoall import seq_all_to_all
from loong_compile.ops.attention import attention_2d, check_attention_inputs
from loong_compile.ops.causal_conv import causal_conv1d
from loong_compile.ops.comm import comm_counters, reset_comm_counters
from loong_compile.ops.documents import sequence_document_ids
from loong_compile.ops.gated_scan import gated_scan
from loong_compile.ops.lm_head import lm_head_loss
from loong_compile.ops.ring import merge_partial, ring_attention_bwd, ring_attention_fwd
from loong_compile.ops.sequence import layout_positions, next_token_labels, sequence_label_count
from loong_compile.ops.step_mask import masked_attention_plan

__all__ = [
    "attention_2d", "causal_conv1d", "check_attention_inputs", "comm_counters", "gated_scan",
    "layout_positions", "lm_head_loss",
    "masked_attention_plan", "merge_partial", "next_token_labels", "sequence_label_count",
    "reset_comm_counters", "ring_attention_bwd", "ring_attention_fwd", "seq_all_to_all",
    "sequence_document_ids",
]
