"""Stages ``joint`` and ``split``: activation memory (MEMO).

Needs: AOTAutograd's joint graph (``checkpoint``: Selective Checkpoint++ tags), then the
forward and backward graphs right after the min-cut partition with the values saved between
them (``SplitGraphs``).  ``classify`` finds the layers (``layers``) and classifies every saved
value (layer input, attention output, other), solves MEMO's LP for alpha and leaves fact
``activation_plan``; ``recompute`` recomputes the others token-slice-wise in the backward
(fact ``recomputed_layers``; ``token_rules`` proves which ops compute each token on its own);
``offload`` inserts the host copies and their waits.
Leaves: forward/backward graphs with ``loong_compile.ops`` offload / reload / wait calls that
the schedule stage orders inside Inductor.
"""
