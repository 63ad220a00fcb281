"""Stage ``dynamo``, after the attention stage and before token safety: token mixers with a state
(the short causal convolutions of hybrid models, gated DeltaNet's recurrence, Mamba-2's selective
scan) rewritten into the exact ops of ``loong_compile/ops/scans/causal_conv.py`` and
``ops/scans/gated_scan.py``.

Needs: the Dynamo FX graph with ``example_value`` on every node, and the mesh.
Leaves: each matched call replaced by its op (fact ``base.SCAN_SITES``, whose value names the
ops): ``token_locality`` lets these ops combine tokens, as it lets the rewritten attention; what
is not matched stays for it to refuse by name.  ``regions`` is what the passes that match a
whole transformers function (``gated_delta``, ``mamba2``) share.
"""
