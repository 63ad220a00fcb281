"""PEFT adapters under ``lc.hf.parallelize``, in one process: what it refuses before anything
runs (adapters that are not LoRA computed token by token), and gradient checkpointing's
embedding hook on frozen embeddings (removed: the step takes checkpointing over).  Training with LoRA across ranks: tests/hf/test_parallelize.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loong_compile.errors import LoongConfigError

pytest.importorskip("peft")
pytest.importorskip("trl")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_hf_trainer as example  # noqa: E402

TARGETS = ["q_proj", "v_proj", "up_proj"]


@pytest.fixture(autouse=True)
def _trainer_state_put_back():
    """A Trainer seeds the process and sets Accelerate's process-wide state: both put back."""
    from accelerate.state import AcceleratorState

    from loong_compile.testing import reset_process_state

    with torch.random.fork_rng():
        yield
    reset_process_state()
    AcceleratorState._reset_state(reset_partial_state=True)


def _adapted(config):
    from peft import get_peft_model

    return get_peft_model(example.build_model(64, dim=32, layers=1, seed=0), config)


def test_a_trainer_of_a_lora_model_is_accepted(tmp_path):
    """Trainer(model=get_peft_model(model, LoraConfig(...))): parallelize looks under PEFT's
    wrapper (training it across ranks: tests/hf/test_parallelize.py)."""
    from peft import LoraConfig
    from transformers import Trainer, TrainingArguments

    import loong_compile as lc

    trainer = Trainer(model=_adapted(LoraConfig(target_modules=TARGETS)), args=TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True))
    assert lc.hf.parallelize(trainer, hp=1, cp=1, lowering="eager") is trainer


@pytest.mark.parametrize("kind, named", [
    ("prompt_tuning", "of type PROMPT_TUNING"),
    ("ia3", "of type IA3"),
    ("alora", "alora_invocation_tokens"),
    ("dora", "use_dora=True"),
])
def test_adapters_other_than_lora_are_refused_by_name(kind, named, tmp_path):
    from peft import IA3Config, LoraConfig, PromptTuningConfig
    from transformers import Trainer, TrainingArguments

    import loong_compile as lc

    config = {
        "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "ia3": lambda: IA3Config(task_type="CAUSAL_LM", target_modules=["v_proj", "up_proj"],
                                 feedforward_modules=["up_proj"]),
        "alora": lambda: LoraConfig(target_modules=TARGETS, alora_invocation_tokens=[5, 6]),
        "dora": lambda: LoraConfig(target_modules=TARGETS, use_dora=True),
    }[kind]()
    trainer = Trainer(model=_adapted(config), args=TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True))
    with pytest.raises(LoongConfigError, match=named) as refused:
        lc.hf.parallelize(trainer, hp=1, cp=2)
    assert "fix:" in str(refused.value)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_embedding_hook_on_frozen_embeddings_is_removed(reentrant):
    """The step takes checkpointing over (no torch.utils.checkpoint runs), so the hook that makes
    the embeddings' output require grad for reentrant checkpointing changes no gradient, and
    Dynamo would break the graph at it: every such hook is removed, reentrant or not (training
    with LoRA and checkpointing across ranks: tests/hf/test_parallelize.py)."""
    from peft import LoraConfig

    from loong_compile._compat.dynamo import forward_hooks_named
    from loong_compile.hf.trainer import _GRAD_HOOKS, _drop_input_grad_hooks

    model = _adapted(LoraConfig(target_modules=TARGETS))
    model.enable_input_require_grads()   # as TRL does, then the Trainer at train(): two hooks
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert forward_hooks_named(model.get_input_embeddings(), _GRAD_HOOKS) == 2
    _drop_input_grad_hooks(model)
    assert not forward_hooks_named(model.get_input_embeddings(), _GRAD_HOOKS)
