"""loong_compile: a torch.compile backend for long-sequence LLM training.

``torch.compile(model, backend="loong", options={...})``; see README.md.
Importing this package registers the backend (an installed package also
registers it through its ``torch_dynamo_backends`` entry point).
"""

from __future__ import annotations

from typing import Any

from loong_compile import _compat
from loong_compile.backend import LoongBackend, loong_backend
from loong_compile.config import LoongConfig
from loong_compile.errors import (
    LoongConfigError, LoongError, LoongMeshError, LoongRankMismatchError, LoongShapeError,
    LoongUnsupportedError,
)
from loong_compile.inspect import GraphReport, Report

_compat.register_dynamo_backend("loong", loong_backend)


def explain(model: Any, *example_inputs: Any, options: dict | LoongConfig | None = None,
            **kwargs: Any) -> Report:
    """Compile ``model`` for ``example_inputs`` and return the report, without a training step.

    Keyword arguments named like a ``LoongConfig`` field are options (``hp=2``); the
    others are passed to the model (``position_ids=...``).  The forward runs once
    (that is how Dynamo traces); no backward, no optimizer step.  The backward graph
    is compiled at once so its passes are reported too.  Under torchrun every rank
    must call ``explain`` (the forward issues the model's collectives).
    """
    import torch

    fields = set(LoongConfig.__dataclass_fields__)
    merged = dict(options.to_dict() if isinstance(options, LoongConfig) else options or {})
    merged.update({k: v for k, v in kwargs.items() if k in fields})
    model_kwargs = {k: v for k, v in kwargs.items() if k not in fields}
    graphs: dict[int, GraphReport] = {}
    backend = LoongBackend(merged, on_report=lambda r: graphs.__setitem__(r.graph_id, r))
    with _compat.eager_backward_compile():
        torch.compile(model, backend=backend)(*example_inputs, **model_kwargs)
    return Report(graphs=[graphs[k] for k in sorted(graphs)])


__all__ = [
    "GraphReport", "LoongBackend", "LoongConfig", "LoongConfigError", "LoongError",
    "LoongMeshError", "LoongRankMismatchError", "LoongShapeError", "LoongUnsupportedError",
    "Report", "explain", "loong_backend",
]
