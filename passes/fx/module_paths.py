"""Where a node came from: its source line, and the ``nn_module_stack`` module paths Dynamo
records (one parser for all of them; a layer is the outermost element of a ModuleList)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.fx

# Dynamo writes a module path as ``L['self'].layers[3]._modules['mlp']`` (or ``.layers.3.mlp``);
# its root is where the compiled function found the module: a local or a global, indexed or
# not (``L['self']``, ``L['args'][0]`` when transformers wraps ``forward``, ``G['model']`` or
# ``L['model']`` for a step function that calls the model).  Paths are read from the root on,
# so a layer is ``model.layers.3`` however the model was reached.
_PATH_ROOT = re.compile(r"^[LG]\['[^']*'\](?:\[\d+\]|\['[^']*'\])*")
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']+)'\]")


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
    """The attribute names from the root module to the module at ``path``
    (``L['self'].layers[3]._modules['mlp']`` -> ``['layers', '3', 'mlp']``)."""
    names = (attr or index or key for attr, index, key in _PATH_PART.findall(_PATH_ROOT.sub("", path)))
    return [name for name in names if name != "_modules"]


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
