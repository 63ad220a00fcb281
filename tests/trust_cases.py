"""The trust matrix's cells: which model, attention, window and habit each case is
(``all_cases``), and what a case is made of wherever it runs: its model, its inputs (ids, packed
documents, padding) and its loss.  One process (trust_reference.py) and the ranks
(trust_run.py) build a case from these alike.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from hf_models import ARCHITECTURES, MOE, SCAN_ARCHITECTURES, WINDOWED, build

BATCH, SEQ = 2, 48
# LFM2's short convolution splits its in-projection (B, 3*32, T) along the channels: 96 is a
# multiple of 24 and 12 tokens (2 and 4 ranks at 48), and the token analysis takes any axis whose
# size is a multiple of the tokens per rank for a token axis (docs/attention.md, "Scans")
SEQ_OF = {"lfm2": 56}
# on 2 ranks a rank holds 24 tokens: shorter than a rank's share, between it and the sequence,
# longer than the sequence
WINDOW_SHARD, WINDOW_SHORT, WINDOW_LONG = 16, 32, 64
# the models computed in float32: their experts' grouped_mm has no float64 kernel on CPU
FLOAT32_MODELS = MOE + ("gpt_oss", "llama4")
# every architecture gets the habits that depend on its code (labels=: its head's logits, which
# some scale or softcap; no position ids: the positions it makes); the habits that depend on
# transformers' shared code (masks, caches, the loss given shift_labels=) or on ours run on four
# architectures
HABITS_EVERY_ARCH = ("plain", "labels", "no_position_ids")
# the scan models' own code is their mixers, which labels= does not reach (their heads are
# plain): plain rows and the positions their attention layers make, labels= on one
SCAN_HABITS = ("plain", "no_position_ids")
# grad_ckpt: transformers' default (use_reentrant=False); eval_no_grad: the forward alone under
# torch.no_grad() in eval mode, the logits compared too
HABITS_SAMPLED = ("shift_labels", "labels_no_position_ids", "use_cache_false", "grad_ckpt",
                  "grad_ckpt_reentrant",
                  "padding", "packed",
                  "packed_use_cache_false", "bf16", "autocast_bf16", "no_shard_batch",
                  "eval_no_grad")
SAMPLED_ARCHS = ("llama", "qwen2", "gemma3", "gpt2")
# the scan models with packed documents: the gated DeltaNets and the Mamba-2s (their convolutions
# too)
SCAN_PACKED_ARCHS = ("qwen3_5", "qwen3_next", "falcon_h1", "bamba")
LONG_WINDOW_ARCHS = ("mistral", "gemma3", "qwen3")
# the router's load-balancing loss (each model's own code: statistics over the whole sequence's
# routing, refused), and the experts implementations users select besides grouped_mm
# (transformers' shared code: on one model)
MOE_HABITS = ("router_aux_loss",)
# transformers' loss on unshifted labels (this rank's ids): alone, without position ids (the
# plainest call, model(ids, labels=ids)), and in the balanced order (refused)
LABELS_HABITS = ("labels", "labels_no_position_ids", "packed_balanced_labels")
EXPERTS_HABITS = ("experts_batched_mm", "experts_eager")
# The loss inside the compiled function (issue 22: the LM head is chunked with it, in chunks of
# LM_HEAD_CHUNK tokens): transformers' own loss (labels=, shift_labels=, num_items_in_batch=),
# with key padding, and loong_compile.NextTokenLoss on a head tied to the embedding.  Gemma3 gets
# a final-logit softcap small enough to bend these logits.
LM_HEAD_CHUNK, SOFTCAP = 8, 0.1
# PEFT LoRA (habit "lora"): the projections the user adapts, in attention and the MLP
LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str
    attn: str = "sdpa"
    window: int | None = None
    habit: str = "plain"
    # how the model is compiled: "model" (torch.compile of the whole model), "blocks"
    # (lc.hf.compile_blocks), "by_hand" (each decoder layer's .compile(backend=...)) or
    # "holder" (a closure over a trainer calling the model it holds: lambda b: self.model(**b))
    compile: str = "model"

    @property
    def name(self) -> str:
        window = f"-w{self.window}" if self.window else ""
        way = "" if self.compile == "model" else f"-{self.compile}"
        return f"{self.arch}-{self.attn}{window}-{self.habit}{way}"


LOSS_IN_GRAPH_CASES = [Case("llama", habit="loss_in_graph"), Case("gemma3", habit="loss_in_graph"),
                       Case("qwen2", habit="loss_in_graph_padding"),
                       Case("llama", habit="loss_in_graph_tied")]


def all_cases() -> list[Case]:
    cases = [Case(arch, habit=habit) for arch in ARCHITECTURES for habit in HABITS_EVERY_ARCH]
    cases += [Case(arch, habit=habit) for arch in SAMPLED_ARCHS for habit in HABITS_SAMPLED]
    cases += [Case(arch, attn="eager") for arch in ARCHITECTURES]
    # the eager chain with the habits that change its mask or put it in a checkpointed body
    cases += [Case("llama", attn="eager", habit="grad_ckpt"),
              Case("llama", attn="eager", habit="autocast_bf16"),
              Case("qwen2", attn="eager", habit="labels"),
              Case("qwen2", attn="eager", habit="padding"),
              Case("gemma3", attn="eager", habit="packed_use_cache_false"),
              Case("mistral", attn="eager", window=WINDOW_SHARD)]
    cases += [Case(arch, window=WINDOW_SHORT) for arch in WINDOWED]
    cases += [Case(arch, window=WINDOW_LONG) for arch in LONG_WINDOW_ARCHS]
    cases += [Case(arch, window=WINDOW_SHARD, habit=habit) for arch in LONG_WINDOW_ARCHS
              for habit in ("plain", "packed_use_cache_false")]
    cases += [Case(arch, window=WINDOW_SHARD, habit="padding") for arch in ("qwen2", "mistral")]
    cases += [Case(arch, window=WINDOW_SHARD) for arch in ("exaone4", "cohere2")]
    cases += [Case("deepseek_v3", habit="packed_use_cache_false")]  # MLA in the masked exchange
    # documents dealt head/tail over the CP ranks (shard_batch(balance_documents=True))
    # (use_cache=False: transformers reads documents from the positions only without a cache)
    cases += [Case(arch, habit="packed_balanced_use_cache_false")
              for arch in ("llama", "qwen2", "gemma3")]
    cases += [Case("mistral", window=WINDOW_SHARD, habit="packed_balanced_use_cache_false"),
              Case("llama", habit="packed_balanced"), Case("llama", habit="packed_balanced_mask")]
    # labels= shifted by the model in the balanced order, and a batch fed whole to every rank of
    # a model that numbers its tokens itself: neither can be exact, both refused by name
    cases += [Case("llama", habit="packed_balanced_labels"),
              Case("llama", habit="no_shard_batch_no_position_ids")]
    # packed documents cut by shard_batch, the model called without their positions: it would
    # number each row as one sequence (refused by name)
    cases += [Case("llama", habit="packed_no_position_ids")]
    # DeepSeek-V3's transformers model computes no load-balancing loss: the others only
    cases += [Case(arch, habit=habit) for arch in MOE if arch != "deepseek_v3_moe"
              for habit in MOE_HABITS]
    cases += [Case("mixtral", habit=habit) for habit in EXPERTS_HABITS]
    # PEFT's LoRA (issue 51): the modules found through PEFT's wrappers, the window among them
    # (32 > a rank's 24 tokens: no mask, the window read from the module)
    cases += [Case("llama", habit="lora"), Case("mistral", window=WINDOW_SHORT, habit="lora")]
    # labels=batch.labels: shard_batch's labels, shifted over the whole sequence, where
    # transformers expects unshifted ones (it would shift them twice): refused on every rank
    cases += [Case("llama", habit="batch_labels")]
    cases += [Case(arch, habit=habit) for arch in SCAN_ARCHITECTURES for habit in SCAN_HABITS]
    cases += [Case("qwen3_next", habit="labels")]
    # a bf16 model: the scans' proofs run the region in the model's dtypes (its casts are constants)
    cases += [Case("qwen3_next", habit="bf16"), Case("falcon_h1", habit="bf16")]
    # packed documents through the scans, each from a zero state as the kernels users run (issue
    # 51: judged against each document alone); in the balanced order no reset can be placed
    cases += [Case(arch, habit="packed_use_cache_false") for arch in SCAN_PACKED_ARCHS]
    cases += [Case("qwen3_5", habit="packed_balanced_use_cache_false")]
    # chunked attention both ways; transformers builds gpt-oss (sinks) and Gemma 2 (softcapped
    # scores) with eager attention only
    # (packed documents: transformers counts a document's chunks from its own start)
    cases += [Case("llama4"), Case("llama4", attn="eager"),
              Case("llama4", habit="packed_use_cache_false"), Case("gpt_oss", attn="eager"),
              Case("gemma2", attn="eager")]
    return cases


def seq_len(arch: str) -> int:
    return SEQ_OF.get(arch, SEQ)


def token_ids(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


# documents of 5, 7, 12 and 24 tokens (boundaries inside a chunk, on a zigzag chunk edge and on
# the ranks' shard edge; the last one spans two ranks) in the first row, of 20 and 28 in the second
PACKED = ([5, 7, 12, 24], [20, 28])


# balance_documents needs room to pad each document to a multiple of 2*cp: the first row ends
# in BALANCE_ROOM tokens of right padding (attention_mask 0, labels -100), which one process
# sees as a document of its own after the others (no real token sees it)
BALANCE_ROOM = 4
BALANCED = ([5, 7, 12, 20, BALANCE_ROOM], [20, 28])


def packed_positions(rows=PACKED) -> torch.Tensor:
    """Positions restarting at 0 per document (what one process is given)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def packed_documents(rows=PACKED) -> torch.Tensor:
    """The same documents as ids, for ``shard_batch(document_ids=...)``."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in rows])


def balance_room() -> torch.Tensor:
    """``(B, S)`` bool: the tokens of the room balance_documents pads in."""
    room = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    room[0, SEQ - BALANCE_ROOM:] = True
    return room


def padding_mask() -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ - 4:] = 0  # right padding on the first row
    mask[1, :6] = 0  # left padding on the second row
    return mask


def precision(arch: str) -> torch.dtype:
    """float64, float32 where a kernel has no float64 (MoE's grouped_mm)."""
    return torch.float32 if arch in FLOAT32_MODELS else torch.float64


def case_model(case: Case, dtype: torch.dtype) -> torch.nn.Module:
    """The case's model in ``dtype``, with what its habit sets on the model itself (a softcap
    and a tied head for the loss in the graph, an experts implementation, LoRA adapters)."""
    return _lora_setup(case, _experts_setup(case, _loss_in_graph_setup(
        case, build(case.arch, case.attn, case.window, dtype))))


def _loss_in_graph_setup(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    if case.habit.startswith("loss_in_graph") and case.arch == "gemma3":
        model.config.final_logit_softcapping = SOFTCAP
    if case.habit == "loss_in_graph_tied":
        model.lm_head.weight = model.get_input_embeddings().weight
    return model


def _experts_setup(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    if case.habit.startswith("experts_"):
        model.set_experts_implementation(case.habit.removeprefix("experts_"))
    return model


def _lora_setup(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's LoRA on attention and MLP projections (issue 51): the base frozen, the adapters in
    the model's dtype, both factors drawn (PEFT's default zero B would leave A's gradient 0)."""
    if not case.habit.startswith("lora"):
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(target_modules=LORA_TARGETS, r=4, lora_alpha=8,
                                            init_lora_weights=False))


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="sum",
                           ignore_index=-100) / count


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def label_count(seq: int = SEQ) -> int:
    return BATCH * (seq - 1)


def habit_autocast(case: Case):
    """bf16 autocast around the forward and the loss for that habit (the usual mixed
    precision: float32 weights), nothing otherwise."""
    if case.habit == "autocast_bf16":
        return torch.autocast("cpu", torch.bfloat16)
    return contextlib.nullcontext()
