"""The transformers releases tested (``loong_compile/hf/versions.py``): one range, written in
``pyproject.toml`` and read back from the installed metadata; CI's pins at its two ends; a
transformers outside it warned of once per process."""

from __future__ import annotations

import sys
import tomllib
import types
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from loong_compile.hf import versions

pytestmark = pytest.mark.compat
ROOT = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["optional-dependencies"]


def _transformers(requirements: list[str]) -> Requirement:
    (found,) = [r for r in map(Requirement, requirements) if r.name == "transformers"]
    return found


def _pinned(path: str) -> Version:
    (line,) = [line for line in (ROOT / path).read_text().splitlines()
               if line.startswith("transformers==")]
    return Version(line.split("==")[1])


def test_the_range_is_pyprojects_and_ci_pins_its_two_ends():
    extras = _extras()
    tested = _transformers(extras["hf"]).specifier
    assert _transformers(extras["test"]).specifier == tested
    assert versions.tested_range() == tested     # the installed metadata: this clone's
    oldest, newest = _pinned(".ci/constraints-oldest.txt"), _pinned(".ci/constraints-newest.txt")
    assert tested.contains(oldest) and tested.contains(newest)
    (lower,) = [Version(s.version) for s in tested if s.operator == ">="]
    (upper,) = [Version(s.version) for s in tested if s.operator == "<"]
    assert oldest == lower      # the oldest release the range admits is the one CI runs
    assert (newest.major, newest.minor + 1) == (upper.major, upper.minor)   # and the newest


@pytest.mark.parametrize("version, words", [
    ("5.26.0", ["transformers 5.26.0 is newer than the releases it is tested with",
                "docs/compat.md"]),
    ("5.23.1", ["transformers 5.23.1 is outside the releases it is tested with"]),
    ("5.25.0", None),
])
def test_a_transformers_outside_the_range_warns_once(monkeypatch, version, words):
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__=version))
    monkeypatch.setattr(versions, "_warned", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = versions.warn_if_untested(), versions.warn_if_untested()
    if words is None:
        assert first is None and not caught
        return
    assert second is None and len(caught) == 1 and str(caught[0].message) == first
    assert str(versions.tested_range()) in first
    for word in words:
        assert word in first
