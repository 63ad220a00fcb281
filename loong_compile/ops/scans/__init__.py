"""Token mixers with a state (short causal convolutions, gated linear recurrences), exact on a rank's
tokens with one all-gather of their per-run summaries.
"""
