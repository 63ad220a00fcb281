"""Refuse a piece of a model that Dynamo cut at its layers' gradient checkpointing.

Contract
--------
stage:    dynamo, first (before any rewrite reads the graph)
applies:  when ``hp * cp > 1``
requires: ``nn_module_stack`` on the Dynamo graph's nodes, read while the frame is compiled
matches:  a graph compiled inside a model whose layers (the elements of a module's
          ``ModuleList`` / ``Sequential``) say ``gradient_checkpointing=True`` and are training
          (transformers' ``gradient_checkpointing_enable()``): a module the graph was traced in,
          or a module whose ``forward`` is running further up the Python stack (the frames
          Dynamo broke out of); and that holds no checkpoint call (``tag_activation_checkpoint``):
          Dynamo could not trace ``torch.utils.checkpoint`` around the layers (transformers
          >= 5.25 with the ``kernels`` package: the hub-kernel wrappers of the attention change
          a global inside the checkpointed body, which Dynamo does not trace), broke the graph
          there and compiles the pieces around the layers, which then run eagerly
          (``torch.utils.checkpoint`` is not traced into): their attention on each rank's tokens
          alone, their masks and positions built from them.
refuses:  ``LoongUnsupportedError`` naming checkpointing and the fix (the ``full`` activation
          policy keeps what checkpointing keeps: each layer's input; ``lc.hf.compile_blocks`` and
          ``lc.hf.parallelize`` take transformers' checkpointing as that policy themselves; or
          Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``, with which it traces the
          checkpointed layers in one graph, the wrapper's set-and-reset of its global not
          replayed in the backward), on every rank alike (the graph is the same) before anything
          runs.
reports:  the checkpointing layers found and whether the graph holds a checkpoint call.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx

from loong_compile.errors import LoongUnsupportedError
from loong_compile.passes.base import PassContext, ShardedPass
from loong_compile.passes.fx.subgraphs import graph_scopes, hop_name
from loong_compile.passes.fx.traced_modules import compiled_module, traced_modules

CHECKPOINT_HOP = "tag_activation_checkpoint"


class CheckpointBreakPass(ShardedPass):
    name = "checkpoint_breaks"
    stage = "dynamo"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
        around = traced_modules(gm, compiled_module(gm)) + _modules_up_the_stack()
        layers = list({id(layer): layer for module in around for layer in _layers(module)
                       if _checkpoints(layer)}.values())
        checkpointed = any(hop_name(n) == CHECKPOINT_HOP for scope in graph_scopes(gm)
                           for n in scope.module.graph.nodes)
        if layers and not checkpointed:
            raise LoongUnsupportedError(
                f"graph {ctx.graph_id} of a model whose {type(layers[0]).__name__} layers "
                f"checkpoint (gradient_checkpointing=True: transformers' "
                f"gradient_checkpointing_enable()), under hp={ctx.config.hp}, cp={ctx.config.cp}: "
                "Dynamo broke the graph at torch.utils.checkpoint",
                "Dynamo runs the checkpointed layers eagerly, outside every compiled graph: their "
                "attention would see each rank's tokens alone, and the masks and positions "
                "compiled around them come from those tokens",
                "model.gradient_checkpointing_disable() and options={'activations': 'full'} (the "
                "backend keeps each layer's input and recomputes the rest, as checkpointing "
                "does), or compile with loong_compile.hf.compile_blocks(model, ...) or train "
                "with loong_compile.hf.parallelize(trainer, ...), which take transformers' "
                "checkpointing as that policy; or, to keep torch.utils.checkpoint, let Dynamo "
                "trace it: torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = "
                "True before the first call")
        return {"matched": len(layers), "changed": 0, "checkpoint_call": checkpointed}


def _modules_up_the_stack() -> list[torch.nn.Module]:
    """The modules whose ``forward`` (or a function of theirs) is running above this compile:
    each Python frame's ``self`` that is a module."""
    found, frame = [], inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            found.append(owner)
        frame = frame.f_back
    return found


def _layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The elements of the module's list children: where transformers keeps the layers it
    checkpoints (the base model itself says ``gradient_checkpointing`` too, and is no layer)."""
    return [layer for child in module.children()
            if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential))
            for layer in child.children()]


def _checkpoints(layer: torch.nn.Module) -> bool:
    return getattr(layer, "gradient_checkpointing", False) is True and layer.training
