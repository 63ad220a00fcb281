"""Stages ``post_grad`` and ``schedule``: when communication and host transfers start and are
waited on.

Needs: Inductor's post-grad graphs with the SeqAlltoAll as functional collectives
(``comm_overlap`` raises each start to where its tensor is ready), then Inductor's scheduler
nodes before fusion (``exchange_order``: one attention call's q/k/v exchanges each after the
work only it needs; ``prefetch_order``: a layer's reloads issued together, their waits held
after them).  Leaves: an order and ordering-only dependencies that fusion respects; the
report's records say what moved.
"""
