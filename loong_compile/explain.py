"""``loong_compile.explain``: the backend's report for a model, without a training step."""

from __future__ import annotations

from typing import Any

import torch

from loong_compile._compat.aot import eager_backward_compile
from loong_compile.backend import LoongBackend
from loong_compile.config import LoongConfig
from loong_compile.report import GraphReport, Report


def explain(model: Any, *example_inputs: Any, options: dict | LoongConfig | None = None,
            **kwargs: Any) -> Report:
    """Compile ``model`` for ``example_inputs`` and return the report, without a training step.

    Keyword arguments named like a ``LoongConfig`` field are options (``hp=2``); the
    others are passed to the model (``position_ids=...``).  The forward runs once
    (that is how Dynamo traces); no backward, no optimizer step.  The backward graph
    is compiled at once so its passes are reported too.  Under torchrun every rank
    must call ``explain`` (the forward issues the model's collectives).
    """
    fields = set(LoongConfig.__dataclass_fields__)
    merged = dict(options.to_dict() if isinstance(options, LoongConfig) else options or {})
    merged.update({k: v for k, v in kwargs.items() if k in fields})
    model_kwargs = {k: v for k, v in kwargs.items() if k not in fields}
    graphs: dict[int, GraphReport] = {}
    backend = LoongBackend(merged, on_report=lambda r: graphs.__setitem__(r.graph_id, r))
    with eager_backward_compile():
        torch.compile(model, backend=backend)(*example_inputs, **model_kwargs)
    return Report(graphs=[graphs[k] for k in sorted(graphs)])
