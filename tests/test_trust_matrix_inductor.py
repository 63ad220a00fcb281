"""The trust matrix under Inductor at hp=2 x cp=2, for every activation policy (issue 23).

``aot_eager`` never lowers the graph, so it cannot see a schedule or a buffer Inductor refuses
or gets wrong (observations 1-2: sc++ crashed with "used before it has been defined", then
with a reshape of a graph input lowered before the others).  Each case is one training step of
a float64 model on 4 gloo ranks against one process on the full sequence, within float32
round-off (``INDUCTOR_TOLERANCE``: the models' float32 norms, which Inductor fuses differently
from eager).

Which cases run here, and why not the whole matrix: one case is one 4-rank Inductor compile of
a forward and a backward, 40-60 s of CPU on CI's two cores; the 150-odd cases of
``tests/test_trust_matrix.py`` under five policies would take hours.  That matrix proves the
rewrite (which attention, which mask, which positions) on ``aot_eager``, where the graph
Inductor lowers is already fixed; what only Inductor can break is what the policies change in
that graph and how it is lowered and scheduled.  So each policy gets the cases that change its
graph most:

- none: gradient checkpointing both ways: Gemma3 with transformers' default
  ``use_reentrant=False`` (attention inside a checkpointed body, in a sliding and a full layer:
  the second model of observation 2; Llama has it under sc++) and Llama reentrant (the layer
  recompiled in its own graph), and Cohere2 (local/global layers, NoPE on the global one,
  attention and MLP in parallel from one norm).
- sc++: Qwen2 (observation 1), Mistral with a window shorter than a rank's share, Llama with
  gradient checkpointing (recompute inside recompute), and the plainest call,
  ``model(ids, labels=ids)`` without position ids, on GPT-NeoX (partial rotary): the label
  exchange, the sequence's count and the layout's positions lowered by Inductor (every family
  and every policy were run once by hand: docs/usage.md, "Hugging Face models").
- memo, alpha 0 (every "other" activation recomputed, token-sliced) and alpha 1 (offloaded
  and reloaded), ``resident_layers=0`` so that the one layer is swapped: Qwen2, Gemma3 with a
  window shorter than a rank's share and packed documents, Granite (every multiplier), Qwen2
  with padding.
- memory plan: Falcon (its own SDPA call, parallel block) and the forward alone under
  ``torch.no_grad()`` (an inference graph).
- attention written as ops (``attn_implementation="eager"``, made SDPA by
  ``passes/attention/eager_attention.py`` before 2D-Attention): GPT-2 (none), Qwen2 and Mistral
  with a window shorter than a rank's share (sc++: the SDPA cells they replace computed the same
  graph after the rewrite), Gemma3 (memo, alpha 1) and Llama (memory plan); gpt-oss (none: sinks,
  alternating windows, experts, float32).
- chunked attention: Llama 4 (none: a chunked layer, a NoPE layer with its attention
  temperature, experts, float32).
- issue 51, under none, sc++ and memo: LoRA on Llama (PEFT), Qwen2 with ``labels=``, Qwen3-MoE
  (and Mistral with a window shorter than a rank's share: the balanced documents' case below,
  and sc++'s written as ops).
- documents in the balanced order: Mistral with packed documents in
  ``shard_batch(balance_documents=True)``'s order and a window shorter than a rank's share (the
  tokens reordered, the window counted in the document), under every activation policy.
- the scans, each under three policies and every policy with one: LFM2 (a short causal
  convolution across ranks: its halo exchanged, issue 37), Qwen3-Next (its convolution, and its
  gated DeltaNet recurrence with the state exchanged; judged within twice one process's own
  error, its kernel computing in float32) and Falcon-H1 (Mamba-2's convolution and scan beside
  attention in every layer, judged likewise); Qwen3.5 (the same ops as Qwen3-Next, positions on
  four rotary axes) and Bamba with packed documents (Mamba-2's ops beside attention on its own
  layers) under none.  At cp = 4: LFM2, Qwen3-Next and Bamba, Falcon-H1 and Qwen3.5 with packed
  documents (the state reset at each document start, judged against each document alone).
- gradient checkpointing by hand (transformers' ``gradient_checkpointing_enable()``): its
  cells trace it in one graph (``trust_run.traced_checkpoint``: Dynamo's
  ``skip_fwd_side_effects_in_bwd_under_checkpoint``, which transformers >= 5.25 needs), and
  ``UNTRACED_CHECKPOINTS`` (Llama, Qwen2, Gemma 3) leave Dynamo to break the graph there:
  refused on every rank, naming checkpointing and the fix.
- blocks compiled one by one (issue 51): plain rows, ``labels=``, packed documents, padded rows,
  a window, Gemma 3's two kinds of layer; with ``lc.hf.compile_blocks`` each exact, by hand each
  exact or refused on every rank (``labels=``: transformers' loss, computed outside every graph
  on a rank's own tokens).  A block's graph is one layer to the activation policies (issue 52):
  sc++, memo (alpha 0), full and full_offload each on both ways, their work asserted by hand.

- token tiling forced (issue 52) in eight of these cells, a family's MLP under each policy
  (``TILED``: Qwen3-MoE's experts, GPT-2, Qwen2, Gemma 3, DeepSeek-V3's MLA, Llama), the regions
  counted;
- ``full`` and ``full_offload`` (issue 52): each layer's input alone saved, the attention
  recomputed with its collectives (Qwen3-MoE, DeepSeek-V3 with its inputs on the host; on
  blocks, below, Qwen2 with padded rows, Mistral with a window, Llama and Gemma 3).

A window, padding or packed documents make 2D-Attention's masked op, which the activation
passes did not take for attention: sc++ and memo found no layer there and did nothing, with
every case still exact.  So each policy has a masked case, and each case asserts what its
policy did (``WORK``): sc++ tagged nodes for recompute, memo recomputed (alpha 0) or offloaded
(alpha 1) bytes, a memory plan was made.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from helpers import BUDGET
from hf_models import dynamo_traces_checkpointing
from loong_compile.testing import run_each
from trust_cases import WINDOW_SHARD, Case
from trust_reference import (INDUCTOR_TOLERANCE, reference, relative_error, tolerance,
                             warm_references)
from trust_run import run_case

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

MEMO = {"activations": "memo", "resident_layers": 0, **BUDGET}
POLICIES = {
    "none": {"activations": "none"},
    "sc++": {"activations": "sc++"},
    "memo-alpha0": {**MEMO, "alpha": 0.0},
    "memo-alpha1": {**MEMO, "alpha": 1.0},
    "memory_plan": {"memory_plan": True},
    "full": {"activations": "full"},
    "full_offload": {**MEMO, "activations": "full_offload"},
}
POLICY_CASES = {
    "none": [Case("gemma3", habit="grad_ckpt"), Case("llama", habit="grad_ckpt_reentrant"),
             Case("cohere2", window=WINDOW_SHARD), Case("gpt2", attn="eager"), Case("llama4"),
             Case("gpt_oss", attn="eager")],
    "sc++": [Case("qwen2", attn="eager"), Case("mistral", attn="eager", window=WINDOW_SHARD),
             Case("llama", habit="grad_ckpt"), Case("gpt_neox", habit="labels_no_position_ids")],
    "memo-alpha0": [Case("qwen2"),
                    Case("gemma3", window=WINDOW_SHARD, habit="packed_use_cache_false")],
    # a trainer's closure over the model it holds compiled: its modules found
    # from a root that is no module (labels=: transformers' loss in the graph)
    "memo-alpha1": [Case("granite"), Case("qwen2", habit="padding"), Case("gemma3", attn="eager"),
                    Case("llama", habit="labels", compile="holder")],
    "memory_plan": [Case("falcon"), Case("llama", habit="eval_no_grad"), Case("llama", attn="eager")],
    # issue 52: only the layers' inputs saved, attention recomputed too (its collectives run again
    # in the backward); under full_offload those inputs on the host
    "full": [Case("qwen3moe")],   # and on blocks: Qwen2 padded, Gemma 3 by hand (BLOCKS)
    "full_offload": [Case("deepseek_v3")],
}
# documents in shard_batch's balanced order (issue 24) with a window shorter than a rank's share:
# the mask compares positions in the document, under every activation policy
BALANCED = Case("mistral", window=WINDOW_SHARD, habit="packed_balanced_use_cache_false")
for policy in ("none", "sc++", "memo-alpha0", "memo-alpha1"):
    POLICY_CASES[policy].append(BALANCED)
# the scans across ranks, each under three policies and every policy with one: a short
# convolution (LFM2: ops/scans/causal_conv.py), Qwen3-Next's convolution and gated DeltaNet
# recurrence (ops/scans/gated_scan.py), and Falcon-H1's Mamba-2 scan beside attention in every
# layer (ops/scans/gated_scan.py::mamba2_scan).  (Every scan under every policy cost 15 cells,
# Qwen3-Next's 26-37 s each; what a policy does to a scan's region is the same in each model.)
SCANS = {"lfm2": ("none", "sc++", "memory_plan"), "qwen3_next": ("none", "sc++", "memo-alpha0"),
         "falcon_h1": ("none", "memo-alpha0", "memo-alpha1")}
for arch, policies in SCANS.items():
    for policy in policies:
        POLICY_CASES[policy].append(Case(arch))
# Qwen3.5: the same two ops as Qwen3-Next's (whose cells cover every policy), in a model that
# expands its positions to four rotary axes
ONE_POLICY_SCANS = [Case("qwen3_5"), Case("bamba", habit="packed_use_cache_false")]
POLICY_CASES["none"] += ONE_POLICY_SCANS
# issue 51, under none, sc++ and memo: PEFT's LoRA on Llama's attention and MLP projections (the
# modules reached through PEFT's wrappers, the base frozen)
# and Qwen2 with labels=, Qwen3-MoE (float32).  (Mistral with a window shorter than a rank's
# share runs under every activation policy as BALANCED, and under sc++ written as ops.)
ACTIVATION_POLICIES = {Case("llama", habit="lora"): ("none", "sc++", "memo-alpha0"),
                       Case("qwen2", habit="labels"): ("none", "sc++", "memo-alpha1"),
                       Case("qwen3moe"): ("none", "sc++", "memo-alpha0")}
for case, policies in ACTIVATION_POLICIES.items():
    for policy in policies:
        POLICY_CASES[policy].append(case)
# issue 52: token tiling forced in some of these cells (tiles of 8 tokens a row: 2 of a rank's
# row), one family's MLP under each policy: a mixture of experts on the rank's tokens (Qwen3-MoE:
# the router, the sort, both grouped matmuls in one region) and GELU with a bias (GPT-2), SwiGLU
# with labels= (Qwen2), GeGLU beside windows and packed documents (Gemma 3), MLA with its
# low-rank projections and rotary angles tiled too (DeepSeek-V3, added for it), Llama's with
# its attention written as ops.  The same cells untiled differ only in the MLP, which every other
# cell lowers untiled; Llama, Gemma 3, GPT-2, Qwen3-MoE and DeepSeek-V3 under all five policies
# were run by hand (issue 52).  A parallel block's MLP (Falcon, GPT-J: attention and MLP from one
# norm) is not tiled: what the norm's output alone computes holds attention's projections too.
TILE_TOKENS = 16
POLICY_CASES["memo-alpha1"].append(Case("deepseek_v3"))
TILED = {("none", Case("qwen3moe")): 1, ("none", Case("gpt2", attn="eager")): 1,
         ("sc++", Case("qwen2", habit="labels")): 1,
         ("memo-alpha0", Case("gemma3", window=WINDOW_SHARD, habit="packed_use_cache_false")): 4,
         ("memo-alpha1", Case("deepseek_v3")): 3, ("memory_plan", Case("llama", attn="eager")): 1,
         ("full", Case("qwen3moe")): 1, ("full_offload", Case("deepseek_v3")): 3}
ONE_RANK_GROUPED = ("none", Case("qwen2", habit="padding"))
# head groups (issue 52: each attention's heads in two groups, one after the other) on cells of
# every policy, through the ring (sharing a KV head, or MLA's own KV per group), the masked
# exchange (window, packed documents) and sinks
HEAD_GROUPED = {("none", Case("gpt_oss", attn="eager")), ("sc++", Case("llama", habit="grad_ckpt")),
                ("memo-alpha0", Case("gemma3", window=WINDOW_SHARD,
                                     habit="packed_use_cache_false")),
                ("memo-alpha1", Case("granite")), ("memory_plan", Case("falcon")),
                ("full", Case("qwen3moe")), ("full_offload", Case("deepseek_v3")),
                ONE_RANK_GROUPED,   # one rank: the calls it rewrites (masked) grouped
                ("full_offload", Case("llama", compile="by_hand"))}   # blocks, by hand
HEAD_GROUPS = 2
# what the policy must have done in each case's graphs (run_case's work_done)
WORK = {
    "sc++": lambda done: done["recompute_tags"] > 0,
    "memo-alpha0": lambda done: done["recomputed_bytes"] > 0,
    "memo-alpha1": lambda done: done["host_bytes"] > 0,
    "full": lambda done: done["recompute_tags"] > 0,
    "full_offload": lambda done: done["recompute_tags"] > 0 and done["host_bytes"] > 0,
    "memory_plan": lambda done: done["memory_plan"] and all(
        s in ("optimal", "level_optimal", "time_limit") for s in done["memory_plan"]),
}


CASE_TIMEOUT = 600   # one case: 4 ranks compiling a forward and a backward with Inductor


class Cell(NamedTuple):
    policy: str
    case: Case
    hp: int
    cp: int
    tiled: bool = False   # TILING_GRID's: tiles forced where TILED does not force them


# Inductor's CPU kernels without SIMD: choosing a vector tiling is a third of a cell's Python
# codegen (sympy), and scalar kernels compile faster (measured: Qwen3-Next 72 -> 51 s, LFM2 under
# memo 31 -> 19 s a cell, kernels cached).  What the policies change (the partition, the
# schedule, the buffers, the collectives' waits) is the same either way; vectorized kernels are
# still exercised by the one-rank cells below and the other Inductor tests.
SCALAR_KERNELS = {"inductor_options": {"cpp.simdlen": 1}}

HP2_CP2 = [Cell(p, c, 2, 2) for p, cases in POLICY_CASES.items() for c in cases]
assert {Cell(p, c, 2, 2) for p, c in TILED} \
    | {Cell(p, c, 2, 2) for p, c in HEAD_GROUPED - {ONE_RANK_GROUPED}
       if c.compile == "model"} <= set(HP2_CP2)
# issue 52's grid, tiling under every activation policy on the five families: TILED's cells of
# it run in CI; the others only with TILING_GRID=1 (25 cells, ~15 min on 2 cores; CI's
# 45 minutes have no room for them): ``TILING_GRID=1 pytest -k tiled-grid
# tests/test_trust_matrix_inductor.py``.  A family's regions are as many under every policy.
TILING_FAMILIES = {Case("llama"): 1, Case("gemma3", window=WINDOW_SHARD): 4,
                   Case("gpt2", attn="eager"): 1, Case("qwen3moe"): 1, Case("deepseek_v3"): 3}
TILING_GRID = [Cell(p, c, 2, 2, tiled=True)
               for p in ("none", "sc++", "memo-alpha0", "memo-alpha1", "full", "full_offload")
               for c in TILING_FAMILIES if (p, c) not in TILED]
HP2_CP2 += TILING_GRID if os.environ.get("TILING_GRID") else []
# cp = 4: every run but the first takes its halo and its start state from another rank; Falcon-H1
# and Qwen3.5 with packed documents, the state reset at each document start wherever it falls
# (issue 51: judged against each document alone)
SCANS_PACKED = [Case("falcon_h1", habit="packed_use_cache_false"),
                Case("qwen3_5", habit="packed_use_cache_false")]
CP4 = [Cell("none", c, 1, 4) for c in [Case("lfm2"), Case("qwen3_next"), Case("bamba"),
                                       *SCANS_PACKED]]
# hp = cp = 1 (issue 36): one process holds the whole sequence, and the attention pass replaces
# every mask it proves (documents, padding, windows, chunks: the S x S mask transformers builds
# under torch.compile) with 2D-Attention's masked op on one rank.  (the calls at least
# rewritten, one per layer; a graph compiled again counts its own, by case)
LAYERS_REWRITTEN = {Case("llama", habit="packed_use_cache_false"): 1,
                    Case("qwen2", habit="padding"): 1,
                    Case("mistral", window=WINDOW_SHARD): 1,
                    Case("gemma3", window=WINDOW_SHARD, habit="packed_use_cache_false"): 2,
                    Case("llama4"): 1}   # its NoPE layer: is_causal, no mask
ONE_RANK = [Cell("none", c, 1, 1) for c in LAYERS_REWRITTEN]


# issue 51: the model compiled block by block under sc++ and memo, the supported way
# (lc.hf.compile_blocks: each block builds its masks inside, the head and the loss a graph of
# their own) and by hand (each decoder layer's .compile(): the masks and the loss outside every
# graph, from a rank's own tokens).  Gemma 3's local and global layers are two graphs.
# what blocks compiled by hand cannot see, refused on every rank: the mask transformers built
# outside a block from the rank's own tokens (the attention pass cannot prove it) or, where a
# rank built none, the ranks' graphs differing at the compile check; transformers' loss computed
# outside every graph, on the rank's own tokens, by the forward the blocks are called from
MASK_BUILT_OUTSIDE = [("LoongUnsupportedError", ["cannot be distributed exactly", "attention_mask"]),
                      ("LoongRankMismatchError", ["rank"])]
BY_HAND_REFUSED = {"packed_use_cache_false": MASK_BUILT_OUTSIDE, "padding": MASK_BUILT_OUTSIDE,
                   "labels": [("LoongShapeError", ["forward(labels=...)", "compile_blocks",
                                                   "shift_labels=batch.labels"])]}
# A block compiled on its own is one layer to the activation policies (its input a graph
# input; every block runs the graph, none resident): each policy on both ways, one case each
BLOCKS = [Cell(policy, Case(arch, window=window, habit=habit, compile="blocks"), 2, 2)
          for policy, arch, window, habit in [
              ("full_offload", "llama", None, "plain"), ("sc++", "llama", None, "labels"),
              ("memo-alpha0", "llama", None, "packed_use_cache_false"),
              ("full", "qwen2", None, "padding"), ("full_offload", "mistral", WINDOW_SHARD, "plain"),
              ("memo-alpha0", "gemma3", None, "plain"),
              # all of Gemma 3's at once: packed documents, a window shorter than a rank's
              # share on its local layers
              ("sc++", "gemma3", WINDOW_SHARD, "packed_use_cache_false")]]
BLOCKS += [Cell(policy, Case(arch, window=window, compile="by_hand"), 2, 2)
           for policy, arch, window in [("full_offload", "llama", None),
                                        ("memo-alpha0", "mistral", WINDOW_SHARD),
                                        ("full", "gemma3", None)]]
# a refusal comes before anything a policy does: under one
BLOCKS += [Cell("sc++", Case(arch, habit=habit, compile="by_hand"), 2, 2)
           for arch, habit in [("llama", "packed_use_cache_false"), ("qwen2", "padding"),
                               ("llama", "labels")]]


# transformers' gradient checkpointing, by hand, where Dynamo cannot trace it in one graph
# (transformers >= 5.25: the hub-kernel wrapper of the attention changes a global inside the
# checkpointed body) and the user did not tell it to: Dynamo breaks the graph there and runs the
# layers eagerly, refused on every rank naming checkpointing and the fix; exact where it traces
# (the grad_ckpt cells above trace it, as that fix's last option tells)
UNTRACED_CHECKPOINTS = [Cell("none", Case(arch, habit="grad_ckpt_untraced"), 2, 2)
                        for arch in ("llama", "qwen2", "gemma3")]
CHECKPOINT_BREAK = ("LoongUnsupportedError", [
    "Dynamo broke the graph at torch.utils.checkpoint", "gradient_checkpointing_disable()",
    "'activations': 'full'", "compile_blocks", "skip_fwd_side_effects_in_bwd_under_checkpoint"])


def _options(cell: Cell) -> dict:
    groups = {"head_groups": HEAD_GROUPS} if _head_grouped(cell) else {}
    if cell.hp * cell.cp == 1:
        return {"lowering": "inductor", **groups}
    tiled = cell.tiled or (cell.policy, cell.case) in TILED
    tiles = {"tile_tokens": TILE_TOKENS} if tiled else {}
    return {"lowering": "inductor", "rank_check_timeout": 60, **SCALAR_KERNELS,
            **POLICIES[cell.policy], **tiles, **groups}


def _head_grouped(cell: Cell) -> bool:
    return not cell.tiled and (cell.policy, cell.case) in HEAD_GROUPED


@pytest.fixture(scope="module")
def outcomes(request) -> dict:
    """Each selected cell's result (its ranks' outcomes, or the exception of its call): two
    cells at a time (``run_each``), while this process computes the references.  A cell's
    ranks wait while one of them lowers a graph the others load, so one cell alone leaves a
    core idle (docs/benchmarks.md, "Test suite time")."""
    params = [getattr(item, "callspec", None) for item in request.session.items
              if item.module is request.module]
    cells = list(dict.fromkeys(p.params["cell"] for p in params if p and "cell" in p.params))
    calls = [(run_case, c.hp * c.cp, (c.hp, c.cp, c.case, _options(c))) for c in cells]
    with ThreadPoolExecutor(1) as background:
        background.submit(warm_references, [c.case for c in cells])
        results = run_each(calls, timeout=CASE_TIMEOUT)
    return dict(zip(cells, results))


def _exact_under_inductor(outcomes: dict, cell: Cell) -> dict:
    """The cell's work_done, once its loss and gradients are within the tolerance."""
    result = outcomes[cell]
    where = f"{cell.case.name} under {cell.policy} at hp={cell.hp} x cp={cell.cp}"
    if isinstance(result, BaseException):
        pytest.fail(f"{where}: {type(result).__name__}: {str(result)[:3000]}")
    outcome = result[0]
    assert outcome[0] == "ok", f"{where}: {outcome[1]}: {outcome[2][:3000]}"
    error = relative_error(outcome[1:3], reference(cell.case))
    bound = max(INDUCTOR_TOLERANCE, tolerance(cell.case))   # a float32 scan kernel: its own error
    assert error <= bound, f"{where}: relative error {error:.1e} > {bound:.1e}"
    return outcome[3]


# the first cell's item waits for the module's cells (~10 min on 2 cores)
MODULE_TIMEOUT = 3000


@pytest.mark.slow
@pytest.mark.timeout(MODULE_TIMEOUT)
@pytest.mark.parametrize("cell", HP2_CP2, ids=[f"{c.policy}-{c.case.name}"
                                                + ("-tiled-grid" if c.tiled else "") for c in HP2_CP2])
def test_case_is_exact_under_inductor_at_hp2_cp2(outcomes, cell):
    done = _exact_under_inductor(outcomes, cell)
    if cell.policy in WORK:
        assert WORK[cell.policy](done), f"{cell.case.name}: {cell.policy} did nothing: {done}"
    regions = TILING_FAMILIES[cell.case] if cell.tiled else TILED.get((cell.policy, cell.case), 0)
    assert done["tiled_regions"] == regions, done
    assert done["head_groups"] == [HEAD_GROUPS if _head_grouped(cell) else 1], done


@pytest.mark.slow
@pytest.mark.timeout(MODULE_TIMEOUT)
@pytest.mark.parametrize("cell", CP4, ids=[c.case.name for c in CP4])
def test_scans_are_exact_under_inductor_at_cp4(outcomes, cell):
    _exact_under_inductor(outcomes, cell)


@pytest.mark.slow
@pytest.mark.timeout(MODULE_TIMEOUT)
@pytest.mark.parametrize("cell", ONE_RANK, ids=[c.case.name for c in ONE_RANK])
def test_one_rank_drops_the_mask_and_is_exact_under_inductor(outcomes, cell):
    done = _exact_under_inductor(outcomes, cell)
    layers = LAYERS_REWRITTEN[cell.case]
    assert done["attention_rewritten"] >= layers and not done["attention_kept"], done
    assert done["head_groups"] == [HEAD_GROUPS if _head_grouped(cell) else 1], done


@pytest.mark.slow
@pytest.mark.timeout(MODULE_TIMEOUT)
@pytest.mark.parametrize("cell", BLOCKS, ids=[f"{c.policy}-{c.case.name}" for c in BLOCKS])
def test_blocks_compiled_one_by_one_are_exact_or_refused_on_every_rank(outcomes, cell):
    refusals = BY_HAND_REFUSED.get(cell.case.habit) if cell.case.compile == "by_hand" else None
    if refusals is None:
        # exact, and the policy did its work where the reports are collected (by hand: the
        # backend object; compile_blocks compiles through the "loong" string)
        done = _exact_under_inductor(outcomes, cell)
        if cell.case.compile == "by_hand":
            assert WORK[cell.policy](done), f"{cell.case.name}: {cell.policy} did nothing: {done}"
            assert done["head_groups"] == [HEAD_GROUPS if _head_grouped(cell) else 1], done
        return
    result = outcomes[cell]
    assert not isinstance(result, BaseException), f"{cell.case.name}: {result}"
    for rank, outcome in enumerate(result):
        assert outcome[0] == "refused" and any(
            outcome[1] == error and all(w in outcome[2] for w in words) for error, words in refusals
        ), f"{cell.case.name} under {cell.policy} on rank {rank}: {outcome}"



@pytest.mark.slow
@pytest.mark.timeout(MODULE_TIMEOUT)
@pytest.mark.parametrize("cell", UNTRACED_CHECKPOINTS, ids=[c.case.name for c in UNTRACED_CHECKPOINTS])
def test_checkpointing_dynamo_cannot_trace_is_refused_by_name_on_every_rank(outcomes, cell):
    if dynamo_traces_checkpointing():
        _exact_under_inductor(outcomes, cell)
        return
    result = outcomes[cell]
    assert not isinstance(result, BaseException), f"{cell.case.name}: {result}"
    error, words = CHECKPOINT_BREAK
    for rank, outcome in enumerate(result):
        assert outcome[0] == "refused" and outcome[1] == error, (rank, outcome)
        missing = [w for w in words if w not in outcome[2]]
        assert not missing, f"{cell.case.name} on rank {rank}: message lacks {missing}: {outcome[2]}"
