"""The step's mask of masked 2D-Attention, made once and read by every masked call: the global
document ids, the blocks that hold allowed pairs, the per-step plan.
"""
