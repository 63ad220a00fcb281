"""Per-block compilation, supported: ``compile_blocks(model, **options)`` compiles a transformers
model's decoder blocks one graph at a time, and its head and loss in a graph of their own.

Compiling each block by hand (``layer.compile(backend="loong")``) leaves the masks and the loss
outside the compiled graphs, where they run eagerly on each rank's own tokens: transformers
builds a mask of packed documents or padding from the rank's tokens alone (which the block
cannot prove, and refuses), and shifts and averages ``labels=`` over the rank's tokens (which
nothing can see: the loss is silently wrong).  Here:

- the base model's forward (embedding, RoPE's tables, the masks' arguments) runs eagerly, as it
  would between compiled blocks, but each mask transformers' ``masking_utils`` would build is
  handed to the blocks *unbuilt* (``DeferredMask``: the factory and its arguments): the block's
  compiled graph builds it from the batch's position ids and 2-D attention mask, where the
  attention pass proves its documents, padding and window, as in a whole-model compile;
- every block runs through one compiled function (Dynamo compiles one graph per kind of block:
  Gemma 3's local and global layers are two), under ``recompile_limit_raises``: a block Dynamo
  gave up on would run on a rank's tokens without 2D-Attention;
- the model around the base (the LM head and transformers' loss) is compiled with the same
  options, so ``labels=`` is shifted over the whole sequence by the ``sequence_loss`` pass; that
  graph holds no attention (``allow_graphs_without_attention``).

- transformers' gradient checkpointing of the blocks (``gradient_checkpointing_enable()``) is
  taken over (``checkpointing.py``): while the base model's forward runs, the layers' flags are
  off, and a layer that checkpoints runs the block compiled with ``activations="full"`` (or
  ``full_offload``, or the options' own policy): what checkpointing keeps, each block's input,
  kept by the backend.  Layers left out by ``every_n_layers`` run the plain block.

A cache given to a block (transformers' default ``use_cache=True`` in training) is dropped: it is
for generation.  Masks are deferred only where the base model's module builds them with
``masking_utils``' ``create_*mask`` functions; a model that builds them otherwise hands its
blocks built masks, which the attention pass refuses by name as for a hand-compiled block.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loong_compile._compat.dynamo import recompile_limit_raises
from loong_compile.config import LoongConfig
from loong_compile.errors import LoongConfigError
from loong_compile.hf.checkpointing import TAKEN_OVER, policy_for, taken_over, with_policy

_COMPILED = "_loong_blocks_compiled"


class DeferredMask:
    """A mask transformers would build in the base model's forward, built inside a block's graph
    instead: ``factory(**arguments, inputs_embeds=<the block's hidden states>)``."""

    def __init__(self, factory: Callable, arguments: dict[str, Any]):
        self.factory = factory
        self.arguments = arguments

    def build(self, hidden_states: torch.Tensor) -> Any:
        return self.factory(**self.arguments, inputs_embeds=hidden_states)


def _deferring(factory: Callable) -> Callable:
    """``factory`` returning a ``DeferredMask`` of its arguments.  A cache among them is for
    generation: its mask is built without it and without reading documents from the positions,
    as transformers reads none when a cache is given."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def deferred(*args: Any, **kwargs: Any) -> DeferredMask:
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        arguments.update(arguments.pop("kwargs", {}))
        arguments.pop("inputs_embeds", None)
        if arguments.get("cache") is not None:
            arguments["cache"], arguments["position_ids"] = None, None
        return DeferredMask(factory, arguments)

    return deferred


@functools.cache
def _mask_factories() -> tuple[Callable, ...]:
    """``masking_utils``' mask factories (``create_*mask``), read once."""
    from transformers import masking_utils

    return tuple(getattr(masking_utils, name) for name in dir(masking_utils)
                 if name.startswith("create_") and name.endswith("mask"))


@contextlib.contextmanager
def _masks_deferred(namespace: dict[str, Any]) -> Iterator[None]:
    """Within: the names of ``namespace`` (a modeling module's globals) bound to a
    ``masking_utils`` mask factory return ``DeferredMask`` instead."""
    bound = {name: value for name, value in namespace.items()
             if callable(value) and any(value is f for f in _mask_factories())}
    try:
        namespace.update({name: _deferring(value) for name, value in bound.items()})
        yield
    finally:
        namespace.update(bound)


def _run_block(layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The block's own forward, its deferred masks built from its hidden states (compiled)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    kwargs = {k: v.build(hidden) if isinstance(v, DeferredMask) else v for k, v in kwargs.items()}
    return type(layer).forward(layer, *args, **kwargs)


def _is_cache(value: Any) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


class _BlockForward:
    """A block's ``forward``: the compiled ``_run_block``, without a generation cache; for a
    layer whose checkpointing the base model's forward took over (``checkpointing.py``), the
    one compiled with the checkpointing policy."""

    def __init__(self, layer: torch.nn.Module, compiled: _Compiled):
        self.layer = layer
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
        checkpointed = getattr(self.layer, TAKEN_OVER, False) and torch.is_grad_enabled()
        with recompile_limit_raises():
            return self.compiled.get(checkpointed)(self.layer, args, kwargs)


class _Compiled:
    """``_run_block`` compiled with the options, and (made at its first use) with the policy
    transformers' checkpointing of the layers becomes (``checkpointing.policy_for``)."""

    def __init__(self, options: dict[str, Any], base: torch.nn.Module):
        self.options, self.base = options, base
        self.plain = torch.compile(_run_block, backend="loong", options=options)
        self.checkpointed: Callable | None = None

    def get(self, checkpointed: bool) -> Callable:
        if not checkpointed:
            return self.plain
        if self.checkpointed is None:
            layers = [m for m in self.base.modules() if getattr(m, TAKEN_OVER, False)]
            options = with_policy(self.options, policy_for(layers))
            self.checkpointed = (self.plain if options == self.options else
                                 torch.compile(_run_block, backend="loong", options=options))
        return self.checkpointed


def find_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's decoder blocks: the ``ModuleList`` of modules of one class, preferring a class
    the model names in ``_no_split_modules`` (transformers' block classes), then the longest."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [((type(m[0]).__name__ in names, len(m)), path, m) for path, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1]
    if not found:
        raise LoongConfigError(
            f"{type(model).__name__} holds no list of blocks of one class",
            "compile_blocks compiles the blocks of a ModuleList of the model (its decoder layers)",
            'compile the whole model: torch.compile(model, backend="loong", options=...)')
    _, path, blocks = max(found, key=lambda entry: entry[0])
    return path, blocks


def compile_blocks(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Compile ``model`` block by block with ``backend="loong"`` and ``options`` (the backend's),
    in place, and return it: each decoder block a graph that builds its own masks, the head and
    the loss a graph of their own (module docstring).  Call the model as usual."""
    if getattr(model, _COMPILED, False):
        raise LoongConfigError("compile_blocks called twice on one model",
                               "a model's blocks are compiled once",
                               "call compile_blocks on the model once, before training")
    LoongConfig.from_options(options)   # an unknown or invalid option refused now, not at a call
    path, blocks = find_blocks(model)
    base = model.get_submodule(path.rpartition(".")[0])
    compiled = _Compiled(options, base)
    for layer in blocks:
        layer.forward = _BlockForward(layer, compiled)
    forward, namespace = base.forward, inspect.unwrap(type(base).forward).__globals__

    @torch.compiler.disable(recursive=True)
    def base_forward(*args: Any, **kwargs: Any) -> Any:
        with _masks_deferred(namespace), taken_over(base):
            return forward(*args, **kwargs)

    base.forward = base_forward
    if base is not model:
        model.compile(backend="loong",
                      options={**options, "allow_graphs_without_attention": True})
    setattr(model, _COMPILED, True)
    return model
