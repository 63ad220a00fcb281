"""DeepSpeed's ALST recipe on a transformers Llama, the peer that ``longest_sequence.py`` measures
``backend="loong"`` against (issue 52).

Arctic Long Sequence Training (Snowflake, DeepSpeed ``runtime/sequence_parallel/ulysses_sp.py``)
as its tutorial assembles it, minus what a CPU cannot show:

- Ulysses attention over all ranks (``UlyssesSPAttentionHF.register_with_transformers``): each
  rank holds a contiguous ``1/world`` of the tokens, an all-to-all gives it every token of
  ``heads/world`` heads for transformers' SDPA, another brings its tokens back.  None at one
  process (ALST's ``sequence_parallel_size=1``).
- ``TiledMLP`` on every layer's MLP with ALST's tile count, ``ceil(tokens / hidden)`` (agreed
  over the ranks, as its docstring's recipe does).
- The loss with ``TiledFusedLogitsLoss`` over the LM head and cross-entropy, the logits never
  whole: tiles of ``hidden`` tokens as the MLP's, summed then divided by the sequence's label
  count, so the ranks' losses add up to the sequence's mean.
- transformers' gradient checkpointing (non-reentrant), each layer's input saved.

Left out: the checkpointed inputs' offload to the host (on CPU the host is the device, so it
moves nothing out of the process) and ZeRO-3 (every variant of the benchmark keeps its model
states whole, with AdamW).  Runs eagerly, as ALST does.  Needs ``pip install deepspeed``.
"""

from __future__ import annotations

import math
import os
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F


def apply(model: torch.nn.Module, world: int) -> None:
    """Ulysses attention over ``world`` ranks (the process group already up), TiledMLP on every
    layer and gradient checkpointing, applied to ``model`` (not to its class)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF

    if world > 1:
        deepspeed.init_distributed(dist_backend="gloo")
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa",
            sequence_parallel_size=world, micro_batch_size=1, seq_length_is_variable=True)

    def tiled_forward(mlp, x):
        shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]))
        if dist.is_initialized():
            dist.all_reduce(shards, op=dist.ReduceOp.MAX)
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        return TiledMLP.apply(_mlp, mlp, x, int(shards), weights)

    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(tiled_forward, layer.mlp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _mlp(mlp, x):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def shard(ids: torch.Tensor, world: int, rank: int) -> dict:
    """This rank's inputs for one ``(1, S)`` row, as ``UlyssesSPDataLoaderAdapter`` cuts them: the
    labels shifted on the whole row (``-100`` after its last token), then every tensor cut into
    ``world`` contiguous pieces."""
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    piece = ids.shape[1] // world
    cut = slice(rank * piece, (rank + 1) * piece)
    return {"input_ids": ids[:, cut].contiguous(), "position_ids": positions[:, cut].contiguous(),
            "shift_labels": labels[:, cut].contiguous(),
            "num_labels": int((labels != -100).sum())}


def loss(model: torch.nn.Module, input_ids, position_ids, shift_labels, num_labels: int):
    """This rank's share of the row's mean next-token loss, the logits a tile at a time."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden = model.model(input_ids=input_ids, position_ids=position_ids,
                         use_cache=False).last_hidden_state
    head = model.lm_head
    shards = max(1, math.ceil(hidden.shape[1] / hidden.shape[2]))
    total = TiledFusedLogitsLoss.apply(_head_loss, head, hidden, shift_labels, None, shards,
                                       [head.weight], "sum")
    return total / num_labels


def _head_loss(head, x, y):
    return F.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")
