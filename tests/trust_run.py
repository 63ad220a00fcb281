"""A trust-matrix cell on gloo ranks: one training step of the case's model under
``backend="loong"`` (``run_case``: its loss and gradients summed over the ranks, what the
passes did, or the ``LoongError`` it raised), and the matrix's cells batched into
``run_distributed`` calls on kept ranks (``run_matrix``).
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch

from helpers import Holder, loong_error_in
from trust_cases import (
    BALANCED, BATCH, LABELS_HABITS, LM_HEAD_CHUNK, SEQ, Case, balance_room, case_model,
    habit_autocast, label_count, packed_documents, padding_mask, precision, seq_len, shifted,
    summed_loss, token_ids,
)


def _dtype(case: Case) -> torch.dtype:
    return {"bf16": torch.bfloat16, "autocast_bf16": torch.float32}.get(case.habit,
                                                                         precision(case.arch))


def _model_for(case: Case) -> torch.nn.Module:
    """The case's model as the ranks train it: in its habit's dtype, checkpointed or in eval
    mode where the habit says so."""
    model = case_model(case, _dtype(case))
    if case.habit.startswith("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": case.habit == "grad_ckpt_reentrant"})
    return model.eval() if case.habit == "eval_no_grad" else model


def traced_checkpoint(case: Case):
    """For the checkpointing habits but ``grad_ckpt_untraced``: Dynamo told to trace
    transformers' checkpointed layers in one graph though they change a global (transformers >=
    5.25's hub-kernel wrapper of the attention sets and resets one; the checkpoint-breaks
    refusal names this setting), as a user does who follows that refusal's fix."""
    if case.habit in ("grad_ckpt", "grad_ckpt_reentrant"):
        return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    return contextlib.nullcontext()


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
    compiled = _compiled(case, model, options, reports)
    seq = seq_len(case.arch)
    ids = token_ids(seq=seq)
    documents = packed_documents() if case.habit.startswith("packed") else None
    if case.habit.startswith("packed_balanced"):
        batch = lc.shard_batch(ids, ids.masked_fill(balance_room(), -100), mesh,
                               document_ids=packed_documents(BALANCED), balance_documents=True,
                               attention_mask=(~balance_room()).long())
    else:
        batch = lc.shard_batch(ids, ids, mesh, document_ids=documents)
    labels, count = batch.labels, label_count(seq)
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
        labels = labels.masked_fill(shifted(padding_mask())[:, index] == 0, -100)
        count = int((shifted(ids).masked_fill(shifted(padding_mask()) == 0, -100) != -100).sum())
    inputs = batch.input_ids
    if case.habit.startswith("no_shard_batch"):  # every rank feeds the whole sequence
        inputs, labels = ids, shifted(ids)
        kwargs["position_ids"] = torch.arange(seq).expand(BATCH, -1).contiguous()
    if case.habit.endswith("no_position_ids"):
        kwargs.pop("position_ids")
    if case.habit == "eval_no_grad":
        with torch.no_grad():
            logits = compiled(inputs, **kwargs).logits
        loss = summed_loss(logits, labels, count).detach()
        dist.all_reduce(loss)
        return loss.item(), {"logits": lc.gather_sequence(logits, mesh)}, work_done(reports)
    with habit_autocast(case):
        if case.habit in LABELS_HABITS:  # this rank's ids as the labels
            loss = compiled(inputs, labels=inputs, **kwargs).loss
        elif case.habit == "batch_labels":  # shard_batch's labels, already shifted, as labels=
            loss = compiled(inputs, labels=labels, **kwargs).loss
        elif case.habit in ("shift_labels", "router_aux_loss"):
            if case.habit == "router_aux_loss":
                kwargs["output_router_logits"] = True
            loss = compiled(inputs, labels=labels, shift_labels=labels, num_items_in_batch=count,
                            **kwargs).loss
        else:
            loss = summed_loss(compiled(inputs, **kwargs).logits, labels, count)
    return (*_summed_over_ranks(loss, model), work_done(reports))


def _compiled(case: Case, model: torch.nn.Module, options: dict, reports: list) -> torch.nn.Module:
    """The case's model compiled as users do (``Case.compile``): whole, block by block with
    ``lc.hf.compile_blocks`` (its reports are not collected: its graphs are compiled through the
    "loong" string), each decoder layer by hand, the masks and the loss left outside, or a
    trainer's closure over the model it holds (``helpers.Holder``)."""
    import loong_compile as lc

    if case.compile == "blocks":
        return lc.hf.compile_blocks(model, **options)
    backend = lc.LoongBackend(options, on_report=reports.append)
    if case.compile == "by_hand":
        for layer in model.model.layers:
            layer.compile(backend=backend)
        return model
    if case.compile == "holder":
        return torch.compile(Holder(model).step(), backend=backend)
    return torch.compile(model, backend=backend)


def work_done(reports: list) -> dict:
    """What the passes did on this rank's graphs: the attention calls rewritten and those kept
    (with why: on one rank, a mask not proven), the nodes sc++ tagged for recompute, the bytes
    memo offloaded and recomputed, each memory plan's status and the regions token tiling cut
    (a policy that touched nothing would make its case prove nothing)."""
    done = {"recompute_tags": 0, "host_bytes": 0, "recomputed_bytes": 0, "memory_plan": [],
            "attention_rewritten": 0, "attention_kept": [], "tiled_regions": 0,
            "head_groups": set()}
    unique = {id(report): report for report in reports}.values()   # published after each stage
    for record in (r for report in unique for r in report.passes):
        if record.name == "attention_2d":
            done["attention_rewritten"] += len(record.summary["changed"])
            done["attention_kept"] += [k["reason"] for k in record.summary["kept"]]
            done["head_groups"] |= {c["head_groups"] for c in record.summary["changed"]}
        elif record.name == "selective_checkpoint":
            done["recompute_tags"] += record.summary["changed"]["prefer_recompute"]
        elif record.name == "offload":
            done["host_bytes"] += record.summary.get("host_bytes", 0)
            done["recomputed_bytes"] += record.summary.get("recomputed_bytes", 0)
        elif record.name == "memory_plan":
            done["memory_plan"].append(record.summary["status"])
        elif record.name == "token_tiling":
            done["tiled_regions"] += len(record.summary["changed"])
    done["head_groups"] = sorted(done["head_groups"])
    return done


def loss_in_graph_step(case: Case, hp: int, cp: int, lowering: str):
    """One training step with the loss inside the compiled function: (loss, gradients, both
    summed over the ranks, and this rank's ``lm_head_loss`` report)."""
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
        labels = labels.masked_fill(shifted(padding_mask())[:, index] == 0, -100)
        count = (shifted(ids).masked_fill(shifted(padding_mask()) == 0, -100) != -100).sum()
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
    return (*_summed_over_ranks(loss, model), reports[-1].summary("lm_head_loss"))



def _summed_over_ranks(loss: torch.Tensor, model: torch.nn.Module) -> tuple[float, dict]:
    """Backward, then the loss and every gradient summed over the ranks, as the examples'
    training loop reduces them."""
    import torch.distributed as dist

    loss.backward()
    loss = loss.detach().double()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.double()
            dist.all_reduce(grad)
            grads[name] = grad
    return loss.item(), grads

def run_case(rank: int, world: int, hp: int, cp: int, case: Case,
             extra_options: dict | None = None) -> tuple:
    """On every rank: the case's outcome, ("ok", loss, grads, work_done) on rank 0 (("ok",) on
    the others) or ("refused", error class, message) for a ``LoongError``; anything else raises,
    and run_distributed names the rank.  ``extra_options`` go to the backend beside the mesh
    (e.g. Inductor and a policy).  ``TRUST_MATRIX_BREAK=<case name>:<rank>`` makes that
    rank raise in that case (how a broken cell reads in pytest's output)."""
    # an earlier cell's batch, held by a reference cycle of its compiled model, would count as
    # alive for the blocks' check (checks/blocks.py): a process runs one job at a time here
    gc.collect()
    if os.environ.get("TRUST_MATRIX_BREAK") == f"{case.name}:{rank}":
        raise RuntimeError(f"{case.name} broken on purpose on rank {rank} (TRUST_MATRIX_BREAK)")
    try:
        with traced_checkpoint(case):
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
