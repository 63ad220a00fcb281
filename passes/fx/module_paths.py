"""Where a node came from: its source line, and the ``nn_module_stack`` module paths Dynamo
records: one parser for all of them (``parse_module_path``), the walk along one
(``follow_module_path``), the names from the root module (``module_path_parts``) and the layer
(the outermost element of a ModuleList)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

# A module path is Dynamo's name for where the traced code found the module (a Python expression,
# torch/_dynamo/source.py): a local or a global (``L['self']``; ``L['args'][0]`` when transformers
# wraps ``forward``; ``G['model']`` or ``L['model']`` for a step function that calls the model),
# then the attributes and items the code took, ``._modules['x']`` written ``.x``
# (``record_nn_module_stack``).  Everything else stays as the code reached it: PEFT's
# ``__getattr__`` forwarding makes ``L['self'].__dict__['_modules']['base_model']``, a user's list
# or dict of blocks ``.blocks[0]`` / ``.blocks['a']``, a name that is no identifier
# ``getattr(L['self'], 'blk-1')``, a dict subclass's item ``dict.__getitem__(L['self'].d,
# list(dict.keys(L['self'].d))[0])``.  A step is ("attr", name), ("item", key), ("at", i): the
# i-th element iterated, or ("key_at", i): the item of the i-th key.
Step = tuple[str, Any]
# where a module keeps its registered children: a path through them names the child alone
_REGISTRIES = frozenset({"__dict__", "_modules", "_parameters", "_buffers"})
_LITERAL = re.compile(r"""-?\d+|'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*\"""")
_MEMBER = re.compile(r"[^.\[\](),\s]+")
_CALLS = (("getattr(", "attr"), ("dict.__getitem__(", "item"), ("list.__getitem__(", "item"))


@dataclass(frozen=True)
class ModulePath:
    """A parsed module path: the variable of the compiled frame it starts from (``scope`` "L"
    for a local, "G" for a global), the items taken of it before any attribute (``root_steps``:
    ``[0]`` of ``L['args'][0]``; they lead to the module the path starts from), then the
    ``steps`` from that module."""

    scope: str
    variable: str
    root_steps: tuple[Step, ...]
    steps: tuple[Step, ...]


def parse_module_path(path: str) -> ModulePath | None:
    """``path`` (an ``nn_module_stack`` entry) parsed; None for a form Dynamo does not write for
    a module."""
    try:
        scope, variable, steps, end = _expression(path, 0)
    except _NotAPath:
        return None
    if end != len(path):
        return None
    leading = next((k for k, (kind, _) in enumerate(steps) if kind != "item"), len(steps))
    return ModulePath(scope, variable, tuple(steps[:leading]), tuple(steps[leading:]))


def follow_module_path(start: Any, steps: Iterable[Step]) -> Any:
    """The object ``steps`` lead to from ``start``, taken as the traced code took it; None where
    a step leads nowhere."""
    value = start
    for kind, key in steps:
        try:
            if kind == "attr":
                value = getattr(value, key)
            elif kind == "item":
                value = value[key]
            elif kind == "at":
                value = list(value)[key]
            else:
                value = value[list(value.keys())[key]]
        except (AttributeError, LookupError, TypeError):
            return None
    return value


class _NotAPath(ValueError):
    pass


def _expression(text: str, at: int) -> tuple[str, str, list[Step], int]:
    """The source expression at ``at``: (scope, variable, steps, where it ends)."""
    for call, kind in _CALLS:
        if text.startswith(call, at):
            scope, variable, steps, at = _expression(text, at + len(call))
            at = _expect(text, at, ", ")
            if kind == "attr":
                name, at = _literal(text, at)
                step: Step = ("attr", name)
            else:
                step, at = _index(text, at)
            return _suffixes(text, _expect(text, at, ")"), scope, variable, [*steps, step])
    if text.startswith("list(", at) and not text.startswith("list(dict.keys(", at):
        scope, variable, steps, at = _expression(text, at + len("list("))
        index, at = _literal(text, _expect(text, at, ")["))
        return _suffixes(text, _expect(text, at, "]"), scope, variable, [*steps, ("at", index)])
    scope = text[at:at + 1]
    if scope not in ("L", "G") or not text.startswith("[", at + 1):
        raise _NotAPath(text)
    variable, at = _literal(text, at + 2)
    return _suffixes(text, _expect(text, at, "]"), scope, str(variable), [])


def _suffixes(text: str, at: int, scope: str, variable: str,
              steps: list[Step]) -> tuple[str, str, list[Step], int]:
    """``.member`` and ``[index]`` after an expression, as many as there are."""
    while at < len(text) and text[at] in ".[":
        if text[at] == ".":
            member = _MEMBER.match(text, at + 1)
            if member is None:
                raise _NotAPath(text)
            steps.append(("attr", member.group()))
            at = member.end()
        else:
            step, at = _index(text, at + 1)
            steps.append(step)
            at = _expect(text, at, "]")
    return scope, variable, steps, at


def _index(text: str, at: int) -> tuple[Step, int]:
    """A literal key, or ``list(dict.keys(X))[i]``: the i-th key of the dict indexed."""
    if text.startswith("list(dict.keys(", at):
        *_, at = _expression(text, at + len("list(dict.keys("))
        index, at = _literal(text, _expect(text, at, "))["))
        return ("key_at", index), _expect(text, at, "]")
    key, at = _literal(text, at)
    return ("item", key), at


def _literal(text: str, at: int) -> tuple[Any, int]:
    found = _LITERAL.match(text, at)
    if found is None:
        raise _NotAPath(text)
    return ast.literal_eval(found.group()), found.end()


def _expect(text: str, at: int, token: str) -> int:
    if not text.startswith(token, at):
        raise _NotAPath(text)
    return at + len(token)


def module_path(node: torch.fx.Node) -> str:
    """The innermost module path on ``node``'s ``nn_module_stack`` as Dynamo wrote it."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path, _ = list(stack.values())[-1]
    return str(path)


def source_line(node: torch.fx.Node) -> str:
    """The innermost frame of the node's stack trace outside torch itself, and its code."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [(lines[i], lines[i + 1] if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].startswith("File ")]
    outside = [f for f in frames if _TORCH_DIR not in f[0]] or frames
    return f"{outside[-1][0]}: {outside[-1][1]}".strip() if outside else "<unknown source>"


_TORCH_DIR = str(Path(torch.__file__).parent)


def module_path_parts(path: str) -> list[str]:
    """The names from the module the path starts from to the module at ``path``, as
    ``named_modules`` names them (``L['self'].layers[3]._modules['mlp']`` -> ``['layers', '3',
    'mlp']``; PEFT's ``L['self'].__dict__['_modules']['base_model'].model`` -> ``['base_model',
    'model']``); an element a loop took is named by its position; [] for what is no path."""
    parsed = parse_module_path(path)
    if parsed is None:
        return []
    names = (str(key) for _, key in parsed.steps)
    return [name for name in names if name not in _REGISTRIES]


def normalize_module_path(path: str) -> str:
    """Dynamo's module path (``L['self'].layers[3]._modules['mlp']``) as ``layers.3.mlp``."""
    return ".".join(module_path_parts(path))


def layer_of_paths(paths: Iterable[str]) -> str | None:
    """The transformer layer on one module stack (outer to inner): the outermost element of a
    ModuleList or Sequential, e.g. ``layers.0`` or ``model.layers.3``; None outside every layer."""
    for path in paths:
        parts = module_path_parts(path)
        index = next((k for k, part in enumerate(parts) if k > 0 and part.isdigit()), None)
        if index is not None:
            return ".".join(parts[:index + 1])
    return None
