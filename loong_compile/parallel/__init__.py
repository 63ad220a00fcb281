"""The ranks and the tokens they hold: the torch-free size and placement rules shared with the
estimator (``rules``), the device mesh and its groups (``mesh``) and the token layout
(``tokens``: ``shard_batch`` / ``gather_sequence``) and how gradients are reduced over it
(``gradients``).  Importing this package imports no torch (``rules`` stays torch-free)."""
