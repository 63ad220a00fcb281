"""transformers' gradient checkpointing, taken over by the backend's activation policy.

``model.gradient_checkpointing_enable()`` (``TrainingArguments(gradient_checkpointing=True)``,
TRL's default) makes each decoder layer run its ``forward`` inside ``torch.utils.checkpoint``:
keep the layer's input, recompute the rest in the backward.  Compiled, Dynamo must trace that
call as one checkpointed body, and since transformers 5.25 (which brings the ``kernels``
package) it cannot: the hub-kernel wrapper of the attention changes a global inside the body.
It then runs the layers eagerly, outside every graph (``passes/safety/checkpoint_breaks.py``
refuses that under ``hp·cp > 1``).

The backend's ``full`` policy keeps what checkpointing keeps, each layer's input, and recomputes
the rest inside the compiled graph; ``full_offload`` keeps it on the host, as transformers'
``activation_checkpointing_enable(offload=True)`` does.  So ``parallelize`` and
``compile_blocks`` compile the layers with their checkpointing flags off (``taken_over``: for
the call only, then as they were) and with that policy (``with_policy``), unless the options
name a policy themselves: then those decide what is kept.  The values are the same either way
(a recompute computes what the forward did); only what is kept differs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

# set on a layer while its checkpointing is taken over (``taken_over``): the block compiled
# with the checkpointing policy runs it (``blocks.py``)
TAKEN_OVER = "_loong_checkpointing_taken_over"


def checkpointing(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules under ``module`` (itself included) whose checkpointing is on and that train."""
    return [m for m in module.modules()
            if getattr(m, "gradient_checkpointing", False) is True and m.training]


def policy_for(modules: list[torch.nn.Module]) -> str:
    """``full_offload`` where transformers keeps the checkpoints on the host (its checkpoint
    function enters ``save_on_cpu``), else ``full``."""
    def offloads(m: torch.nn.Module) -> bool:
        function = getattr(m, "_gradient_checkpointing_func", None)
        code = getattr(getattr(function, "func", function), "__code__", None)
        return code is not None and "save_on_cpu" in code.co_names
    return "full_offload" if any(offloads(m) for m in modules) else "full"


def trainer_policy(trainer) -> str | None:
    """The policy a Trainer's checkpointing becomes: its model's (on already), or the one the
    Trainer turns on when training starts (``TrainingArguments.activation_checkpointing``,
    before 5.25 ``gradient_checkpointing``; ``offload`` among its keyword arguments keeps the
    checkpoints on the host); None without checkpointing."""
    modules = checkpointing(trainer.model)
    if modules:
        return policy_for(modules)
    args = trainer.args
    on = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not on:
        return None
    kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
              or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    return "full_offload" if kwargs.get("offload") else "full"


def with_policy(options: Mapping[str, Any], policy: str | None) -> dict[str, Any]:
    """``options`` with ``activations=policy`` where checkpointing is on (``policy`` given) and
    neither the options nor ``LOONG_ACTIVATIONS`` name a policy."""
    if policy is None or "activations" in options or "LOONG_ACTIVATIONS" in os.environ:
        return dict(options)
    log.info("loong_compile: transformers' gradient checkpointing taken as activations=%r",
             policy)
    return {**options, "activations": policy}


@contextlib.contextmanager
def taken_over(module: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """Within: the checkpointing flags under ``module`` off (each such module marked
    ``TAKEN_OVER``); after: as they were.  Yields the modules whose flag it turned off."""
    modules = checkpointing(module)
    for m in modules:
        m.gradient_checkpointing = False
        setattr(m, TAKEN_OVER, True)
    try:
        yield modules
    finally:
        for m in modules:
            m.gradient_checkpointing = True
            setattr(m, TAKEN_OVER, False)
