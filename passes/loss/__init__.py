"""Stage ``dynamo``: the loss.  Before the token-safety stage, ``sequence_loss`` makes
transformers' label shift and a loss's mean the sequence's (``sequence_loss.SequenceLossPass``,
under ``hp·cp > 1``); after it, last, the LM head and the token-wise loss after it are
token-chunked:

Needs: the Dynamo graph after the token-safety stage (which proved the loss, a local sum over
a global count, on the graph the user wrote).  Leaves: ``loong_compile.ops.lm_head_loss`` in
place of the projection and the loss; what it left whole, and logits that are graph outputs,
in its report.

At long sequence the logits (tokens x vocabulary, float32) are the largest tensor of a training
step.  When the loss is computed inside the compiled graph, ``lm_head.LMHeadLossPass`` rewrites
the projection to the vocabulary and the loss into one op that never holds more than one
chunk's logits (``loong_compile/ops/lm_head.py``), exact in value and gradient.  Logits that
leave the graph cannot be chunked: the pass reports what they cost and how to avoid it.
"""
