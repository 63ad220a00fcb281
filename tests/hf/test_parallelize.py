"""``lc.hf.parallelize``: a transformers Trainer and TRL's SFTTrainer on 4 gloo ranks train as one
process does.

Each case trains a tiny Llama (built from its config, float32, ``lowering="eager"``: the
backend's rewrite without AOTAutograd, whose lowerings the trust matrices test) for 6
optimizer steps (AdamW, 2 micro-batches per step, gradient clipping at 1.0) on 4 ranks, once
with ``hp=2 x cp=2`` (one replica) and once with ``hp=1 x cp=2`` (``dp=2`` replicas), and
compares the logged losses, the final parameters and ``evaluate()`` with the same Trainer run
without parallelize in this process, on the same data (for ``dp=2`` with twice the batch: the
same global batch).  One ``run_distributed`` call runs every case of a family, and the
references run here, so the module pays for its ranks' compiles, not for their start.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loong_compile.errors import LoongConfigError, LoongShapeError
from loong_compile.testing import run_distributed

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import train_hf_trainer as example  # noqa: E402

STEPS, ACCUMULATION, BATCH = 6, 2, 2          # optimizer steps, micro-batches per step, rows
TOLERANCE = 1e-5                              # relative, float32 round-off over 6 AdamW steps
LOWERING = "eager"                            # the rewrite without AOTAutograd: compiles fastest


# ---- the runs -------------------------------------------------------------------------------

def tiny_llama(vocab: int) -> torch.nn.Module:
    return example.build_model(vocab, dim=32, layers=1, seed=0)


def lora_config():
    """LoRA on attention and MLP projections, PEFT's defaults otherwise (B starts at 0)."""
    from peft import LoraConfig

    return LoraConfig(target_modules=["q_proj", "v_proj", "up_proj"], r=4, lora_alpha=8)


def text_rows(count: int, length: int, offset: int = 0) -> list[dict]:
    """Rows of ``length`` characters of the standard library's source, as token ids."""
    text = "\n".join(example.stdlib_lines(3000))
    ids = example.char_tokenizer()(text)["input_ids"]
    rows = [torch.tensor(ids[(offset + i) * length:(offset + i + 1) * length]) for i in range(count)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def documents(count: int, offset: int = 0) -> list[dict]:
    """Lines of varied length as token ids (for packing)."""
    tokenizer = example.char_tokenizer()
    lines = example.stdlib_lines(count + offset, min_chars=6, max_chars=22)[offset:]
    return [{"input_ids": ids, "labels": list(ids)} for ids in tokenizer(lines)["input_ids"]]


def train(case: dict, out: str, replicas: int = 1) -> dict:
    """Build the case's trainer (``replicas``: the per-device batch of one process standing for
    them), parallelize it when ``case['mesh']`` is given, train, evaluate, save; the results."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)   # a Trainer of its own
    trainer = _build(case, out, replicas)
    if case.get("mesh"):
        import loong_compile as lc

        hp, cp = case["mesh"]
        lc.hf.parallelize(trainer, hp=hp, cp=cp, pad_to_multiple_of=case.get("pad_to"),
                          lowering=LOWERING)
    trainer.train()
    results = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
               "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
               "eval_loss": trainer.evaluate()["eval_loss"],
               "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}
    if case.get("save"):
        trainer.save_model(f"{out}/final")
    if case.get("resume"):   # a new trainer from the checkpoint of step 3: steps 4-6 again
        AcceleratorState._reset_state(reset_partial_state=True)
        again = _build(case, out, replicas)
        if case.get("mesh"):
            lc.hf.parallelize(again, hp=hp, cp=cp, pad_to_multiple_of=case.get("pad_to"),
                              lowering=LOWERING)
        again.train(resume_from_checkpoint=f"{out}/checkpoint-3")
        # its log history starts with the checkpoint's: the last three are the steps run again
        results["resumed"] = [e["loss"] for e in again.state.log_history if "loss" in e][-3:]
    AcceleratorState._reset_state(reset_partial_state=True)
    return results


def _build(case: dict, out: str, replicas: int):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    common = dict(output_dir=out, per_device_train_batch_size=BATCH * replicas,
                  per_device_eval_batch_size=BATCH * replicas,
                  gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=1e-3,
                  max_grad_norm=1.0, logging_steps=1, report_to=[], disable_tqdm=True,
                  use_cpu=True, seed=0,
                  save_strategy="steps" if case.get("resume") else "no", save_steps=3)
    if case["trainer"] == "sft":
        tokenizer = example.char_tokenizer()
        packing = case["rows"] == "packed"
        # eval rows padded, not packed: 16 lines make 4 whole batches of the 2 replicas.  float32
        # (SFTConfig's default is bf16); its default gradient checkpointing stays on
        args = SFTConfig(**common, packing=packing, eval_packing=False, max_length=32, bf16=False)
        texts = example.stdlib_lines(64 + 16, min_chars=8, max_chars=40)
        from datasets import Dataset

        return SFTTrainer(model=tiny_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"text": texts[:64]}),
                          eval_dataset=Dataset.from_dict({"text": texts[64:]}),
                          peft_config=lora_config() if case.get("lora") else None)
    vocab = len(example.char_tokenizer())
    args = TrainingArguments(**common, activation_checkpointing=bool(case.get("checkpointing")))
    if case["rows"] == "packed":   # DataCollatorWithFlattening: position ids restart per document
        return Trainer(model=tiny_llama(vocab), args=args, data_collator=DataCollatorWithFlattening(),
                       train_dataset=documents(48), eval_dataset=documents(8, offset=48))
    # plain rows of 30 tokens: padded to the layout's multiple of 8 (hp=2 x cp=2) or 4
    return Trainer(model=tiny_llama(vocab), args=args, train_dataset=text_rows(48, 30),
                   eval_dataset=text_rows(8, 30, offset=48))


def _ranks_train(rank: int, world: int, cases: list[dict], out: str) -> list[dict]:
    import time

    results = []
    for i, case in enumerate(cases):
        # Dynamo's automatic dynamic shapes remember the lengths a code object saw, whatever
        # compiled it: another case's length would make this one's masked graph dynamic
        torch.compiler.reset()
        start = time.perf_counter()
        got = train(case, f"{out}/case{i}")
        got["seconds"] = time.perf_counter() - start
        # every rank holds the same parameters; rank 0's come back whole
        got["checksum"] = sum(p.double().sum().item() for p in got["params"].values())
        if rank:
            got["params"] = None
        results.append(got)
    return results


@contextlib.contextmanager
def isolated():
    """What a Trainer changes in this process (seeds, threads, environment, logging,
    Accelerate's singletons) is put back afterwards."""
    import transformers

    states = (random.getstate(), np.random.get_state(), torch.get_num_threads(), dict(os.environ),
              transformers.logging.get_verbosity())
    with torch.random.fork_rng():
        try:
            yield
        finally:
            from accelerate.state import AcceleratorState

            from loong_compile.testing import reset_process_state

            reset_process_state()        # meshes and compiled code a parallelized run left
            AcceleratorState._reset_state(reset_partial_state=True)
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_num_threads(states[2])
            os.environ.clear()
            os.environ.update(states[3])
            transformers.logging.set_verbosity(states[4])


def reference(case: dict, out: str, replicas: int) -> dict:
    with isolated():
        return train({**case, "mesh": None, "save": False, "resume": False}, out, replicas)


# ---- comparisons ----------------------------------------------------------------------------

def relative(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def params_relative(got: dict, want: dict) -> float:
    """The largest ``|got - want| / |want|`` over the parameters (norms of each tensor)."""
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


def check_case(name: str, got: dict, want: dict) -> dict[str, float]:
    numbers = {"losses": relative(got["losses"], want["losses"]),
               "grad_norms": relative(got["grad_norms"], want["grad_norms"]),
               "eval_loss": relative([got["eval_loss"]], [want["eval_loss"]]),
               "params": params_relative(got["params"], want["params"])}
    print(f"{name}: max relative differences {numbers}")
    assert len(got["losses"]) == STEPS
    for what, difference in numbers.items():
        assert difference <= TOLERANCE, (name, what, difference, got[what], want[what])
    return numbers


CASES = {
    "trainer, plain rows padded, hp=2 x cp=2": {"trainer": "hf", "rows": "plain", "mesh": (2, 2),
                                                "save": True, "resume": True},
    "trainer, plain rows padded, hp=1 x cp=2, dp=2": {"trainer": "hf", "rows": "plain",
                                                      "mesh": (1, 2)},
    "trainer, DataCollatorWithFlattening, hp=1 x cp=2, dp=2": {"trainer": "hf", "rows": "packed",
                                                                "mesh": (1, 2), "pad_to": 48},
    # transformers' gradient checkpointing, taken as the full policy (hf/checkpointing.py)
    "trainer, DataCollatorWithFlattening, checkpointing, hp=2 x cp=2": {
        "trainer": "hf", "rows": "packed", "mesh": (2, 2), "pad_to": 48, "checkpointing": True},
}
SFT_CASES = {
    "sft, packing, hp=1 x cp=2, dp=2": {"trainer": "sft", "rows": "packed", "mesh": (1, 2),
                                        "pad_to": BATCH * 32},
    "sft, packing, hp=2 x cp=2": {"trainer": "sft", "rows": "packed", "mesh": (2, 2),
                                  "pad_to": BATCH * 32},
    "sft, padding, hp=2 x cp=2": {"trainer": "sft", "rows": "padded", "mesh": (2, 2), "pad_to": 48},
}
# SFTTrainer(peft_config=LoraConfig(...)): the base frozen (its weights compared too), the
# adapters trained, saved as PEFT saves them
LORA_CASES = {
    "sft, LoRA, packing, hp=2 x cp=2": {**SFT_CASES["sft, packing, hp=2 x cp=2"], "lora": True,
                                        "save": True},
    "sft, LoRA, packing, hp=1 x cp=2, dp=2": {**SFT_CASES["sft, packing, hp=1 x cp=2, dp=2"],
                                              "lora": True},
}


def _run_family(cases: dict, tmp_path) -> None:
    got = run_distributed(_ranks_train, 4, list(cases.values()), str(tmp_path / "ranks"),
                          timeout=600)
    for i, (name, case) in enumerate(cases.items()):
        replicas = 4 // (case["mesh"][0] * case["mesh"][1])
        start = time.perf_counter()
        want = reference(case, str(tmp_path / f"one{i}"), replicas)
        print(f"{name}: 4 ranks {got[0][i]['seconds']:.1f} s, one process "
              f"{time.perf_counter() - start:.1f} s")
        assert all(r[i]["losses"] == got[0][i]["losses"] for r in got), "every rank logs one loss"
        assert len({r[i]["checksum"] for r in got}) == 1, "every rank holds the same parameters"
        check_case(name, got[0][i], want)
        if case.get("resume"):
            assert relative(got[0][i]["resumed"], got[0][i]["losses"][3:]) <= TOLERANCE
        if case.get("save"):
            _check_saved(tmp_path / "ranks" / f"case{i}" / "final", want["params"])


def _check_saved(path: Path, want_params: dict) -> None:
    """from_pretrained in this process: the trained weights (no compile-wrapper prefixes) give
    one process's logits and loss; an adapter (PEFT's files) on the base it was trained on."""
    from transformers import LlamaForCausalLM

    vocab = len(example.char_tokenizer())
    if (path / "adapter_config.json").exists():   # PEFT's keys: base_model.model.model.layers...
        from peft import PeftModel, get_peft_model

        loaded = PeftModel.from_pretrained(tiny_llama(vocab), path)
        reference_model = get_peft_model(tiny_llama(vocab), lora_config())
    else:
        loaded, reference_model = LlamaForCausalLM.from_pretrained(path), tiny_llama(vocab)
        assert not any("model.model." in k for k in loaded.state_dict())
    assert not any("_orig_mod" in k for k in loaded.state_dict())
    reference_model.load_state_dict(want_params)
    ids = torch.stack([r["input_ids"] for r in text_rows(2, 30, offset=60)])
    with torch.no_grad():
        got, want = loaded(ids, labels=ids), reference_model(ids, labels=ids)
    assert ((got.logits - want.logits).norm() / want.logits.norm()).item() <= TOLERANCE
    assert relative([got.loss.item()], [want.loss.item()]) <= TOLERANCE


def test_trainer_equals_one_process(tmp_path):
    """transformers.Trainer: plain rows of 30 tokens padded to the layout at hp=2 x cp=2 (with
    evaluate, save_model -> from_pretrained, resume from checkpoint-3), and packed documents
    (DataCollatorWithFlattening, no attention mask) at hp=1 x cp=2 with 2 replicas, and at
    hp=2 x cp=2 with gradient checkpointing (activation_checkpointing=True)."""
    _run_family(CASES, tmp_path)


@pytest.mark.compat   # torch 2.11's Dynamo broke the graph at transformers' embedding hook
def test_sft_trainer_equals_one_process(tmp_path):
    """trl.SFTTrainer with packing (BFD, padding-free rows: position ids per document) over 2
    replicas, and with padding (attention mask, right-padded rows) at hp=2 x cp=2."""
    _run_family(SFT_CASES, tmp_path)


def test_sft_trainer_with_lora_equals_one_process(tmp_path):
    """SFTTrainer(peft_config=LoraConfig(...), packing=True) at hp=2 x cp=2 (the adapter saved,
    loaded with PeftModel.from_pretrained) and at hp=1 x cp=2 with 2 replicas."""
    _run_family(LORA_CASES, tmp_path)


# ---- the example --------------------------------------------------------------------------

def test_example_under_torchrun_equals_one_process(tmp_path):
    """examples/train_hf_trainer.py (SFTTrainer, packing) as documented, on 4 CPU ranks at
    hp=2 x cp=2: its logged losses are those of the example in one process."""
    argv = ["--steps", "4", "--dim", "32", "--layers", "1", "--max-length", "64",
            "--lowering", LOWERING]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_hf_trainer.py"), *argv,
           "--output-dir", str(tmp_path / "ranks")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("losses:")]
    losses = [float(x) for x in line.split()[1:]]
    with isolated():
        want = example.main([*argv, "--hp", "1", "--cp", "1", "--output-dir", str(tmp_path / "one")])
    print(f"example: losses {losses}, one process {want}")
    assert len(losses) == 4 and relative(losses, want) <= TOLERANCE


# ---- refusals (one process: parallelize refuses before it builds a mesh) --------------------

def _trainer(out, **overrides):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True,
                             **overrides.pop("args", {}))
    return Trainer(model=tiny_llama(64), args=args, train_dataset=text_rows(4, 30), **overrides)


class _OwnLoss:
    def compute_loss(self, model, inputs, **kwargs):   # noqa: D401 - a user's override
        return model(**inputs).loss


@pytest.mark.parametrize("overrides, named", [
    ({"args": {"torch_compile": True}}, "torch_compile=True"),
    ({"args": {"label_smoothing_factor": 0.1}}, "label_smoothing_factor=0.1"),
    ({"args": {"neftune_noise_alpha": 5.0}}, "neftune_noise_alpha=5.0"),
    ({"args": {"include_num_input_tokens_seen": "all"}}, "include_num_input_tokens_seen='all'"),
    ({"compute_metrics": lambda p: {}}, "compute_metrics"),
    ({"compute_loss_func": lambda *a, **k: 0}, "compute_loss_func"),
    ({"subclass": _OwnLoss}, "_OwnLoss.compute_loss"),
])
def test_refused_by_name(overrides, named, tmp_path):
    import loong_compile as lc

    with isolated():
        subclass = overrides.pop("subclass", None)
        trainer = _trainer(str(tmp_path), **overrides)
        if subclass is not None:
            trainer.__class__ = type("Mine", (subclass, type(trainer)), {})
        with pytest.raises(LoongConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
            lc.hf.parallelize(trainer, hp=1, cp=2)


def test_a_second_masked_length_is_refused_with_the_fix():
    from loong_compile.hf.trainer import LoongState, LoongTrainerMixin

    state = LoongState(mesh=None, step=None, pad_token_id=0, pad_to_multiple_of=None,
                       tokens_across_replicas=True)
    trainer = type("T", (LoongTrainerMixin,), {"_loong": state})()
    trainer._check_one_length(32)
    trainer._check_one_length(32)
    with pytest.raises(LoongShapeError, match="pad_to_multiple_of"):
        trainer._check_one_length(40)
