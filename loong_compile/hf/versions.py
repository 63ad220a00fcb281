"""The transformers releases this package is tested with, and a warning outside them.

The backend reads transformers' model, mask and loss code as a graph, so a release can change
what it sees (5.25 did: docs/compat.md, "transformers").  The range is written once, in
``pyproject.toml`` (the ``hf`` extra: the oldest and the newest release CI runs); this module
reads it back from the installed package's metadata.  A transformers outside it warns once per
process, naming the range; from a source tree that is not installed there is no range to read,
and nothing is said.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import warnings

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DISTRIBUTION = "loong-compile"


@functools.cache
def tested_range() -> SpecifierSet | None:
    """The transformers versions of the installed package's ``hf`` extra, or None."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == "transformers" and requirement.marker is not None \
                and requirement.marker.evaluate({"extra": "hf"}):
            return requirement.specifier
    return None


_warned: list[str] = []   # the one warning of this process, once given


def warn_if_untested() -> str | None:
    """Once per process, where transformers is imported: a ``UserWarning`` if its version is
    outside ``tested_range()``; the message, or None."""
    module = sys.modules.get("transformers")
    tested = tested_range()
    if module is None or tested is None or _warned:
        return None
    version = Version(getattr(module, "__version__", "0"))
    if tested.contains(version, prereleases=True):
        return None
    uppers = [Version(spec.version) for spec in tested if spec.operator.startswith("<")]
    newer = all(upper <= version for upper in uppers)
    message = (f"loong_compile: transformers {version} is {'newer than' if newer else 'outside'} "
               f"the releases it is tested with ({tested}): the backend reads transformers' model "
               "code as a graph, and a release can change what it sees (refused cases, or a "
               "rewrite that no longer matches). See docs/compat.md, 'transformers'.")
    _warned.append(message)
    warnings.warn(message, UserWarning, stacklevel=3)
    return message
