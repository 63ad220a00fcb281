"""The dtype autocast casts to at each node of a Dynamo graph."""

from __future__ import annotations

import torch
import torch.fx


def autocast_dtypes(graph: torch.fx.Graph, device_type: str) -> dict[torch.fx.Node, torch.dtype | None]:
    """The dtype autocast casts to on ``device_type`` at each node (None where it is off).

    Dynamo traces under the autocast state the compiled function was called in (and guards on
    it), so the graph starts in that state; its own ``with torch.autocast(...)`` blocks are
    ``_enter_autocast(device, dtype, enabled, cache)`` / ``_exit_autocast(ctx)`` calls.
    """
    default = torch.get_autocast_dtype(device_type)
    states = [default if torch.is_autocast_enabled(device_type) else None]
    entered: list[torch.fx.Node] = []
    out = {}
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name == "_enter_autocast":
            device, dtype, enabled = (list(node.args) + [None] * 3)[:3]
            if device != device_type:
                state = states[-1]
            else:
                state = None if enabled is False else (dtype or default)
            states.append(state)
            entered.append(node)
        elif name == "_exit_autocast" and entered and node.args and node.args[0] is entered[-1]:
            entered.pop()
            states.pop()
        out[node] = states[-1]
    return out


def autocast_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes autocast casts at, on any device the graph's tensors live on: the autocast the
    function was called under, and its own ``with torch.autocast(...)`` blocks."""
    devices = {v.device.type for n in graph.nodes
               if isinstance(v := n.meta.get("example_value"), torch.Tensor)}
    return {n for device in devices for n, dtype in autocast_dtypes(graph, device).items()
            if dtype is not None}
