"""Dynamo shims: the backend registry, the module being compiled, where each graph input came
from (backend, passes/attention/model_facts.py, checks/inputs.py)."""

from __future__ import annotations

import torch


def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Register ``name`` unless Dynamo has it already (an earlier import, a reload).

    Checked against torch 2.13, where ``register_backend`` raises "duplicate name".
    """
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


def dynamo_frame_self():
    """The ``self`` of the frame Dynamo is compiling when a backend is called, or None.

    Model code decides some things from Python values Dynamo never puts in the graph (a
    sliding window it skips because the local sequence is short, a RoPE variant chosen by
    length); the attention pass reads them from the module.  Dynamo's instruction
    translator of the current frame is a private API.  Checked against torch 2.13.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError, AssertionError, IndexError):
        return None
    frame_self = getattr(tx, "f_locals", {}).get("self") if tx is not None else None
    return frame_self if isinstance(frame_self, torch.nn.Module) else None


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
