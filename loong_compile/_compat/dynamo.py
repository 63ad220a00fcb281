"""Dynamo shims: the backend registry, the module being compiled, where each graph input came
from and whether it is a module's state (backend, passes/attention/model_facts.py and
input_roles.py, checks/inputs.py), the compiled graphs' globals a reset leaves behind
(loong_compile/testing.py, between calls on kept ranks), and forward hooks Dynamo would break
the graph at (loong_compile/hf/trainer.py)."""

from __future__ import annotations

import torch


def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Register ``name`` unless Dynamo has it already (an earlier import, a reload).

    Checked against torch 2.13, where ``register_backend`` raises "duplicate name".
    """
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


def _current_frame():
    """Dynamo's instruction translator of the frame being compiled, or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except (ImportError, AttributeError, AssertionError, IndexError):
        return None


def dynamo_frame_self():
    """The ``self`` of the frame Dynamo is compiling when a backend is called, or None.

    Model code decides some things from Python values Dynamo never puts in the graph (a
    sliding window it skips because the local sequence is short, a RoPE variant chosen by
    length); the attention pass reads them from the module.  Dynamo's instruction
    translator of the current frame is a private API.  Checked against torch 2.11-2.15.
    """
    tx = _current_frame()
    frame_self = getattr(tx, "f_locals", {}).get("self") if tx is not None else None
    return frame_self if isinstance(frame_self, torch.nn.Module) else None


def frame_variable(scope: str, name: str):
    """The local (``scope`` "L") or global ("G") ``name`` of the frame being compiled, or None:
    where a module path starts (``L['self']``, ``L['args']``, ``G['model']``; the path itself is
    parsed by passes/fx/module_paths.py).  Checked against torch 2.11-2.15
    (``InstructionTranslator.f_locals`` / ``f_globals``)."""
    tx = _current_frame()
    if tx is None or scope not in ("L", "G"):
        return None
    return (getattr(tx, "f_locals" if scope == "L" else "f_globals", None) or {}).get(name)


def placeholder_sources(gm) -> list[str | None]:
    """Where Dynamo read each graph input of ``gm`` from (``"L['position_ids']"``), or None.

    Checked against torch 2.13: a Dynamo placeholder's ``meta["grapharg"]`` is a
    ``GraphArg`` whose ``source.name`` is a string property.
    """
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        names.append(None if source is None else source.name)
    return names


def is_module_state(node) -> bool:
    """Whether a Dynamo graph input is a module's parameter or buffer (the same tensor at every
    call), not an argument of the call; False where Dynamo left no source.

    Checked against torch 2.13: ``meta["grapharg"].source`` reaches parameters and buffers
    through ``_parameters[...]`` / ``_buffers[...]``, which
    ``torch._dynamo.source.is_from_unspecialized_param_buffer_source`` recognises.
    """
    from torch._dynamo.source import is_from_unspecialized_param_buffer_source

    source = getattr(node.meta.get("grapharg"), "source", None)
    return source is not None and is_from_unspecialized_param_buffer_source(source)


def recompile_limit_raises():
    """A context in which a frame that reaches Dynamo's recompile limit raises instead of
    running uncompiled: under hp·cp > 1 an uncompiled model would run on a rank's local tokens
    without 2D-Attention, silently wrong.  ``torch._dynamo.config.fail_on_recompile_limit_hit``
    (False by default) is patched for the context only.  Checked against torch 2.11-2.15."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def drop_installed_globals() -> None:
    """Remove the globals Dynamo installed in compiled frames' modules (each compiled graph as
    ``__compiled_fn_*``, resume functions), as it would when their transformed code dies.

    The code never dies in a process that goes on: the global reaches it back through the
    compiled graph, so after ``torch.compiler.reset()`` every graph a process compiled stays in
    the module it was compiled in (measured in the suite's kept ranks: ~14,500 objects a
    trust-matrix cell, and cells 2.5x slower after an hour as the garbage collector walks them).
    Only for a process whose caches were just reset: no compiled code may run after it.
    Checked against torch 2.11-2.15: ``torch._dynamo.utils.CleanupManager`` and ``CleanupHook``."""
    from torch._dynamo.utils import CleanupManager

    manager = CleanupManager.instance
    for hooks in list(manager.values.values()):
        for hook in hooks:
            hook.scope.pop(hook.name, None)
    manager.clear()   # drops the weak references too: no hook runs again when a code dies


def forward_hooks_named(module: torch.nn.Module, names: tuple[str, ...],
                        remove: bool = False) -> int:
    """How many of ``module``'s forward hooks are functions named one of ``names``; with
    ``remove``, removed too.  A hook whose handle its installer overwrote (transformers'
    ``enable_input_require_grads`` called twice keeps the second handle only) has no other way
    out than ``nn.Module._forward_hooks``.  Checked against torch 2.11-2.15 (the two dicts a
    forward hook's ``RemovableHandle`` also clears)."""
    keys = [key for key, hook in module._forward_hooks.items()
            if getattr(hook, "__name__", None) in names]
    for key in keys if remove else ():
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    return len(keys)


def graphs_compiled() -> int:
    """How many graphs Dynamo has compiled in this process (``counters["stats"]
    ["unique_graphs"]``, checked against torch 2.11-2.15): a recompile adds one."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
