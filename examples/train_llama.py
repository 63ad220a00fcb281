"""Train the small Llama of examples/llama.py with backend="loong".

    python examples/train_llama.py                                   # one process
    torchrun --nproc-per-node 4 examples/train_llama.py --hp 2 --cp 2  # 2D-Attention on 4 ranks

Every LoongConfig key is a flag (--activations memo, --memory-plan, --dump-dir out/,
--lm-head-chunk 1024, ...).  The compiled function is the model and its loss
(``loong_compile.NextTokenLoss``, examples/training.py), so the LM head is chunked with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from llama import Llama, LlamaConfig  # noqa: E402
from training import common_parser, finish_distributed, init_distributed, train  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args(argv)
    init_distributed()
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_dim=int(8 * args.dim / 3) // 8 * 8)
    model = Llama(cfg)
    return train(model, args)


if __name__ == "__main__":
    main()
    finish_distributed()
