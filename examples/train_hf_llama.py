"""Train a Hugging Face LlamaForCausalLM (random init from a LlamaConfig, no download) with backend="loong".

    torchrun --nproc-per-node 4 examples/train_hf_llama.py                 # hp=2, cp=2
    torchrun --nproc-per-node 4 examples/train_hf_llama.py --hp 4 --cp 1   # GQA: 2 KV heads < hp, replicated
    torchrun --nproc-per-node 8 examples/train_hf_llama.py --hp 2 --cp 2 --fsdp   # + FSDP2 over dp x cp x hp

The model is not modified: attention stays transformers' SDPA path, which the
backend rewrites into 2D-Attention.  Leave ``use_cache`` at its default: with
``use_cache=False`` transformers builds a packed-sequence mask from
``position_ids`` under torch.compile, and a mask cannot be distributed exactly
(the backend then refuses the model with a clear error).  The compiled function is the model
and its loss (``loong_compile.NextTokenLoss``, examples/training.py): the LM head and the loss
are chunked by tokens, and the logits never exist.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from training import common_parser, finish_distributed, init_distributed, train  # noqa: E402


def build_model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=int(8 * args.dim / 3) // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                      attn_implementation="sdpa", attention_dropout=0.0)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> list[float]:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.set_defaults(hp=2, cp=2, dump_dir="out/hf_llama_dump")
    args = parser.parse_args(argv)
    init_distributed()
    model = build_model(args)
    return train(model, args)


if __name__ == "__main__":
    main()
    finish_distributed()
