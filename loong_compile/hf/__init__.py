"""``parallelize(trainer, hp=H, cp=C, **options)``: train with a ``transformers.Trainer`` (or a
subclass, ``trl.SFTTrainer`` included) over ``dp × hp × cp`` ranks, one line after building it::

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=data, ...)
    lc.hf.parallelize(trainer, hp=2, cp=2, lowering="inductor")
    trainer.train()

Under torchrun, the ``hp·cp`` ranks of a sequence share each batch and ``dp = world/(hp·cp)``
replicas see different batches; the losses, gradient norms, parameters, evaluation losses and
checkpoints are those of one process training with ``dp`` replicas (docs/usage.md,
"transformers Trainer and TRL SFTTrainer").  The package:

* ``__init__``: ``parallelize`` (this module): the checks, the mesh, the compiled step;
* ``refusals``: the Trainer features refused by name;
* ``batches``: a collated batch cut into a rank's tokens;
* ``trainer``: the Trainer methods it replaces, and why;
* ``blocks``: ``compile_blocks(model, **options)``, a model compiled block by block.

Needs the ``hf`` extra: ``pip install ".[hf]"`` in a clone of this repository.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loong_compile.hf.blocks import compile_blocks

__all__ = ["compile_blocks", "parallelize"]


def parallelize(trainer, hp: int = 1, cp: int = 1, *, pad_to_multiple_of: int | None = None,
                **options: Any):
    """Make ``trainer`` train its model with 2D-Attention over ``hp × cp`` ranks per sequence.

    Call it after building the trainer and before ``train()``/``evaluate()``; it returns the
    same trainer (its class becomes a subclass of its own class, ``LoongTrainerMixin`` first).

    Args:
        trainer: a ``transformers.Trainer`` or a subclass whose ``compute_loss``,
            ``training_step``, ``prediction_step`` and ``get_batch_samples`` are the Trainer's
            or TRL's SFTTrainer's (``refusals.REPLACED_METHODS``); its model a causal LM,
            or one with PEFT LoRA adapters (``get_peft_model``, ``SFTTrainer(peft_config=)``).
        hp, cp: head-parallel and context-parallel degrees; ``world`` must be a multiple of
            ``hp·cp``.
        pad_to_multiple_of: every batch's rows are padded on the right (pads labelled
            ``-100``) to a multiple of the ``2·cp·hp`` tokens (``hp`` when ``cp = 1``) the
            layout cuts, and of this.  Rows with padding or packed documents must all have one
            length (a mask is proven for one shape): set it to the longest row, e.g.
            ``per_device_train_batch_size * max_length`` for TRL's packing.
        **options: the backend's options (``LoongConfig``: ``lowering``, ``activations``,
            ``placement``, ``inner_ring``, ...), passed to ``torch.compile(...,
            backend="loong", options={"hp": hp, "cp": cp, **options})``.  With gradient
            checkpointing on (``TrainingArguments(gradient_checkpointing=True)``, TRL's
            default) and no ``activations`` given, the policy is ``full``
            (``hf/checkpointing.py``: what checkpointing keeps, kept by the backend).

    Raises ``LoongConfigError`` for a feature it cannot honour (``refusals``) and
    ``LoongMeshError`` for sizes that do not fit the world, on every rank before anything runs.
    """
    import loong_compile as lc
    from loong_compile.config import LoongConfig
    from loong_compile.errors import LoongConfigError
    from loong_compile.hf.checkpointing import trainer_policy, with_policy
    from loong_compile.hf.refusals import refuse_unsupported
    from loong_compile.hf.trainer import CausalLMLoss, LoongState, LoongTrainerMixin

    refuse_unsupported(trainer)
    multiple = pad_to_multiple_of
    if multiple is not None and (type(multiple) is not int or multiple < 1):
        raise LoongConfigError(f"pad_to_multiple_of={multiple!r}", "a positive token count, or None",
                               "pass e.g. pad_to_multiple_of=256")
    options = with_policy(options, trainer_policy(trainer))
    config = LoongConfig.from_options({**options, "hp": hp, "cp": cp})   # unknown options refused
    mesh = lc.init_mesh(hp=config.hp, cp=config.cp, placement=config.placement,
                        inner_ring=config.inner_ring)
    model = trainer.model
    _broadcast_from_rank0(model)
    # Accelerate leaves a model it has prepared alone: no DistributedDataParallel around it
    # (LoongTrainerMixin reduces the gradients itself) and no second device placement
    model._is_accelerate_prepared = True
    step = torch.compile(CausalLMLoss(model), backend="loong",
                         options={**options, "hp": hp, "cp": cp})
    trainer._loong = LoongState(
        mesh=mesh, step=step, pad_token_id=_pad_token_id(trainer),
        pad_to_multiple_of=pad_to_multiple_of,
        tokens_across_replicas=bool(trainer.args.average_tokens_across_devices))
    cls = type(trainer)
    trainer.__class__ = type(f"Loong{cls.__name__}", (LoongTrainerMixin, cls),
                             {"__module__": cls.__module__})
    return trainer


def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Start every rank from rank 0's parameters and buffers, as DistributedDataParallel does:
    from then on they stay equal (every rank applies the same reduced gradient)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _pad_token_id(trainer) -> int:
    """The id the layout's padding uses: the tokenizer's pad token, else the model's, else 0
    (any id does: pads are labelled -100 and seen by no real token)."""
    for source in (trainer.processing_class, trainer.model.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0
