"""Structured trace logging (report/): artifacts tlparse shows."""

from __future__ import annotations


def trace_artifact(name: str, payload: str, encoding: str = "string") -> None:
    """Emit ``payload`` as a structured-trace artifact (``TORCH_TRACE`` / tlparse)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=lambda: payload)
