"""Stage ``dynamo``, second: token safety -- under ``hp*cp > 1`` nothing but the rewritten
attention may combine a rank's tokens.

Needs: fact ``attention_sites`` (the attention stage rewrote every attention call).
Leaves: nothing in the graph; a ``LoongTokenMixingError`` on every rank before any collective
for what mixes tokens unproven (``row_permutation`` proves a sort of the rows undone, as in a
mixture of experts' dispatch).  ``token_rules`` is also read by the activations stage's
token-slice recompute: which ops compute each token on its own.
"""
