"""The ``loong`` command (``loong estimate``, ``loong plan``): ``commands`` runs them, ``parser``
reads their arguments, ``tables`` prints them.  Runs without torch or a GPU."""

from loong_compile.cli.commands import main

__all__ = ["main"]
