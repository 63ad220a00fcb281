"""What ``loong_compile.hf.parallelize`` refuses, before anything runs.

Each rule here names a Trainer feature that would mix tokens across the ranks of a sequence,
count them twice, or be silently dropped by the training step ``parallelize`` installs; it is
refused with ``LoongConfigError(what, rule, fix)`` on every rank (every rank reads the same
arguments), never ignored.  docs/usage.md, "transformers Trainer and TRL SFTTrainer", lists
them with what is supported.
"""

from __future__ import annotations

import torch

from loong_compile.errors import LoongConfigError

# the methods parallelize replaces; a subclass overriding one would be silently bypassed
REPLACED_METHODS = ("compute_loss", "training_step", "prediction_step", "get_batch_samples")
# classes whose own versions of those methods parallelize replaces knowingly (it computes the
# same loss: SFTTrainer's is transformers' loss through TRL's fused head, plus metrics)
KNOWN_TRAINERS = ("transformers.trainer.Trainer", "trl.trainer.sft_trainer.SFTTrainer")


def refuse_unsupported(trainer) -> None:
    """Raise ``LoongConfigError`` for the first feature of ``trainer`` that parallelize cannot
    honour exactly."""
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        _refuse(f"{type(trainer).__name__} object", "parallelize takes a transformers.Trainer "
                "(or a subclass: trl.SFTTrainer, ...)", "pass the trainer you built")
    if getattr(trainer, "_loong", None) is not None:
        _refuse("a trainer parallelize was already called on", "parallelize is called once",
                "call it once, after building the trainer")
    if trainer.model_wrapped is not trainer.model:
        _refuse("a trainer whose model Accelerate already prepared (train() or evaluate() ran)",
                "parallelize keeps the model out of DistributedDataParallel, which it must do "
                "before the Trainer prepares it", "call parallelize right after building the trainer")
    _refuse_overrides(type(trainer))
    _refuse_arguments(trainer.args)
    _refuse_trainer_features(trainer)
    _refuse_model(trainer.model)


def _refuse(what: str, rule: str, fix: str) -> None:
    raise LoongConfigError(what, rule, fix)


def _refuse_overrides(cls: type) -> None:
    for klass in cls.__mro__:
        name = f"{klass.__module__}.{klass.__qualname__}"
        if name in KNOWN_TRAINERS or klass is object:
            continue
        for method in REPLACED_METHODS:
            if method in vars(klass):
                _refuse(f"{klass.__qualname__}.{method} (your override)",
                        f"parallelize replaces {', '.join(REPLACED_METHODS)} with its own "
                        "(the batch cut over the ranks, the loss in the compiled graph, the "
                        "gradients reduced over the mesh): an override would be bypassed",
                        "move what the override adds elsewhere (a callback, the collator), or "
                        "train without parallelize")


def _refuse_arguments(args) -> None:
    """TrainingArguments (and SFTConfig) values."""
    if args.torch_compile:
        _refuse("TrainingArguments(torch_compile=True)", "parallelize compiles the model itself "
                "with backend='loong'; a second torch.compile by Accelerate would wrap it",
                "drop torch_compile (and torch_compile_backend / torch_compile_mode)")
    if args.deepspeed:
        _refuse("TrainingArguments(deepspeed=...)", "DeepSpeed shards and reduces on its own, "
                "over ranks that loong_compile uses for one sequence", "train without DeepSpeed")
    if args.fsdp:
        _refuse(f"TrainingArguments(fsdp={args.fsdp!r})", "not yet supported: the Trainer's "
                "FSDP (Accelerate's fully_shard over the whole model) is not wired to the "
                "backend's per-block compilation and gradient divide factor",
                "train without fsdp (parameters replicated), or use FSDP2 by hand as "
                "examples/training.py::shard_with_fsdp2 does")
    if getattr(args, "parallelism_config", None) is not None:
        _refuse("TrainingArguments(parallelism_config=...)", "Accelerate's own context, tensor "
                "or sequence parallelism would cut the sequence a second time",
                "drop parallelism_config: hp and cp are parallelize's arguments")
    if args.n_gpu > 1:
        _refuse(f"n_gpu={args.n_gpu} (torch.nn.DataParallel in one process)",
                "every rank of a sequence is its own process", "launch with torchrun, one process per GPU")
    if args.label_smoothing_factor:
        _refuse(f"TrainingArguments(label_smoothing_factor={args.label_smoothing_factor})",
                "not yet supported: the label smoother computes the loss from the full logits, "
                "outside the compiled graph", "set label_smoothing_factor=0")
    if args.train_sampling_strategy == "batch_rebalance":
        _refuse("TrainingArguments(train_sampling_strategy='batch_rebalance')",
                "its sampler deals batches to every process; the ranks of one sequence must get "
                "the same batch", "use 'random', 'sequential' or 'group_by_length'")
    if args.include_num_input_tokens_seen not in ("no", False):
        _refuse(f"TrainingArguments(include_num_input_tokens_seen={args.include_num_input_tokens_seen!r})",
                "the Trainer sums the count over every process, and the hp*cp ranks of a "
                "sequence hold one batch: it would count each token hp*cp times",
                "set include_num_input_tokens_seen='no'")
    if args.neftune_noise_alpha is not None:
        _refuse(f"TrainingArguments(neftune_noise_alpha={args.neftune_noise_alpha})",
                "NEFTune scales its noise by the sequence length a rank sees (its share)",
                "drop neftune_noise_alpha")
    if args.use_liger_kernel:
        _refuse("TrainingArguments(use_liger_kernel=True)", "Liger's patched forward computes "
                "the loss with its own shift over a rank's tokens; the backend chunks the LM "
                "head and the loss itself", "drop use_liger_kernel")
    config = args.accelerator_config
    for name in ("dispatch_batches", "split_batches"):
        if getattr(config, name, None):
            _refuse(f"accelerator_config {name}=True", "the ranks of one sequence load the same "
                    "batch; Accelerate would deal one batch out in pieces", f"set {name}=False")
    # TRL's SFTConfig
    if getattr(args, "activation_offloading", False):
        _refuse("SFTConfig(activation_offloading=True)", "not yet supported with the compiled "
                "step (the backend has its own offload: options activations='memo')",
                "drop activation_offloading")
    if getattr(args, "loss_type", "nll") != "nll":
        _refuse(f"SFTConfig(loss_type={args.loss_type!r})", "the loss in the compiled graph is "
                "the next-token cross-entropy ('nll')", "use loss_type='nll'")


def _refuse_trainer_features(trainer) -> None:
    if trainer.model_init is not None:
        _refuse("Trainer(model_init=...)", "train() would build a new model that the compiled "
                "step does not hold", "build the model first and pass model=")
    if trainer.compute_loss_func is not None:
        _refuse("Trainer(compute_loss_func=...)", "the loss is computed in the compiled graph "
                "(transformers' next-token loss, shifted over the whole sequence)",
                "drop compute_loss_func")
    for name in ("compute_metrics", "preprocess_logits_for_metrics"):
        if getattr(trainer, name, None) is not None:
            _refuse(f"Trainer({name}=...)", "not yet supported: they need the logits, which a "
                    "rank holds for its tokens only (and the compiled step does not return)",
                    f"drop {name}; evaluate() reports eval_loss")
    if getattr(trainer, "aux_loss_enabled", False):
        _refuse("a mixture-of-experts router auxiliary loss (output_router_logits=True)",
                "its expert statistics cover the whole sequence", "set output_router_logits=False")
    for name, dataset in (("train_dataset", trainer.train_dataset), ("eval_dataset", trainer.eval_dataset)):
        datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
        if any(_is_iterable(d) for d in datasets):
            _refuse(f"{name} is an IterableDataset", "not yet supported: Accelerate deals an "
                    "iterable dataset by process (or dispatches it from rank 0), and the ranks of "
                    "one sequence must get the same batch", "use a map-style dataset (datasets.Dataset)")


def _refuse_model(model: torch.nn.Module) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model = _under_adapters(model)
    name = type(model).__name__
    if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or model.config.is_encoder_decoder:
        _refuse(f"model {name}", "parallelize trains causal language models (the next-token loss, "
                "labels shifted over the whole sequence)",
                "use an AutoModelForCausalLM model, or one wrapped by PEFT's get_peft_model")


def _under_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """The model under PEFT's wrapper (``get_peft_model``, ``SFTTrainer(peft_config=...)``), once
    its adapters are LoRA computed token by token; a model without one as it is."""
    try:
        from peft import PeftModel, PeftType
    except ImportError:
        return model
    if not isinstance(model, PeftModel):
        return model
    for adapter, config in model.peft_config.items():
        kind = getattr(config.peft_type, "value", config.peft_type)
        if config.peft_type != PeftType.LORA:
            _refuse(f"PEFT adapter {adapter!r} of type {kind}",
                    "parallelize supports LoRA (LoraConfig), whose adapters change a layer's "
                    "weights token by token; prompt learning (prompt, prefix, p-tuning) adds "
                    "virtual tokens the ranks' cut of the sequence does not hold, and the other "
                    "adapter types are not yet tested across ranks",
                    "use peft.LoraConfig, or train without parallelize")
        if getattr(config, "alora_invocation_tokens", None):
            _refuse(f"PEFT adapter {adapter!r} with alora_invocation_tokens (activated LoRA)",
                    "activated LoRA searches the whole sequence for its invocation tokens, and "
                    "a rank holds only its share of it",
                    "drop alora_invocation_tokens (plain LoRA), or train without parallelize")
        if getattr(config, "use_dora", False):
            _refuse(f"PEFT adapter {adapter!r} with use_dora=True (DoRA)",
                    "not yet supported: Dynamo breaks the graph in PEFT's DoRA layer "
                    "(peft/utils/integrations.py), and the pieces around the break mix tokens "
                    "outside the attention the backend rewrites",
                    "use_dora=False (plain LoRA), or train without parallelize")
    return model.get_base_model()


def _is_iterable(dataset) -> bool:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        from datasets import IterableDataset
    except ImportError:
        return False
    return isinstance(dataset, IterableDataset)
