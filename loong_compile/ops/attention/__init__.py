"""2D-Attention (LoongTrain §4): the head-parallel all-to-all, the Double-Ring and masked attention
over a CP group, the local kernels behind one adapter, sinks; ``attention_2d.attention_2d`` is the
entry point the attention pass emits.
"""
