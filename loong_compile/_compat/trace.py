"""Structured trace logging (report/): artifacts tlparse shows."""

from __future__ import annotations

from collections.abc import Callable


def trace_artifact(name: str, payload: Callable[[], str], encoding: str = "string") -> None:
    """Emit ``payload()`` as a structured-trace artifact (``TORCH_TRACE`` / tlparse).  The
    payload is computed only when structured tracing is on: printing a graph costs seconds."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=payload)
