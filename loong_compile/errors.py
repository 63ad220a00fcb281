"""Errors raised by loong_compile.

Every error names three things: the offending value, the rule it breaks and
the fix.  Raise them on every rank, before any collective is issued, so that a
bad input ends the job instead of hanging it.
"""

from __future__ import annotations


class LoongError(Exception):
    """Base class. ``LoongError(what, rule, fix)`` formats the three parts."""

    def __init__(self, what: str, rule: str | None = None, fix: str | None = None):
        self.what, self.rule, self.fix = what, rule, fix
        parts = [what]
        if rule:
            parts.append(f"rule: {rule}")
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("; ".join(parts))

    def __reduce__(self):  # survive pickling across spawned ranks
        return (type(self), (self.what, self.rule, self.fix))


class LoongConfigError(LoongError, ValueError):
    """An option or LOONG_* environment variable is unknown or has a bad value."""


class LoongMeshError(LoongError, ValueError):
    """The requested (dp, hp, cp, inner ring) grid does not fit the world."""


class LoongShapeError(LoongError, ValueError):
    """Tensor shapes, dtypes, devices or token layout (position ids) violate what 2D-Attention
    needs."""


class LoongUnsupportedError(LoongError):
    """A graph pattern (mask, dropout, ...) that cannot be computed exactly when distributed."""


class LoongRankMismatchError(LoongError, RuntimeError):
    """Ranks compiled different graphs or configs; continuing would hang or be wrong."""


class LoongTokenMixingError(LoongUnsupportedError):
    """Under hp*cp > 1, a computation mixes tokens (or decides from the sequence length) on a
    rank's local tokens, where it would differ from one process on the full sequence."""
