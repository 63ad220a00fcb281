"""Fine-tune with TRL's SFTTrainer over hp x cp ranks per sequence: one line, lc.hf.parallelize.

    python -m torch.distributed.run --nproc-per-node 4 examples/train_hf_trainer.py            # hp=2, cp=2
    python -m torch.distributed.run --nproc-per-node 4 examples/train_hf_trainer.py --hp 1 --cp 2   # + 2 replicas
    python examples/train_hf_trainer.py --hp 1 --cp 1                                         # one process

A tiny Llama built from its config (no download), a character-level tokenizer built in memory,
and documents that every machine with Python has: the lines of the standard library's source,
packed by SFTTrainer (``packing=True``: rows of several documents, position ids restarting at
0 per document, no padding).  The Trainer, its data loading, logging, evaluation and
checkpoints are TRL's and transformers'; ``lc.hf.parallelize`` makes the ranks of one sequence
share each batch, runs the model compiled with ``backend="loong"`` (the loss in the graph) and
reduces the gradients over the mesh.  Prints the logged losses (rank 0), returns them.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import torch

import loong_compile as lc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import finish_distributed  # noqa: E402

CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,:;()[]_=+-*/'\"#\n"
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (61 ids: 3 special, the lower-case
    letters, digits and common punctuation), built in memory."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL, *CHARS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def stdlib_lines(count: int, min_chars: int = 8, max_chars: int = 60) -> list[str]:
    """The first ``count`` lines of the standard library's .py files (sorted) whose stripped,
    lower-cased text is ``min_chars`` to ``max_chars`` characters long."""
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(errors="ignore").splitlines():
            line = line.strip().lower()
            if min_chars <= len(line) <= max_chars:
                lines.append(line)
                if len(lines) == count:
                    return lines
    return lines


def build_model(vocab_size: int, dim: int, layers: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=dim, intermediate_size=3 * dim // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, attn_implementation="sdpa", attention_dropout=0.0))


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2, help="packed rows per replica")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per packed row")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lowering", default="inductor", help="the backend's lowering")
    parser.add_argument("--output-dir", default="out/hf_trainer")
    args = parser.parse_args(argv)

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = char_tokenizer()
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        packing=True, max_length=args.max_length, logging_steps=max(1, args.steps // 10),
        save_strategy="no", report_to=[], disable_tqdm=True,
        # SFTConfig's bf16 default on a GPU; float32 on CPU (no fast bf16 there)
        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    trainer = SFTTrainer(model=build_model(len(tokenizer), args.dim, args.layers, seed=0),
                         args=config, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": stdlib_lines(4000)}))
    # packed rows vary in length; padded to one (a new document of pads) they compile once
    lc.hf.parallelize(trainer, hp=args.hp, cp=args.cp, pad_to_multiple_of=args.batch * args.max_length,
                      lowering=args.lowering)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if trainer.is_world_process_zero():
        print("losses:", " ".join(f"{loss:.8g}" for loss in losses), flush=True)
    return losses


if __name__ == "__main__":
    trained = bool(main())
    finish_distributed()
    sys.exit(0 if trained else 1)
