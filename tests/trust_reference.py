"""What a trust-matrix cell is judged against: one process on the full sequence (``reference``:
float64, float32 for the mixtures of experts), the tolerance each case earns from how its model
computes (``tolerance``), and the cell's verdict (``judge``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

import torch
import transformers
from packaging.version import Version

from hf_models import SCAN_ARCHITECTURES
from helpers import each_document_alone, gated_delta_recurrence, mamba2_recurrence
from trust_cases import (
    BALANCED, BATCH, FLOAT32_MODELS, LABELS_HABITS, PACKED, Case, balance_room, case_model, habit_autocast,
    label_count, packed_positions, padding_mask, precision, seq_len, shifted, summed_loss, token_ids,
)

# the models that compute in float32 inside a float64 model (Gemma3's norms among them)
FLOAT32_INSIDE = ("gemma3", "cohere", "cohere2")
# the eager attention chains whose softmax stays in the model's dtype (the others upcast to float32;
# Falcon's own chain did until transformers 5.25, which gave it the shared eager attention)
FLOAT64_SOFTMAX = ("gpt2",) + (("falcon",) if Version(transformers.__version__) < Version("5.25")
                               else ())
# Every model here normalises in float32 inside (RMSNorm's upcast); Inductor fuses those float32
# reductions differently from eager, so float64 models agree to float32 round-off, not float64's
# (the example Llama: 1.3e-7, with the LM-head pass and without it alike).  A token chunk lost
# or counted twice, or a token seen by the wrong query, is off by more than 1e-2.
INDUCTOR_TOLERANCE = 1e-5


@functools.cache   # judging a case asks for it several times (its tolerance, an sdpa twin)
def reference(case: Case, dtype: torch.dtype | None = None, autocast: bool = False,
              exact_kernel: bool = False) -> tuple[float, dict]:
    """One process, full sequence (``precision`` unless asked): the loss and gradients the user
    meant.  ``autocast``: under the case's autocast (with ``dtype`` float32: what one
    process computes); ``exact_kernel``: with the model's float32 scan kernel replaced by the
    exact recurrence (``EXACT_KERNELS``)."""
    if case.compile != "model":   # however the ranks compile it, one process computes the same
        return reference(dataclasses.replace(case, compile="model"), dtype, autocast, exact_kernel)
    if exact_kernel:
        with _float64_kernel(case.arch):
            return reference.__wrapped__(case, dtype, autocast)
    dtype = dtype or precision(case.arch)
    model = case_model(case, dtype)
    seq = seq_len(case.arch)
    ids = token_ids(seq=seq)
    labels = shifted(ids)
    kwargs = {"position_ids": torch.arange(seq).expand(BATCH, -1)}
    if case.habit.startswith("packed"):
        kwargs["position_ids"] = packed_positions()
    if case.habit.startswith("packed_balanced"):
        kwargs["position_ids"] = packed_positions(BALANCED)
        labels = shifted(ids.masked_fill(balance_room(), -100))
    if case.habit.endswith("use_cache_false"):
        kwargs["use_cache"] = False
    if case.habit.endswith("padding"):
        kwargs["attention_mask"] = padding_mask()
        labels = labels.masked_fill(shifted(padding_mask()) == 0, -100)
    if case.habit == "eval_no_grad":
        with torch.no_grad():
            logits = model.eval()(ids, **kwargs).logits
        loss = summed_loss(logits, labels, label_count(seq))
        return loss.item(), {"logits": logits.double().numpy()}
    with habit_autocast(case) if autocast else contextlib.nullcontext():
        if case.habit in LABELS_HABITS + ("shift_labels", "loss_in_graph",
                                          "loss_in_graph_padding", "router_aux_loss"):
            unshifted = ids.masked_fill(padding_mask() == 0, -100) if "padding" in case.habit else ids
            if case.habit == "router_aux_loss":
                kwargs["output_router_logits"] = True
            loss = model(ids, labels=unshifted, **kwargs).loss
        else:
            count = int((labels != -100).sum())
            loss = summed_loss(_logits(case, model, ids, kwargs), labels, count)
    loss.backward()
    return loss.item(), {n: p.grad.double().numpy() for n, p in model.named_parameters()
                         if p.grad is not None}


def _logits(case: Case, model: torch.nn.Module, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The model's logits; through a scan, packed documents each alone, joined (issue 51): the
    scans start each document from a zero state as the kernels users run do (fla's cu_seqlens=,
    mamba-ssm's and causal-conv1d's seq_idx=), which transformers' torch fallback does not."""
    if case.arch not in SCAN_ARCHITECTURES or not case.habit.startswith("packed"):
        return model(ids, **kwargs).logits
    rest = {k: v for k, v in kwargs.items() if k != "position_ids"}
    return each_document_alone(lambda ids, positions: model(ids, position_ids=positions, **rest).logits,
                               PACKED, 1, ids, kwargs["position_ids"])


# the models whose scan kernel computes in float32 whatever the model's dtype (transformers' gated
# delta rule and Mamba-2 scan cast): judged within twice one process's own float32 error, against
# one process with the recurrence computed token by token in the model's dtype in its place
# (_float64_kernel).  Each: its transformers module's function, and the exact recurrence.
EXACT_KERNELS = {"qwen3_next": ("torch_chunk_gated_delta_rule", gated_delta_recurrence),
                 "qwen3_5": ("torch_chunk_gated_delta_rule", gated_delta_recurrence),
                 "falcon_h1": ("mamba2_chunk_scan", mamba2_recurrence),
                 "bamba": ("mamba2_chunk_scan", mamba2_recurrence)}


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
    """Largest relative error over the loss and every parameter's gradient (as a whole); a
    gradient one process has not (a frozen weight's: PEFT's base) counts as wrong, 1."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    worst = abs(loss - ref_loss) / abs(ref_loss) + float(bool(grads.keys() - ref_grads.keys()))
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


def judge(case: Case, outcome: tuple, at_least: float = 0) -> tuple[str, str]:
    """("exact" | "wrong" | "refused" | "crash", detail); ``at_least``: the tolerance's floor
    (INDUCTOR_TOLERANCE under Inductor)."""
    if outcome[0] != "ok":
        return ("refused" if outcome[0] == "refused" else "crash"), f"{outcome[1]}: {outcome[2]}"
    error, tol = relative_error(outcome[1:3], reference(case)), max(tolerance(case), at_least)
    return ("exact" if error <= tol else "wrong"), f"relative error {error:.1e} (tolerance {tol:.0e})"
