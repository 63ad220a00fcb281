"""Stage ``dynamo``, after attention and the scans: token safety -- under ``hp*cp > 1`` nothing
but the rewritten attention and scans may combine a rank's tokens.

Needs: fact ``attention_sites`` (the attention stage rewrote every attention call), and
``scan_sites`` where the scans ran; their values are the ops those rewrites emit, the only ones
allowed to combine tokens (``base.exact_mixers``).
Leaves: nothing in the graph; a ``LoongTokenMixingError`` on every rank before any collective
for what mixes tokens unproven.  ``token_locality`` is the pass; the analysis it runs is shared
with the tiling stage and lives in ``passes/fx/``: ``token_analysis`` (what mixes tokens),
``token_ops`` (the rule each op falls under), ``row_permutation`` (a sort of the rows proven
undone, as in a mixture of experts' dispatch) and ``row_ops`` (which ops treat every row alike).
"""
