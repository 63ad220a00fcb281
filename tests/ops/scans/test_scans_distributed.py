"""The ops of token mixers with a state (``ops/scans/causal_conv.py``, ``ops/scans/gated_scan.py``) on 2, 4
and 8 gloo ranks against one process, float64, forward and backward.

Each rank gets its tokens of one sequence as the layout places them (the zigzag: two runs far
apart, the middle CP rank one), computes the op, and back-propagates its part of one upstream
gradient; the ranks' outputs and input gradients placed at their tokens, and their parameter
gradients summed, must equal the sequential computation of one process on the whole sequence:
a causal convolution with left padding, the recurrence token by token.  The cases put chunk
boundaries inside a convolution's kernel (runs of 2 tokens under a kernel of 4), a kernel of one
token (nothing exchanged), the heads split over an HP group, and sequences that are not a
multiple of the recurrence's chunk, and transformers' Mamba-2 scan around the recurrence
(``mamba2_scan``: its dt rule, groups and skip, in float32 as transformers computes it).  The
bytes each rank sends are the formula of docs/attention.md ("Scans").

With packed documents (``docs``: each row's document lengths) the reference is each document
alone (``helpers.each_document_alone``: a zero state and no halo at its start, as the kernels
users run with ``cu_seqlens`` / ``seq_idx``); the layouts put starts inside a run and inside a
chunk of the chunked form, on a run boundary within a rank, on a rank boundary, single-token
documents, and ranks that hold no start.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import each_document_alone, mamba2_recurrence, sequential_recurrence
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

B, C, H, DK, DV = 2, 6, 4, 3, 5
GROUPS = 2   # Mamba-2's groups of B and C (each serves H / GROUPS heads)


def conv_inputs(seq: int, kernel: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seq * 10 + kernel)
    x, grad = (torch.randn(B, C, seq, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(C, kernel, generator=gen, dtype=torch.float64)
    return x, weight, torch.randn(C, generator=gen, dtype=torch.float64), grad


def scan_inputs(seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq)
    shapes = {"q": (B, H, seq, DK), "k": (B, H, seq, DK), "v": (B, H, seq, DV),
              "g": (B, H, seq), "beta": (B, H, seq), "grad": (B, H, seq, DV)}
    out = {name: torch.randn(*shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    out["k"] = F.normalize(out["k"], dim=-1)     # as the models' l2-normed keys: a bounded state
    out["g"] = -out["g"].abs()
    out["beta"] = out["beta"].sigmoid()
    return out


def mamba2_inputs(seq: int) -> dict[str, torch.Tensor]:
    """transformers' ``mamba2_chunk_scan`` arguments (state DK, head dim DV) and an upstream
    gradient, float64."""
    gen = torch.Generator().manual_seed(seq + 1)
    shapes = {"x": (B, seq, H, DV), "dt": (B, seq, H), "A": (H,), "B": (B, seq, GROUPS, DK),
              "C": (B, seq, GROUPS, DK), "D": (H,), "dt_bias": (H,), "grad": (B, seq, H, DV)}
    out = {name: torch.randn(*shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    out["A"] = -out["A"].abs()
    return out


def document_ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def conv_reference(x, weight, bias):
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.size(-1) - 1, groups=x.size(1))[..., :x.size(-1)]


def _on_rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import loong_compile as lc
    from loong_compile.ops import comm_counters, reset_comm_counters
    from loong_compile.ops.scans.causal_conv import causal_conv1d
    from loong_compile.ops.scans.documents import scan_documents
    from loong_compile.ops.scans.gated_scan import gated_scan, mamba2_scan
    from loong_compile.parallel.tokens import local_token_indices, mesh_token_indices

    results = []
    for case in cases:
        mesh = lc.init_mesh(hp=case["hp"], cp=case["cp"])
        # every rank's numbers of the whole sequence's documents, as the passes hand them over
        documents = scan_documents(document_ids(case["docs"])) if "docs" in case else None
        reset_comm_counters()
        if case["op"] == "conv":
            index = mesh_token_indices(case["seq"], mesh)
            x, weight, bias, grad = conv_inputs(case["seq"], case["kernel"])
            x = x[..., index].clone().requires_grad_()
            weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            out = causal_conv1d(x, weight, bias, **mesh.scan_kwargs(), documents=documents)
            sent = comm_counters()["all_gather"]
            out.backward(grad[..., index])
            grads = {"x": x.grad, "weight": weight.grad, "bias": bias.grad}
        elif case["op"] == "mamba2":    # before the head all-to-all: the rank's tokens, every head
            index = mesh_token_indices(case["seq"], mesh)
            full = mamba2_inputs(case["seq"])
            leaves = {n: (t[:, index] if t.dim() > 1 else t).clone().requires_grad_()
                      for n, t in full.items() if n != "grad"}
            out = mamba2_scan(*(leaves[n] for n in ("x", "dt", "A", "B", "C", "D", "dt_bias")),
                              dt_softplus=True, dt_min=0.0, dt_max=float("inf"), hp=mesh.hp,
                              cp=mesh.cp, hp_group=mesh.group_names["hp"],
                              cp_group=mesh.group_names["dkv_outer"], documents=documents)
            sent = comm_counters()["all_gather"]
            out.backward(full["grad"][:, index])
            grads = {n: t.grad for n, t in leaves.items()}
        else:   # after the head all-to-all: the CP shard, this HP rank's heads
            index = local_token_indices(case["seq"], mesh.cp, 1, mesh.cp_rank, 0)
            heads = slice(mesh.hp_rank * H // mesh.hp, (mesh.hp_rank + 1) * H // mesh.hp)
            inputs = {n: t[:, heads, index].clone().requires_grad_() for n, t in scan_inputs(case["seq"]).items()}
            grad = inputs.pop("grad").detach()
            if not case["delta"]:
                del inputs["beta"]
            out = gated_scan(beta=inputs.get("beta"), **{n: t for n, t in inputs.items() if n != "beta"},
                             delta=case["delta"], chunk=case["chunk"], **mesh.scan_kwargs(heads_split=True),
                             documents=documents)
            sent = comm_counters()["all_gather"]
            out.backward(grad)
            grads = {n: t.grad for n, t in inputs.items()}
            index = (heads.start, heads.stop, index)
        results.append({"out": out.detach(), "grads": grads, "index": index, "sent": sent,
                        "sent_with_backward": comm_counters()["all_gather"]})
    return results


def _assemble(case: dict, per_rank: list[dict]) -> tuple[torch.Tensor, dict]:
    """The ranks' outputs and token gradients at their places, the parameter gradients summed."""
    if case["op"] == "conv":
        x, weight, bias, _ = conv_inputs(case["seq"], case["kernel"])
        out, grads = torch.zeros_like(x), {"x": torch.zeros_like(x), "weight": 0, "bias": 0}
        for r in per_rank:
            out[..., r["index"]] = r["out"]
            grads["x"][..., r["index"]] += r["grads"]["x"]
            grads["weight"] = grads["weight"] + r["grads"]["weight"]
            grads["bias"] = grads["bias"] + r["grads"]["bias"]
        return out, grads
    if case["op"] == "mamba2":
        full = mamba2_inputs(case["seq"])
        out = torch.zeros_like(full["x"])
        grads = {n: torch.zeros_like(full[n]) for n in per_rank[0]["grads"]}
        for r in per_rank:
            out[:, r["index"]] = r["out"]
            for n, g in r["grads"].items():
                if g.dim() > 1:
                    grads[n][:, r["index"]] += g
                else:
                    grads[n] += g
        return out, grads
    full = scan_inputs(case["seq"])
    out = torch.zeros_like(full["v"])
    grads = {n: torch.zeros_like(full[n]) for n in per_rank[0]["grads"]}
    for r in per_rank:
        first, stop, index = r["index"]
        out[:, first:stop, index] = r["out"]
        for n in grads:
            grads[n][:, first:stop, index] += r["grads"][n]
    return out, grads


def _reference(case: dict) -> tuple[torch.Tensor, dict]:
    if case["op"] == "conv":
        x, weight, bias, grad = conv_inputs(case["seq"], case["kernel"])
        leaves = {"x": x, "weight": weight, "bias": bias}
        for t in leaves.values():
            t.requires_grad_()
        out = _documents(case, lambda x: conv_reference(x, weight, bias), 2, x)
    elif case["op"] == "mamba2":
        leaves = {n: t.requires_grad_() for n, t in mamba2_inputs(case["seq"]).items()}
        grad = leaves.pop("grad").detach()
        out = _documents(case, lambda x, dt, B, C: mamba2_recurrence(
            x, dt, leaves["A"], B, C, D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True),
            1, *(leaves[n] for n in ("x", "dt", "B", "C")))
    else:
        full = scan_inputs(case["seq"])
        grad = full.pop("grad")
        leaves = {n: t.requires_grad_() for n, t in full.items() if n != "beta" or case["delta"]}
        names = list(leaves)
        out = _documents(case, lambda *ts: sequential_recurrence(**{"beta": None} | dict(zip(names, ts))),
                         2, *leaves.values())
    out.backward(grad)
    return out.detach(), {n: t.grad for n, t in leaves.items()}


def _documents(case: dict, fn, dim: int, *tensors: torch.Tensor) -> torch.Tensor:
    """One process: ``fn`` over the whole sequence, or each of the case's documents alone."""
    return each_document_alone(fn, case["docs"], dim, *tensors) if "docs" in case else fn(*tensors)


def _expected_bytes(case: dict) -> int:
    """The formula, for the layout's most runs a rank holds (2 with the zigzag; 1 where each
    rank holds one chunk, or at the middle CP rank)."""
    from loong_compile.ops.scans.causal_conv import halo_bytes
    from loong_compile.ops.scans.gated_scan import state_bytes
    from loong_compile.parallel.tokens import token_runs

    hp = case["hp"] if case["op"] == "conv" else 1     # the scan runs on whole CP shards
    size = hp * case["cp"]
    runs = max(len(token_runs(case["seq"], case["cp"], hp, c, h))
               for c in range(case["cp"]) for h in range(hp))
    if case["op"] == "conv":
        return halo_bytes(B, C, case["kernel"], runs, 8) * (size - 1) if size > 1 else 0
    if case["op"] == "mamba2":    # float32, as transformers computes it
        return state_bytes(B, H // case["hp"], DK, DV, False, runs, 4) * (size - 1)
    return state_bytes(B, H // case["hp"], DK, DV, case["delta"], runs, 8) * (size - 1)


# Packed documents, per sequence length (each row's lengths).  24 tokens: runs of 6 at cp = 2
# (rank 0: 0-5, 18-23; rank 1: 6-17 as two runs), of 3 at cp = 4 and of 6 at hp = 2 x cp = 2:
# starts on a rank boundary (6, 18), inside a run (3, 7), on the run boundary within rank 1
# (12); a one-token document (6); rank 1 of the second row holds no start.
DOCS_24 = ([6, 1, 5, 6, 6], [3, 21])
# 28 tokens, runs of 7 at cp = 2: starts on rank boundaries (7, 21), on the run boundary within
# rank 1 (14), inside a run and a chunk of 4 (2, 8); a one-token document (7)
DOCS_28 = ([7, 1, 6, 7, 7], [2, 26])
# 40 tokens, runs of 5 at cp = 4 (rank r: chunks r and 7 - r), of 10 at hp = 2 x cp = 2: starts
# on rank boundaries (5, 10), on rank 3's run boundary (20), inside runs (6, 21); one-token
# documents (5, 20, and the second row's first token)
DOCS_40 = ([5, 1, 4, 10, 1, 19], [1, 39])
CASES = {
    2: [{"op": "conv", "hp": 1, "cp": 2, "seq": 24, "kernel": 4},
        {"op": "conv", "hp": 2, "cp": 1, "seq": 24, "kernel": 4},
        {"op": "scan", "hp": 1, "cp": 2, "seq": 28, "delta": True, "chunk": 4},
        {"op": "scan", "hp": 1, "cp": 2, "seq": 28, "delta": False, "chunk": 4},
        {"op": "mamba2", "hp": 1, "cp": 2, "seq": 28},
        {"op": "conv", "hp": 1, "cp": 2, "seq": 24, "kernel": 4, "docs": DOCS_24},
        {"op": "scan", "hp": 1, "cp": 2, "seq": 28, "delta": True, "chunk": 4, "docs": DOCS_28},
        {"op": "scan", "hp": 1, "cp": 2, "seq": 28, "delta": False, "chunk": 4, "docs": DOCS_28},
        {"op": "mamba2", "hp": 1, "cp": 2, "seq": 28, "docs": DOCS_28}],
    4: [{"op": "conv", "hp": 1, "cp": 4, "seq": 24, "kernel": 4},     # runs of 3: halo of 3
        {"op": "conv", "hp": 2, "cp": 2, "seq": 24, "kernel": 4},
        {"op": "conv", "hp": 1, "cp": 4, "seq": 24, "kernel": 1},     # no halo: nothing sent
        {"op": "scan", "hp": 1, "cp": 4, "seq": 40, "delta": True, "chunk": 4},
        {"op": "scan", "hp": 2, "cp": 2, "seq": 40, "delta": True, "chunk": 4},
        {"op": "scan", "hp": 1, "cp": 4, "seq": 40, "delta": False, "chunk": 64},
        {"op": "mamba2", "hp": 2, "cp": 2, "seq": 40},
        {"op": "conv", "hp": 1, "cp": 4, "seq": 24, "kernel": 4, "docs": DOCS_24},
        {"op": "conv", "hp": 2, "cp": 2, "seq": 24, "kernel": 4, "docs": DOCS_24},
        {"op": "scan", "hp": 1, "cp": 4, "seq": 40, "delta": True, "chunk": 4, "docs": DOCS_40},
        {"op": "scan", "hp": 2, "cp": 2, "seq": 40, "delta": True, "chunk": 4, "docs": DOCS_40},
        {"op": "mamba2", "hp": 1, "cp": 4, "seq": 40, "docs": DOCS_40}],
    8: [{"op": "conv", "hp": 1, "cp": 8, "seq": 32, "kernel": 4},     # runs of 2 inside a kernel of 4
        {"op": "scan", "hp": 1, "cp": 8, "seq": 48, "delta": True, "chunk": 2},
        {"op": "scan", "hp": 1, "cp": 8, "seq": 48, "delta": False, "chunk": 4},
        {"op": "mamba2", "hp": 1, "cp": 8, "seq": 48}],
}


# mamba2_scan computes in float32 whatever its inputs' dtype (as transformers' mamba2_chunk_scan):
# float32's round-off, by tensor norm (a parameter's gradient sums every token's share: dA's
# smallest entry of DOCS_28 loses 3e-5 of itself to cancellation, transformers' own float32 scan
# 3.3e-5); gated_scan under it is exact in float64 (the "scan" cases), element by element
TOLERANCE = {"mamba2": 1e-5}


def _assert_close(got: torch.Tensor, want: torch.Tensor, op: str, what: str) -> None:
    if op not in TOLERANCE:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")
        return
    error = float((got - want).norm() / want.norm())
    assert error <= TOLERANCE[op], f"{what}: relative error {error:.1e} by norm"


def _name(case: dict) -> str:
    what = {"conv": lambda: f"-k{case['kernel']}", "mamba2": lambda: "",
            "scan": lambda: "-delta" if case["delta"] else "-gated"}[case["op"]]()
    docs = "-docs" if "docs" in case else ""
    return f"{case['op']}{what}-hp{case['hp']}-cp{case['cp']}-S{case['seq']}{docs}"


@pytest.fixture(scope="module")
def outcomes() -> dict:
    results = {}
    for world, cases in CASES.items():
        per_rank = run_distributed(_on_rank, world, cases, timeout=240)
        for i, case in enumerate(cases):
            results[_name(case)] = (case, [r[i] for r in per_rank])
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [_name(c) for cases in CASES.values() for c in cases])
def test_each_rank_computes_one_process_values_and_gradients(outcomes, name):
    case, per_rank = outcomes[name]
    out, grads = _assemble(case, per_rank)
    ref_out, ref_grads = _reference(case)
    _assert_close(out, ref_out, case["op"], f"{name} output")
    for n, ref in ref_grads.items():
        _assert_close(grads[n], ref, case["op"], f"{name} d{n}")
    sent = {r["sent"] for r in per_rank}
    assert sent == {_expected_bytes(case)}, (name, sent, _expected_bytes(case))
    # backward sends as much again: the reduce-scatter of the summaries' gradient
    assert {r["sent_with_backward"] for r in per_rank} == {2 * _expected_bytes(case)}, name


def _compiled_on_rank(rank: int, world: int) -> dict[str, float]:
    """Both ops in one function under Inductor, fullgraph (what a pass's rewrite hands it),
    against the same function run eagerly on the same tokens."""
    import loong_compile as lc
    from loong_compile.ops.scans.causal_conv import causal_conv1d
    from loong_compile.ops.scans.gated_scan import gated_scan
    from loong_compile.parallel.tokens import mesh_token_indices

    mesh = lc.init_mesh(hp=1, cp=world)
    scan = mesh.scan_kwargs()

    def step(x, weight, bias, q, k, v, g, beta):
        mixed = causal_conv1d(x, weight, bias, **scan)
        out = gated_scan(q, k, v, g, beta, True, 4, **scan)
        return (mixed * mixed).sum() + (out * out).sum()

    x, weight, bias, _ = conv_inputs(24, 4)
    index = mesh_token_indices(24, mesh)
    full = scan_inputs(24)
    args = [x[..., index], weight, bias] + [full[n][:, :, index] for n in ("q", "k", "v", "g", "beta")]
    args = [a.clone().requires_grad_() for a in args]
    eager = step(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)(*args)
    grads = torch.autograd.grad(compiled, args)
    return {"loss": abs(compiled.item() - eager.item()) / abs(eager.item()),
            "grads": max(((a - b).norm() / b.norm()).item() for a, b in zip(grads, eager_grads))}


@pytest.mark.timeout(600)
def test_the_ops_compile_under_inductor_and_equal_eager():
    for rank, errors in enumerate(run_distributed(_compiled_on_rank, 2, timeout=480)):
        assert errors["loss"] <= 1e-12 and errors["grads"] <= 1e-12, (rank, errors)
