"""The trust matrix: real Hugging Face models x the habits users have, exact or refused.

Each case trains one step of a tiny model under ``backend="loong"`` on 2 or 4 gloo ranks and
compares the loss and gradients (summed over the ranks, as the examples' training loop does)
with one process on the full sequence in float64 (float32 for the mixtures of experts: see
``_precision``) — or records the ``LoongError`` it raised.
``python tests/trust_matrix.py`` prints the table that docs/usage.md shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import gated_delta_recurrence, loong_error_in, mamba2_recurrence  # noqa: E402
from hf_models import (  # noqa: E402
    ARCHITECTURES, ATTENTION_VARIANTS, MOE, SCAN_ARCHITECTURES, WINDOWED, build)

BATCH, SEQ = 2, 48
# LFM2's short convolution splits its in-projection (B, 3*32, T) along the channels: 96 is a
# multiple of 24 and 12 tokens (2 and 4 ranks at 48), and the token analysis takes any axis whose
# size is a multiple of the tokens per rank for a token axis (docs/attention.md, "Scans")
SEQ_OF = {"lfm2": 56}
# on 2 ranks a rank holds 24 tokens: shorter than a rank's share, between it and the sequence,
# longer than the sequence
WINDOW_SHARD, WINDOW_SHORT, WINDOW_LONG = 16, 32, 64
FLOAT32_INSIDE = ("gemma3", "cohere", "cohere2")
# the models computed in float32: their experts' grouped_mm has no float64 kernel on CPU
FLOAT32_MODELS = MOE + ("gpt_oss", "llama4")
# the eager attention chains whose softmax stays in the model's dtype (the others upcast to float32)
FLOAT64_SOFTMAX = ("gpt2", "falcon")
# every architecture gets the habits that depend on its code; the habits that depend on
# transformers' shared code (masks, caches) or on ours run on four architectures
HABITS_EVERY_ARCH = ("plain", "labels", "shift_labels", "no_position_ids")
# grad_ckpt: transformers' default (use_reentrant=False); eval_no_grad: the forward alone under
# torch.no_grad() in eval mode, the logits compared too
HABITS_SAMPLED = ("labels_no_position_ids", "use_cache_false", "grad_ckpt", "grad_ckpt_reentrant",
                  "padding", "packed",
                  "packed_use_cache_false", "bf16", "autocast_bf16", "no_shard_batch",
                  "eval_no_grad")
SAMPLED_ARCHS = ("llama", "qwen2", "gemma3", "gpt2")
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
# Every model here normalises in float32 inside (RMSNorm's upcast); Inductor fuses those float32
# reductions differently from eager, so float64 models agree to float32 round-off, not float64's
# (the example Llama: 1.3e-7, with the LM-head pass and without it alike).  A token chunk lost
# or counted twice, or a token seen by the wrong query, is off by more than 1e-2.
INDUCTOR_TOLERANCE = 1e-5
TABLE_COLUMNS = 11  # models per table in docs/usage.md (two tables: the first eleven, the rest)


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str
    attn: str = "sdpa"
    window: int | None = None
    habit: str = "plain"

    @property
    def name(self) -> str:
        window = f"-w{self.window}" if self.window else ""
        return f"{self.arch}-{self.attn}{window}-{self.habit}"


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
    cases += [Case(arch, habit=habit) for arch in SCAN_ARCHITECTURES for habit in HABITS_EVERY_ARCH]
    # a bf16 model: the scans' proofs run the region in the model's dtypes (its casts are constants)
    cases += [Case("qwen3_next", habit="bf16"), Case("falcon_h1", habit="bf16")]
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


def _precision(arch: str) -> torch.dtype:
    """float64, float32 where a kernel has no float64 (MoE's grouped_mm)."""
    return torch.float32 if arch in FLOAT32_MODELS else torch.float64


def _dtype(case: Case) -> torch.dtype:
    return {"bf16": torch.bfloat16, "autocast_bf16": torch.float32}.get(case.habit,
                                                                         _precision(case.arch))


def _model_for(case: Case) -> torch.nn.Module:
    model = _experts_setup(case, _loss_in_graph_setup(case, build(case.arch, case.attn, case.window,
                                                                   _dtype(case))))
    if case.habit.startswith("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": case.habit == "grad_ckpt_reentrant"})
    return model.eval() if case.habit == "eval_no_grad" else model


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


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="sum",
                           ignore_index=-100) / count


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _label_count(seq: int = SEQ) -> int:
    return BATCH * (seq - 1)


def _autocast(case: Case):
    """bf16 autocast around the forward and the loss for that habit (the usual mixed
    precision: float32 weights), nothing otherwise."""
    if case.habit == "autocast_bf16":
        return torch.autocast("cpu", torch.bfloat16)
    return contextlib.nullcontext()


@functools.cache   # judging a case asks for it several times (its tolerance, an sdpa twin)
def reference(case: Case, dtype: torch.dtype | None = None, autocast: bool = False,
              exact_kernel: bool = False) -> tuple[float, dict]:
    """One process, full sequence (``_precision`` unless asked): the loss and gradients the user
    meant.  ``autocast``: under the case's autocast (with ``dtype`` float32: what one
    process computes); ``exact_kernel``: with the model's float32 scan kernel replaced by the
    exact recurrence (``EXACT_KERNELS``)."""
    if exact_kernel:
        with _float64_kernel(case.arch):
            return reference.__wrapped__(case, dtype, autocast)
    dtype = dtype or _precision(case.arch)
    model = _experts_setup(case, _loss_in_graph_setup(case, build(case.arch, case.attn,
                                                                   case.window, dtype)))
    seq = seq_len(case.arch)
    ids = token_ids(seq=seq)
    labels = _shifted(ids)
    kwargs = {"position_ids": torch.arange(seq).expand(BATCH, -1)}
    if case.habit.startswith("packed"):
        kwargs["position_ids"] = packed_positions()
    if case.habit.startswith("packed_balanced"):
        kwargs["position_ids"] = packed_positions(BALANCED)
        labels = _shifted(ids.masked_fill(balance_room(), -100))
    if case.habit.endswith("use_cache_false"):
        kwargs["use_cache"] = False
    if case.habit.endswith("padding"):
        kwargs["attention_mask"] = padding_mask()
        labels = labels.masked_fill(_shifted(padding_mask()) == 0, -100)
    if case.habit == "eval_no_grad":
        with torch.no_grad():
            logits = model.eval()(ids, **kwargs).logits
        loss = _summed_loss(logits, labels, _label_count(seq))
        return loss.item(), {"logits": logits.double().numpy()}
    with _autocast(case) if autocast else contextlib.nullcontext():
        if case.habit in LABELS_HABITS + ("shift_labels", "loss_in_graph",
                                          "loss_in_graph_padding", "router_aux_loss"):
            unshifted = ids.masked_fill(padding_mask() == 0, -100) if "padding" in case.habit else ids
            if case.habit == "router_aux_loss":
                kwargs["output_router_logits"] = True
            loss = model(ids, labels=unshifted, **kwargs).loss
        else:
            count = int((labels != -100).sum())
            loss = _summed_loss(model(ids, **kwargs).logits, labels, count)
    loss.backward()
    return loss.item(), {n: p.grad.double().numpy() for n, p in model.named_parameters()
                         if p.grad is not None}


# the models whose scan kernel computes in float32 whatever the model's dtype (transformers' gated
# delta rule and Mamba-2 scan cast): judged within twice one process's own float32 error, against
# one process with the recurrence computed token by token in the model's dtype in its place
# (_float64_kernel).  Each: its transformers module's function, and the exact recurrence.
EXACT_KERNELS = {"qwen3_next": ("torch_chunk_gated_delta_rule", gated_delta_recurrence),
                 "qwen3_5": ("torch_chunk_gated_delta_rule", gated_delta_recurrence),
                 "falcon_h1": ("mamba2_chunk_scan", mamba2_recurrence)}


@contextlib.contextmanager
def _float64_kernel(arch: str):
    """The model's float32 scan kernel (``EXACT_KERNELS``) replaced, while inside, by the
    recurrence token by token in the model's dtype (what its float32 kernel approximates)."""
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    name, exact = EXACT_KERNELS[arch]
    original = getattr(module, name)
    setattr(module, name, exact)
    try:
        yield
    finally:
        setattr(module, name, original)


def relative_error(got: tuple[float, dict], ref: tuple[float, dict]) -> float:
    """Largest relative error over the loss and every parameter's gradient (as a whole)."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    worst = abs(loss - ref_loss) / abs(ref_loss)
    for name, grad in ref_grads.items():
        grad = torch.from_numpy(grad)
        mine = torch.from_numpy(grads[name]) if name in grads else torch.zeros_like(grad)
        worst = max(worst, float((mine - grad).norm() / grad.norm().clamp_min(1e-30)))
    return worst


def tolerance(case: Case) -> float:
    """float64 round-off, float32 where the model computes in float32 inside (Gemma3's norms,
    transformers' loss casts the logits to float32) or is float32 (MoE: one process's
    grouped_mm against one matmul per expert on a rank, 3e-7), and for bf16 twice one
    process's own bf16 error against float64."""
    if case.habit == "bf16":
        return 2 * relative_error(reference(case, torch.bfloat16), reference(case))
    if case.habit == "autocast_bf16":
        return 2 * relative_error(reference(case, torch.float32, autocast=True), reference(case))
    if case.arch in EXACT_KERNELS:
        return 2 * relative_error(reference(case), reference(case, exact_kernel=True))
    if case.arch in FLOAT32_INSIDE + FLOAT32_MODELS or case.habit in LABELS_HABITS + (
            "shift_labels", "loss_in_graph", "loss_in_graph_padding"):
        return 1e-5
    if case.attn == "eager" and case.arch not in FLOAT64_SOFTMAX:
        # transformers' eager softmax upcasts to float32; 2D-Attention computes in float64, so
        # it is float32's round-off from one process (and float64-exact against sdpa's one
        # process, which test_trust_matrix checks beside)
        return 1e-5
    return 1e-9


def warm_references(cases: list[Case]) -> None:
    """Compute (into ``reference``'s cache) what judging each case needs of one process, while
    the ranks compute the cases: the caller's process is otherwise idle then.  A case whose
    reference raises is left to its test, which computes it again and fails alone."""
    for case in cases:
        with contextlib.suppress(Exception):
            tolerance(case)   # and the references it reads, reference(case) among them


def _distributed_step(case: Case, hp: int, cp: int, extra_options: dict | None = None):
    import torch.distributed as dist

    import loong_compile as lc
    from loong_compile.parallel.tokens import mesh_token_indices

    if case.habit.startswith("loss_in_graph"):
        return (*loss_in_graph_step(case, hp, cp, "aot_eager")[:2], {})

    mesh = lc.init_mesh(hp=hp, cp=cp)
    model = _model_for(case)
    options = {"hp": hp, "cp": cp, "lowering": "aot_eager", "rank_check_timeout": 120,
               **(extra_options or {})}
    # grad_ckpt: Dynamo breaks the graph before the LM head: the fix the refusal of that graph
    # names
    if case.habit.startswith("grad_ckpt"):
        options["allow_graphs_without_attention"] = True
    reports = []
    compiled = torch.compile(model, backend=lc.LoongBackend(options, on_report=reports.append))
    seq = seq_len(case.arch)
    ids = token_ids(seq=seq)
    documents = packed_documents() if case.habit.startswith("packed") else None
    if case.habit.startswith("packed_balanced"):
        batch = lc.shard_batch(ids, ids.masked_fill(balance_room(), -100), mesh,
                               document_ids=packed_documents(BALANCED), balance_documents=True,
                               attention_mask=(~balance_room()).long())
    else:
        batch = lc.shard_batch(ids, ids, mesh, document_ids=documents)
    labels, count = batch.labels, _label_count(seq)
    if case.habit.startswith("packed_balanced"):
        count = int(batch.num_labels)
    kwargs = {"position_ids": batch.position_ids}
    if case.habit == "packed_balanced_mask":  # a mask of padding alone: no documents read
        kwargs["attention_mask"] = torch.ones_like(batch.input_ids)
    index = mesh_token_indices(seq, mesh)
    if case.habit.endswith("use_cache_false"):
        kwargs["use_cache"] = False
    if case.habit == "padding":
        kwargs["attention_mask"] = padding_mask()[:, index].contiguous()
        labels = labels.masked_fill(_shifted(padding_mask())[:, index] == 0, -100)
        count = int((_shifted(ids).masked_fill(_shifted(padding_mask()) == 0, -100) != -100).sum())
    inputs = batch.input_ids
    if case.habit.startswith("no_shard_batch"):  # every rank feeds the whole sequence
        inputs, labels = ids, _shifted(ids)
        kwargs["position_ids"] = torch.arange(seq).expand(BATCH, -1).contiguous()
    if case.habit.endswith("no_position_ids"):
        kwargs.pop("position_ids")
    if case.habit == "eval_no_grad":
        with torch.no_grad():
            logits = compiled(inputs, **kwargs).logits
        loss = _summed_loss(logits, labels, count).detach()
        dist.all_reduce(loss)
        return loss.item(), {"logits": lc.gather_sequence(logits, mesh)}, work_done(reports)
    with _autocast(case):
        if case.habit in LABELS_HABITS:  # this rank's ids as the labels
            loss = compiled(inputs, labels=inputs, **kwargs).loss
        elif case.habit in ("shift_labels", "router_aux_loss"):
            if case.habit == "router_aux_loss":
                kwargs["output_router_logits"] = True
            loss = compiled(inputs, labels=labels, shift_labels=labels, num_items_in_batch=count,
                            **kwargs).loss
        else:
            loss = _summed_loss(compiled(inputs, **kwargs).logits, labels, count)
    loss.backward()
    loss = loss.detach().double()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.double()
            dist.all_reduce(grad)
            grads[name] = grad
    return loss.item(), grads, work_done(reports)


def work_done(reports: list) -> dict:
    """What the passes did on this rank's graphs: the attention calls rewritten and those kept
    (with why: on one rank, a mask not proven), the nodes sc++ tagged for recompute, the bytes
    memo offloaded and recomputed, and each memory plan's status (a policy that touched nothing
    would make its case prove nothing)."""
    done = {"recompute_tags": 0, "host_bytes": 0, "recomputed_bytes": 0, "memory_plan": [],
            "attention_rewritten": 0, "attention_kept": []}
    unique = {id(report): report for report in reports}.values()   # published after each stage
    for record in (r for report in unique for r in report.passes):
        if record.name == "attention_2d":
            done["attention_rewritten"] += len(record.summary["changed"])
            done["attention_kept"] += [k["reason"] for k in record.summary["kept"]]
        elif record.name == "selective_checkpoint":
            done["recompute_tags"] += record.summary["changed"]["prefer_recompute"]
        elif record.name == "offload":
            done["host_bytes"] += record.summary.get("host_bytes", 0)
            done["recomputed_bytes"] += record.summary.get("recomputed_bytes", 0)
        elif record.name == "memory_plan":
            done["memory_plan"].append(record.summary["status"])
    return done


def loss_in_graph_step(case: Case, hp: int, cp: int, lowering: str):
    """One training step with the loss inside the compiled function: (loss, gradients, both
    summed over the ranks, and this rank's ``lm_head_loss`` report)."""
    import torch.distributed as dist

    import loong_compile as lc
    from loong_compile.parallel.tokens import mesh_token_indices

    mesh = lc.init_mesh(hp=hp, cp=cp)
    model = _model_for(case)
    ids = token_ids()
    batch = lc.shard_batch(ids, ids, mesh)
    labels, count, kwargs = batch.labels, batch.num_labels, {"position_ids": batch.position_ids}
    if case.habit.endswith("padding"):
        index = mesh_token_indices(SEQ, mesh)
        kwargs["attention_mask"] = padding_mask()[:, index].contiguous()
        labels = labels.masked_fill(_shifted(padding_mask())[:, index] == 0, -100)
        count = (_shifted(ids).masked_fill(_shifted(padding_mask()) == 0, -100) != -100).sum()
    if case.habit == "loss_in_graph_tied":
        step = lc.NextTokenLoss(model)
    else:
        def step(ids, labels, count, **kwargs):
            return model(ids, labels=labels, shift_labels=labels, num_items_in_batch=count,
                         **kwargs).loss
    reports = []
    options = {"hp": hp, "cp": cp, "lowering": lowering, "rank_check_timeout": 60,
               "lm_head_chunk": LM_HEAD_CHUNK}
    compiled = torch.compile(step, backend=lc.LoongBackend(options, on_report=reports.append),
                             fullgraph=True)
    loss = compiled(batch.input_ids, labels, count, **kwargs)
    loss.backward()
    loss = loss.detach().double()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.double()
            dist.all_reduce(grad)
            grads[name] = grad
    return loss.item(), grads, reports[-1].summary("lm_head_loss")


def run_case(rank: int, world: int, hp: int, cp: int, case: Case,
             extra_options: dict | None = None) -> tuple:
    """On every rank: the case's outcome, ("ok", loss, grads, work_done) on rank 0 (("ok",) on
    the others) or ("refused", error class, message) for a ``LoongError``; anything else raises,
    and run_distributed names the rank.  ``extra_options`` go to the backend beside the mesh
    (e.g. Inductor and a policy).  ``TRUST_MATRIX_BREAK=<case name>:<rank>`` makes that
    rank raise in that case (how a broken cell reads in pytest's output)."""
    if os.environ.get("TRUST_MATRIX_BREAK") == f"{case.name}:{rank}":
        raise RuntimeError(f"{case.name} broken on purpose on rank {rank} (TRUST_MATRIX_BREAK)")
    try:
        loss, grads, done = _distributed_step(case, hp, cp, extra_options)
    except Exception as exc:
        error = loong_error_in(exc)
        if error is None:
            raise
        return ("refused", type(error).__name__, str(error))
    # numpy, not tensors: a tensor travels between processes as a file descriptor of the rank's
    return ("ok", loss, {n: g.numpy() for n, g in grads.items()}, done) if rank == 0 else ("ok",)


def run_cases(rank: int, world: int, hp: int, cp: int, cases: list[Case],
              extra_options: dict | None = None) -> dict:
    """On every rank: ``run_case`` of each case in turn (the mesh built once); a crash raises."""
    outcomes = {}
    for case in cases:
        torch._dynamo.reset()
        outcomes[case] = run_case(rank, world, hp, cp, case, extra_options)
    return outcomes


# cases per run_distributed call: the first case of a call builds the mesh and warms the ranks
# (a call per case made the matrix 1.9x slower, docs/benchmarks.md "Test suite time")
CASES_PER_CALL = 12


def run_matrix(cases: list[Case], world: int, hp: int, cp: int, extra_options: dict | None = None,
               call_timeout: float = 900, case_timeout: float = 300) -> dict:
    """Every case's outcome on rank 0, ``CASES_PER_CALL`` cases per call on the kept ranks, two
    calls at a time (``run_each``: a call's ranks wait for each other at every rank check and
    collective, which leaves a core idle).  A call that fails (a rank raised outside a
    ``LoongError``, died or hung) is run again a case per call, so that the failure is the
    failing case's alone: ("crash", error, what run_distributed said: each rank's error, or
    which ranks hung)."""
    from loong_compile.testing import run_each

    parts = [cases[start:start + CASES_PER_CALL] for start in range(0, len(cases), CASES_PER_CALL)]
    results = run_each([(run_cases, world, (hp, cp, part, extra_options)) for part in parts],
                       timeout=call_timeout)
    outcomes, alone = {}, []
    for part, result in zip(parts, results):
        if isinstance(result, BaseException):
            alone += part
        else:
            outcomes.update(result[0])
    results = run_each([(run_case, world, (hp, cp, case, extra_options)) for case in alone],
                       timeout=case_timeout)
    for case, result in zip(alone, results):
        outcomes[case] = (("crash", type(result).__name__, str(result)[-3000:])
                          if isinstance(result, BaseException) else result[0])
    return outcomes


def judge(case: Case, outcome: tuple, at_least: float = 0) -> tuple[str, str]:
    """("exact" | "wrong" | "refused" | "crash", detail); ``at_least``: the tolerance's floor
    (INDUCTOR_TOLERANCE under Inductor)."""
    if outcome[0] != "ok":
        return ("refused" if outcome[0] == "refused" else "crash"), f"{outcome[1]}: {outcome[2]}"
    error, tol = relative_error(outcome[1:3], reference(case)), max(tolerance(case), at_least)
    return ("exact" if error <= tol else "wrong"), f"relative error {error:.1e} (tolerance {tol:.0e})"


def markdown(cases: list[Case], results: dict) -> str:
    """The tables of docs/usage.md: one row per (attention, window, habit), one column per model,
    ``TABLE_COLUMNS`` models a table; then each refused row's message (its first model's, and
    each token-mixing architecture's own)."""
    import re

    rows: dict[tuple, dict[str, tuple[str, str]]] = {}
    for case in cases:
        rows.setdefault((case.attn, case.window, case.habit), {})[case.arch] = judge(case, results[case])
    archs = list(ARCHITECTURES) + list(ATTENTION_VARIANTS) + list(SCAN_ARCHITECTURES)
    lines, messages = [], []
    for start in range(0, len(archs), TABLE_COLUMNS):
        group = archs[start:start + TABLE_COLUMNS]
        lines += ["| attention, window, habit | " + " | ".join(group) + " |",
                  "|---|" + "---|" * len(group)]
        for key, verdicts in rows.items():
            if any(a in verdicts for a in group):
                cells = [verdicts[a][0] if a in verdicts else "" for a in group]
                lines.append(f"| {_label(*key)} | " + " | ".join(cells) + " |")
        lines.append("")
    for key, verdicts in rows.items():
        refused = [(a, d) for a, (v, d) in verdicts.items() if v == "refused"]
        own = ATTENTION_VARIANTS   # each refused with its own message
        first = [(None, d) for a, d in refused if a not in own][:1]
        for arch, detail in first + [(a, d) for a, d in refused if a in own]:
            text = re.sub(r'File "[^"]*/([^/"]+)"', r"\1", detail)
            messages.append(f"- **{f'{arch}, ' if arch else ''}{_label(*key)}**: `{text}`")
    return "\n".join(lines + ["What a user sees for each refused row (first model's message, and "
                              "each attention variant's):", ""] + messages)


def _label(attn: str, window: int | None, habit: str) -> str:
    return f"{attn}{f', window {window}' if window else ''}, {habit.replace('_', ' ')}"


def _main(argv: list[str]) -> None:
    """``python tests/trust_matrix.py [names...] [--markdown]``: the matrix's cases whose name
    contains a given word, on 2 ranks (cp=2, aot_eager).  ``--habit H``: case H of every
    architecture named (all of ARCHITECTURES by default) instead.  ``--inductor``: at
    hp=2 x cp=2 on 4 ranks under Inductor, judged within INDUCTOR_TOLERANCE; ``--options
    JSON``: more backend options (an activation policy)."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--habit")
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--options", type=json.loads, default={})
    args = parser.parse_args(argv)
    if args.habit:
        cases = [Case(arch, habit=args.habit) for arch in args.names or ARCHITECTURES]
    else:
        cases = [c for c in all_cases() if not args.names or any(w in c.name for w in args.names)]
    hp, cp, options = 1, 2, dict(args.options)
    if args.inductor:
        hp, options = 2, {"lowering": "inductor", "rank_check_timeout": 60, **options}
    from loong_compile.testing import keep_ranks

    with keep_ranks():
        results = run_matrix(cases, hp * cp, hp, cp, options or None)
    if args.markdown:
        print(markdown(cases, results))
        return
    for case in cases:
        verdict, detail = judge(case, results[case], INDUCTOR_TOLERANCE if args.inductor else 0)
        print(f"{case.name:40s} {verdict:8s} {detail}", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
