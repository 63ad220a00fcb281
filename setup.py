"""The package list, discovered: pyproject.toml holds everything else.

setuptools' ``packages.find`` cannot install a folder under another name, and the top-level
``passes/`` folder installs as ``loong_compile.passes``, so the list is computed here: every
package below ``loong_compile/`` and below ``passes/``.  A new folder with an ``__init__.py``
is installed without editing anything (tests/test_wheel.py checks the wheel holds them all).
"""

from setuptools import find_packages, setup

PASSES = "loong_compile.passes"

setup(
    packages=find_packages(include=["loong_compile", "loong_compile.*"])
    + [PASSES]
    + [f"{PASSES}.{name}" for name in find_packages("passes")],
    package_dir={PASSES: "passes"},
)
