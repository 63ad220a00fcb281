"""loong_compile: a torch.compile backend for long-sequence LLM training.

``torch.compile(model, backend="loong", options={...})``; see README.md.

The installed package registers ``backend="loong"`` through its
``torch_dynamo_backends`` entry point, so nothing needs importing first; an
uninstalled checkout registers it when this package is imported.  Everything
that needs torch loads on first use, so ``loong`` (the estimator CLI) starts
without importing torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from loong_compile.config import LoongConfig
from loong_compile.errors import (
    LoongConfigError, LoongError, LoongMeshError, LoongRankMismatchError, LoongShapeError,
    LoongUnsupportedError,
)

# public name -> module that defines it (imported on first access)
_LAZY = {
    "LoongBackend": "loong_compile.backend",
    "loong_backend": "loong_compile.backend",
    "explain": "loong_compile.explain",
    "GraphReport": "loong_compile.report",
    "Report": "loong_compile.report",
    "init_mesh": "loong_compile.parallel.mesh",
    "shard_batch": "loong_compile.parallel.tokens",
    "gather_sequence": "loong_compile.parallel.tokens",
    "reduce_gradients": "loong_compile.parallel.gradients",
    "set_fsdp_gradient_divide_factor": "loong_compile.parallel.gradients",
    "next_token_loss": "loong_compile.loss",
    "NextTokenLoss": "loong_compile.loss",
}
# public subpackages, imported on first access (hf needs the [hf] extra)
_SUBPACKAGES = {"hf"}


def __getattr__(name: str) -> Any:
    if name in _LAZY or name in _SUBPACKAGES:
        module = importlib.import_module(_LAZY.get(name, f"{__name__}.{name}"))
        value = module if name in _SUBPACKAGES else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loong_compile' has no attribute {name!r}")


def _register_backend_unless_installed() -> None:
    if any(ep.name == "loong" for ep in entry_points(group="torch_dynamo_backends")):
        return  # Dynamo loads it from the entry point itself
    from loong_compile._compat.dynamo import register_dynamo_backend
    from loong_compile.backend import loong_backend

    register_dynamo_backend("loong", loong_backend)


_register_backend_unless_installed()

__all__ = [
    "GraphReport", "LoongBackend", "LoongConfig", "LoongConfigError", "LoongError",
    "LoongMeshError", "LoongRankMismatchError", "LoongShapeError", "LoongUnsupportedError",
    "NextTokenLoss", "Report", "explain", "gather_sequence", "init_mesh", "loong_backend",
    "next_token_loss", "reduce_gradients", "set_fsdp_gradient_divide_factor", "shard_batch",
]
