"""Exact or refused: 23 Hugging Face architectures x attention x windows x users' habits, three
whose attention is chunked (Llama 4), has sinks (gpt-oss) or softcapped scores (Gemma 2,
refused), two that mix tokens outside attention through a state the scans stage carries across
ranks (LFM2's short convolution, Qwen3-Next's and Qwen3.5's convolution and gated DeltaNet), and one it does
not yet (Falcon-H1's Mamba-2 mixer: refused whatever the habit).

The cells run a dozen per ``run_distributed`` call on the session's kept ranks, two calls at a
time (``trust_run.run_matrix``), while this process computes the references; a call that
crashes or hangs is run again a cell per call, so that the failing cell fails alone, named by
its case and its ranks, within its own timeout.

Every case runs one training step under backend="loong" (aot_eager, float64 unless bf16;
float32 for the mixtures of experts, whose grouped_mm has no float64 kernel on CPU) on
2 gloo ranks and is either equal to one process on the full sequence (loss and gradients) or
refused with a named error whose message says the cause and the fix.  A case may only move
from refused to exact, never to "runs".  ``python tests/trust_matrix.py`` prints the table.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from hf_models import ARCHITECTURES, SCAN_ARCHITECTURES
from trust_cases import WINDOW_SHARD, WINDOW_SHORT, Case, all_cases
from trust_reference import judge, reference, relative_error, tolerance, warm_references
from trust_run import run_matrix

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

# habit -> (error class, words its message must contain); every other case must be exact
REFUSED_HABITS = {
    "no_shard_batch": ("LoongShapeError", ["position_ids", "shard_batch"]),
    # the model numbers its tokens with the layout's positions: equal tokens on every rank are
    # what a batch not cut with shard_batch looks like
    "no_shard_batch_no_position_ids": ("LoongShapeError", ["holds the same tokens",
                                                           "shard_batch"]),
    # transformers shifts labels= in the sequence's order, not the balanced order's
    "packed_balanced_labels": ("LoongShapeError", ["balance_documents", "shift_labels="]),
    # a causal mask that reads no documents (a cache, or an attention mask, turns transformers'
    # document detection off): the reordered tokens would mix
    "packed_balanced": ("LoongShapeError", ["balance_documents", "reads its documents",
                                            "without an attention_mask"]),
    "packed_balanced_mask": ("LoongShapeError", ["balance_documents", "reads its documents",
                                                 "without an attention_mask"]),
    # documents live in the position ids: a model that numbers the row itself sees one sequence
    "packed_no_position_ids": ("LoongShapeError", ["cut from packed documents",
                                                   "without position_ids",
                                                   "position_ids=batch.position_ids"]),
    "router_aux_loss": ("LoongTokenMixingError", ["load-balancing loss", "output_router_logits=False"]),
    # model(ids, position_ids=..., labels=batch.labels): the model would shift them a second time
    "batch_labels": ("LoongShapeError", ["already shifted", "twice", "shift_labels=batch.labels"]),
}
# GPT-2's loss runs in a graph of its own after a graph break: no attention in it
NO_ATTENTION = ("LoongTokenMixingError", ["no attention call", "allow_graphs_without_attention"])
# Gemma 2's eager attention softcaps its scores (tanh), which 2D-Attention does not compute
SOFTCAPPED = ("LoongUnsupportedError", ["attention written as ops", "softcapped score",
                                        "attn_logit_softcapping", "hp=cp=1"])

# a left-padded query sees no key: one process's eager softmax gives it the mean of every value
# (the labels put it in the loss when the next token is real), which no kernel computes
EAGER_PADDING = ("LoongUnsupportedError", ["attention written as ops", "hides padded keys",
                                           "attn_implementation='sdpa'"])


# a scan starts each packed document from a zero state: the balanced order deals a document's
# tokens over the layout's chunks, between the other documents' (ops/scans/documents.py)
SCAN_BALANCED = ("LoongUnsupportedError", ["balance_documents=True", "scan",
                                           "cut the batch without balance_documents"])


def expected(case: Case) -> tuple[str, list[str]] | None:
    """(error class, message words) for a refused case; None for an exact one."""
    if case.arch == "gemma2":
        return SOFTCAPPED
    if case.arch in SCAN_ARCHITECTURES and case.habit.startswith("packed_balanced"):
        return SCAN_BALANCED
    if case.attn == "eager" and "padding" in case.habit:
        return EAGER_PADDING
    if case.arch == "gpt2" and "labels" in case.habit:
        return NO_ATTENTION
    if case.habit == "experts_eager":  # a loop over the experts hit: Dynamo breaks the graph at
        return NO_ATTENTION            # its data-dependent indices, the pieces have no attention
    return REFUSED_HABITS.get(case.habit)


CASES = all_cases()
MESHES = {"cp2": (1, 2), "hp2": (2, 1)}
# hp=2 alone: the families' head layouts (GQA, MLA, experts) and the habits that change the
# graph most.  A case the Inductor matrix runs at hp=2 x cp=2 (tests/test_trust_matrix_inductor.py:
# Gemma 3's packed documents, Cohere 2, Falcon, Llama 4, gpt-oss, the scans, padding, reentrant
# checkpointing, the forward alone) is not run here again.
HP_CASES = [Case("mistral", window=WINDOW_SHORT), Case("llama"), Case("qwen3", habit="shift_labels"),
            Case("gpt_neox", habit="labels"), Case("gemma3"),
            Case("llama", habit="packed_use_cache_false"),
            Case("llama", habit="autocast_bf16"), Case("exaone4", window=WINDOW_SHORT),
            Case("deepseek_v3"), Case("deepseek_v3_moe"), Case("mixtral"),
            Case("qwen3moe", habit="shift_labels"), Case("olmoe"), Case("smollm3"), Case("phi"),
            Case("gptj"), Case("granite", habit="shift_labels"),
            Case("gpt2", habit="no_position_ids"), Case("qwen2", habit="batch_labels"),
            Case("gemma2", attn="eager")]


@pytest.fixture(scope="module")
def outcomes() -> dict:
    exact = [c for c in dict.fromkeys(CASES + HP_CASES) if expected(c) is None]
    sdpa_twins = [Case(c.arch, "sdpa", c.window, c.habit) for c in exact
                  if c.attn == "eager" and c.arch in ARCHITECTURES]
    with ThreadPoolExecutor(1) as background:   # one process's numbers, while the ranks work
        background.submit(warm_references, exact + sdpa_twins)
        return {mesh: run_matrix(cases, 2, *MESHES[mesh]) for mesh, cases in
                {"cp2": CASES, "hp2": HP_CASES}.items()}


@pytest.mark.timeout(3000)  # the first cell computes the module's outcomes (~10 min on 2 cores)
@pytest.mark.parametrize("mesh,case", [("cp2", c) for c in CASES] + [("hp2", c) for c in HP_CASES],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_case_is_exact_or_refused(outcomes, mesh, case):
    outcome = outcomes[mesh][case]
    verdict, detail = judge(case, outcome)
    want = expected(case)
    if want is None:
        assert verdict == "exact", f"{case.name} on {mesh}: {verdict}: {detail}"
        if case.attn == "eager" and case.arch in ARCHITECTURES:  # and float64-exact: one
            # process with sdpa (which gpt-oss has not) computes the same
            sdpa = Case(case.arch, "sdpa", case.window, case.habit)
            error = relative_error(outcome[1:3], reference(sdpa))
            assert error <= tolerance(sdpa), f"{case.name}: {error:.1e} from one process with sdpa"
        return
    error, words = want
    assert verdict == "refused", f"{case.name} on {mesh} must be refused, got {verdict}: {detail}"
    assert detail.startswith(f"{error}:"), detail
    missing = [w for w in words if w not in detail]
    assert not missing, f"{case.name}: message lacks {missing}: {detail}"
    assert "fix:" in detail


@pytest.mark.timeout(900)
def test_a_broken_cell_names_its_case_and_rank_and_the_other_cells_report(monkeypatch):
    """Rank 1 raises in one cell while rank 0 goes on into its collectives: that cell is a
    crash naming the case, the rank and the error; the other cell of the same call is exact."""
    monkeypatch.setenv("TRUST_MATRIX_BREAK", "llama-sdpa-plain:1")
    broken, other = Case("llama"), Case("qwen2")
    outcomes = run_matrix([broken, other], 2, 1, 2)
    verdict, detail = judge(broken, outcomes[broken])
    assert verdict == "crash", detail
    assert "first rank 1: RuntimeError: llama-sdpa-plain broken on purpose on rank 1" in detail
    assert judge(other, outcomes[other])[0] == "exact", outcomes[other]
