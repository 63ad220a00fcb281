"""Stage ``dynamo``: the loss.  Before the token-safety stage, ``sequence_loss`` makes
transformers' label shift and a loss's mean the sequence's (``sequence_loss.SequenceLossPass``,
under ``hp·cp > 1``).

Needs: the Dynamo graph as the attention stage left it.  Leaves: ``ops.sequence``'s
``next_token_labels`` and ``sequence_label_count`` in place of the shift and the mean, which
the token-safety stage then proves (a local sum over a global count).  The LM head and the
loss after it are token-chunked later, by the tiling stage (``passes/tiling/lm_head.py``).
"""
