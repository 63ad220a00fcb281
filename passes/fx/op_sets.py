"""Op-name sets the stage folders share, as ``nodes.op_name`` spells a node's op.

Each is a base set; a pass that needs a wider or narrower one writes it as a named difference
of these beside its use (``tiling/lm_head.py``'s logit casts, ``fx/row_ops.py``'s casts,
``fx/token_ops.py``'s products), saying why it differs.
"""

from __future__ import annotations

# Casts to a dtype by name (``x.float()``, ``x.to(dtype)``, ``x.type(dtype)``)
DTYPE_CASTS = frozenset({"to", "type", "float", "double", "half", "bfloat16"})
# ... of them, the casts to a 16-bit float
HALF_CASTS = frozenset({"half", "bfloat16"})
INT_CASTS = frozenset({"int", "long"})
# copies that keep a value's elements, shape and dtype
COPIES = frozenset({"contiguous", "clone", "detach"})

# Views that cut a tensor's axes anew, keeping its elements in order
VIEWS = frozenset({"view", "reshape", "flatten"})
RESHAPES = VIEWS | {"unflatten", "view_as", "reshape_as"}
# views that add, drop or broadcast axes of size 1
EXPANDS = frozenset({"expand", "expand_as", "unsqueeze", "squeeze"})

# Products of two operands over the last axis of the left one
MATMULS = frozenset({"matmul", "mm"})
# ... and ``F.linear``: a value (rows) times a weight
PROJECTIONS = MATMULS | {"linear"}

LOSSES = frozenset({"cross_entropy", "nll_loss"})

# An angle (RoPE's): the op -> the place of its operand that holds the angle
ANGLES = {"cos": 0, "sin": 0, "polar": 1}

# Random ops of a Dynamo graph: each call draws anew, so a computation that runs twice (a tiled
# region recomputed in the backward) would see other numbers (``nodes.draws_random``: a dropout
# draws only with ``p > 0`` in training).
RANDOM = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                    "feature_alpha_dropout", "native_dropout", "rand", "rand_like", "randn",
                    "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
                    "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
                    "cauchy_", "log_normal_", "random_", "poisson", "rrelu"})
