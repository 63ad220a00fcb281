"""The modules a Dynamo graph was traced in, as objects: the model whose code Dynamo traced
(``compiled_module``), the module a node was traced in (``module_of``), and every module on the
graph's module stacks (``traced_modules``), each reached along its ``nn_module_stack`` path from
the compiled frame (``module_paths.py`` parses and follows the paths).  Read while the frame is
being compiled: the frame's variables are gone afterwards."""

from __future__ import annotations

import torch

from loong_compile._compat.dynamo import dynamo_frame_self, frame_variable
from loong_compile.passes.fx.module_paths import ModulePath, follow_module_path, parse_module_path


def compiled_module(gm: torch.fx.GraphModule) -> torch.nn.Module | None:
    """The model whose code Dynamo traced: the compiled frame's ``self``, else the module its
    module paths start from (a step function's ``model``, or transformers 5.24's ``forward``
    wrapper, whose frame holds the model as ``args[0]``); None for a plain function."""
    frame_self = dynamo_frame_self()
    if frame_self is not None:
        return frame_self
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            parsed = parse_module_path(str(path))
            root = _path_root(parsed) if parsed is not None else None
            if root is not None and not isinstance(root, torch.nn.Module):
                # a step holding the model in an object (``self.model`` of a trainer's method
                # or closure): the first entry's whole path is the outermost module
                root = follow_module_path(root, parsed.steps)
            if isinstance(root, torch.nn.Module):
                return root
    return None


def traced_in(node: torch.fx.Node) -> str | None:
    """The path of the innermost module a node was traced in, or None outside every one."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else None


def module_of(root: torch.nn.Module | None, node: torch.fx.Node) -> torch.nn.Module | None:
    """The innermost module a node was traced in, reached along its module path as the traced
    code reached it (passes/fx/module_paths.py: attributes, PEFT's ``__dict__['_modules']``,
    a list's or dict's items) from the path's root in the compiled frame (whatever Dynamo
    named it: ``L['self']``, ``L['args'][0]``, ``G['model']``) or else from ``root``; ``root``
    itself for code outside every submodule; None where the path leads nowhere."""
    path = traced_in(node)
    return root if path is None else _follow(path, root)


def _follow(path: str, root: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module at ``path`` (an ``nn_module_stack`` entry) in the compiled frame, else from
    ``root``; None where it leads nowhere."""
    parsed = parse_module_path(path)
    if parsed is None:
        return None
    # the path's own root first (a step function may call more than one module), whatever
    # holds the modules there (a module, or an object with the model as an attribute)
    start = _path_root(parsed)
    module = follow_module_path(start, parsed.steps) if start is not None else None
    if not isinstance(module, torch.nn.Module) and not isinstance(start, torch.nn.Module) \
            and root is not None:
        module = follow_module_path(root, parsed.steps)
    return module if isinstance(module, torch.nn.Module) else None


def _path_root(parsed: ModulePath):
    """The object a module path starts from, in the frame being compiled; None outside it."""
    variable = frame_variable(parsed.scope, parsed.variable)
    return None if variable is None else follow_module_path(variable, parsed.root_steps)


def traced_modules(gm: torch.fx.GraphModule, root: torch.nn.Module | None) -> list[torch.nn.Module]:
    """Every module some node of the graph was traced in, at any depth of its module stack
    (outer to inner, each once), reached as ``module_of`` reaches the innermost."""
    found: dict[int, torch.nn.Module] = {}
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            module = _follow(str(path), root)
            if module is not None:
                found.setdefault(id(module), module)
    return list(found.values())
