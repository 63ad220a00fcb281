"""Graph passes of loong_compile (installed as ``loong_compile.passes``).

``library_passes()`` lists them in pipeline order; each pass module declares its
contract in its docstring: the stage it runs at, what it matches, what it emits.
"""

from __future__ import annotations


def library_passes() -> list:
    return []
