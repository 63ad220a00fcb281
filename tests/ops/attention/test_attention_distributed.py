"""2D-Attention on 4 and 8 gloo ranks against one-process SDPA on the full sequence.

Every (hp, cp) factorisation, both placements, every inner ring size, causal
and not, MHA / GQA (split and replicated KV heads) / MQA, float64 and float32:
out, lse, dq, dk, dv gathered back must equal the one-process reference, and
the bytes each rank sends must equal LoongTrain §4.5's formulas.  Each world
size runs in ONE spawn (a module fixture); the tests read its sections.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import Sections, section_results
from loong_compile.parallel.tokens import gather_sequence, mesh_token_indices, sequence_divisor, shard_batch
from loong_compile.errors import LoongError
from loong_compile.parallel.rules import head_group_choices
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import attention_2d, comm_counters, reset_comm_counters
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
BAD_INPUTS = "bad inputs"   # the section after the configs
HEAD_GROUPS = "head groups"   # sections (HEAD_GROUPS, hp, cp) before it, on 4 ranks
HEAD_GROUP_MESHES = [(2, 2), (4, 1), (1, 4)]
BATCH, HEAD_DIM = 2, 40


def mesh_configs(sp: int) -> list[tuple[int, int, str, int]]:
    """(hp, cp, placement, w) for every factorisation of sp (placements differ if hp, cp > 1)."""
    configs = []
    for hp in (h for h in range(1, sp + 1) if sp % h == 0):
        cp = sp // hp
        placements = ("head_first", "context_first") if hp > 1 and cp > 1 else ("head_first",)
        configs += [(hp, cp, p, w) for p in placements for w in range(1, cp + 1) if cp % w == 0]
    return configs


def head_cases(hp: int) -> dict[str, tuple[int, int]]:
    """(query heads, KV heads): MHA, GQA with KV heads split or (H_kv < hp) replicated, MQA."""
    heads = math.lcm(6, hp)  # 6 heads where hp allows: not a power of two
    cases = {"mha": (heads, heads), "gqa": (heads, max(2, hp)), "mqa": (heads, 1)}
    if hp > 2:
        cases["gqa_replicated"] = (heads, 2)
    return cases


def reference(q, k, v, dout, is_causal):
    """One process, full sequence, float64: SDPA's out and grads, and the LSE from the scores."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    kv = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = q @ kv.transpose(-1, -2) / math.sqrt(q.size(-1))
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
    return out.detach(), torch.logsumexp(scores, -1).detach(), *grads


def expected_bytes(hp, cp, heads, kv_heads, seq, dtype, return_lse):
    """LoongTrain §4.5 per rank, for B sequences, head dim D, element sizes of the dtype.

    P2P: (cp-1) KV chunks of max(H_kv, hp)/hp · S/cp tokens forward; backward the
    same KV again plus cp dK/dV chunks (accumulated in fp32/fp64).  All-to-all:
    (hp-1)/hp of q, k, v, out (forward) and of their gradients (backward).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    kv_chunk = 2 * BATCH * (max(kv_heads, hp) // hp) * (seq // cp) * HEAD_DIM
    per_token = BATCH * (seq // (hp * cp)) * HEAD_DIM  # per head, this rank's tokens
    a2a = (heads + 2 * max(kv_heads, hp) + heads) * per_token * elem * (hp - 1) // hp
    lse = BATCH * heads * (seq // (hp * cp)) * acc * (hp - 1) // hp if return_lse else 0
    # attention gathers nothing (the all-gather counter is the scans')
    return {"fwd": {"p2p": (cp - 1) * kv_chunk * elem, "all_to_all": a2a + lse, "all_gather": 0},
            "bwd": {"p2p": (cp - 1) * kv_chunk * elem + (cp * kv_chunk * acc if cp > 1 else 0),
                    "all_to_all": a2a, "all_gather": 0}}


def full_inputs(heads, kv_heads, seq, seed):
    """q, k, v and the output's gradient of the whole sequence, float64."""
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(BATCH, heads, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
               for _ in range(2))
    k, v = (torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
            for _ in range(2))
    return q, k, v, dout


def relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def _check_config(hp, cp, placement, w, dp=None, float32_non_causal=True):
    """Run every head case / mask / dtype on one mesh; return (label, errors, bytes, expected)."""
    mesh = init_mesh(hp=hp, cp=cp, placement=placement, inner_ring=w, dp=dp)
    seq = 3 * sequence_divisor(cp, hp)  # an odd multiple of 2*cp*hp
    index = mesh_token_indices(seq, mesh)
    records = []
    for case, (heads, kv_heads) in head_cases(hp).items():
        q, k, v, dout = full_inputs(heads, kv_heads, seq, seed=1000 * heads + kv_heads)
        for is_causal in (True, False):
            want = reference(q, k, v, dout, is_causal)
            float32 = is_causal or float32_non_causal
            for dtype in (torch.float64, torch.float32) if float32 else (torch.float64,):
                local = [t[:, :, index].to(dtype).requires_grad_() for t in (q, k, v)]
                reset_comm_counters()
                out, lse = attention_2d(*local, is_causal=is_causal, scale=None, return_lse=True,
                                        **mesh.attention_kwargs())
                fwd = comm_counters()
                reset_comm_counters()
                grads = torch.autograd.grad(out, local, dout[:, :, index].to(dtype))
                bwd = comm_counters()
                # this rank's rows of the reference, at the positions parallel/tokens.py assigns it
                errors = dict(zip(("out", "lse", "dq", "dk", "dv"),
                                  (relative_error(g, r[:, :, index])
                                   for g, r in zip((out, lse, *grads), want))))
                label = (f"hp={hp} cp={cp} {placement} w={w} dp={mesh.dp} {case} H={heads} "
                         f"Hkv={kv_heads} S={seq} causal={is_causal} {dtype}")
                records.append((label, dtype, errors, {"fwd": fwd, "bwd": bwd},
                                expected_bytes(hp, cp, heads, kv_heads, seq, dtype, True)))
    # gather_sequence undoes the layout: the full output on every rank
    full = gather_sequence(out.detach(), mesh, dim=2)
    records.append((f"hp={hp} cp={cp} {placement} w={w} gather_sequence", dtype,
                    {"gathered out": relative_error(full, want[0])}, None, None))
    return records


def _check_head_groups(hp, cp):
    """Causal float64 2D-Attention with every allowed head group count against one process; the
    all-to-all bytes as without groups (a shared KV head is exchanged once), the ring's KV bytes
    times the groups that share a KV head."""
    mesh = init_mesh(hp=hp, cp=cp)
    seq = 3 * sequence_divisor(cp, hp)
    index = mesh_token_indices(seq, mesh)
    records = []
    for case, (heads, kv_heads) in head_cases(hp).items():
        q, k, v, dout = full_inputs(heads, kv_heads, seq, seed=7 * heads + kv_heads)
        want = reference(q, k, v, dout, True)
        for groups in head_group_choices(heads, kv_heads, hp)[1:]:   # every count but 1
            local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
            reset_comm_counters()
            out, lse = attention_2d(*local, is_causal=True, return_lse=True, head_groups=groups,
                                    **mesh.attention_kwargs())
            grads = torch.autograd.grad(out, local, dout[:, :, index])
            sent = comm_counters()
            errors = dict(zip(("out", "lse", "dq", "dk", "dv"),
                              (relative_error(g, r[:, :, index])
                               for g, r in zip((out, lse, *grads), want))))
            plain = expected_bytes(hp, cp, heads, kv_heads, seq, torch.float64, True)
            share = max(1, groups // (max(kv_heads, hp) // hp))
            expected = {"all_to_all": plain["fwd"]["all_to_all"] + plain["bwd"]["all_to_all"],
                        "p2p": share * (plain["fwd"]["p2p"] + plain["bwd"]["p2p"])}
            records.append((f"hp={hp} cp={cp} {case} H={heads} Hkv={kv_heads} groups={groups}",
                            errors, {kind: sent[kind] for kind in expected}, expected,
                            out.stride()))
    return records


def _bad_inputs(world):
    """Each bad input must raise a LoongError on every rank, before any collective."""
    def attempt(name, fn):
        try:
            fn()
        except LoongError as e:
            return name, type(e).__name__, str(e)
        return name, None, "no error"

    def attention(mesh_kwargs, heads, kv_heads, seq_local, **overrides):
        tensors = {"q": torch.randn(1, heads, seq_local, 8),
                   "k": torch.randn(1, kv_heads, seq_local, 8),
                   "v": torch.randn(1, kv_heads, seq_local, 8), **overrides}
        return lambda: attention_2d(tensors["q"], tensors["k"], tensors["v"], is_causal=True,
                                    scale=None, **mesh_kwargs)

    hp4 = init_mesh(hp=4, cp=1).attention_kwargs()
    hp2cp2_mesh = init_mesh(hp=2, cp=2, inner_ring=2)
    hp2cp2 = hp2cp2_mesh.attention_kwargs()
    results = [
        attempt("heads % hp", attention(hp4, 6, 6, 4)),
        attempt("hp > H_kv, hp % H_kv", attention(hp4, 12, 3, 4)),
        attempt("seq % 2*cp*hp", attention(hp2cp2, 4, 4, 3)),
        attempt("shard_batch seq", lambda: shard_batch(torch.zeros(1, 12, dtype=torch.long), None,
                                                       hp2cp2_mesh)),
        attempt("dtype mismatch", attention(hp2cp2, 4, 4, 4, k=torch.randn(1, 4, 4, 8).double())),
        attempt("device mismatch", attention(hp2cp2, 4, 4, 4,
                                             v=torch.randn(1, 4, 4, 8, device="meta"))),
        attempt("inner ring % cp", lambda: init_mesh(hp=1, cp=4, inner_ring=3)),
        attempt("world % hp*cp", lambda: init_mesh(hp=3, cp=1)),
        attempt("dp*hp*cp != world", lambda: init_mesh(hp=2, cp=2, dp=2)),
        attempt("kwargs of another mesh", attention({**hp4, "hp": 2, "cp": 2}, 4, 4, 4)),
        attempt("head groups split a KV head", attention({**hp2cp2, "head_groups": 3}, 12, 4,
                                                         4)),
    ]
    # the ranks are still in step: a collective issued by one rank only would hang here
    dist.barrier()
    return results


def _suite(rank, world, configs, with_bad_inputs, float32_non_causal):
    """The whole spawn: one section per attention config, then bad inputs."""
    sections = Sections()
    for config in configs:
        sections.run(config, functools.partial(_check_config, float32_non_causal=float32_non_causal), *config)
    if with_bad_inputs:
        for hp, cp in HEAD_GROUP_MESHES:
            sections.run((HEAD_GROUPS, hp, cp), _check_head_groups, hp, cp)
        sections.run(BAD_INPUTS, _bad_inputs, world)
    return sections.results


def _records(results) -> list[list]:
    """Per rank, the records of every config section (fails on a section that raised)."""
    per_config = [section_results(results, key) for key in results[0]
                  if key != BAD_INPUTS and key[0] != HEAD_GROUPS]
    return [[r for values in per_config for r in values[rank]] for rank in range(len(results))]


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_suite, 4, mesh_configs(4), True, True, timeout=240)


@pytest.fixture(scope="module")
def eight_ranks():
    # every sp=8 factorisation, plus dp=2 x sp=4 on the same 8 ranks; float32 causal only
    configs = mesh_configs(8) + [(2, 2, "context_first", 2, 2), (1, 4, "head_first", 2, 2)]
    return run_distributed(_suite, 8, configs, False, False, timeout=400)


def _assert_numerics(results):
    records = [r for rank_records in _records(results) for r in rank_records]
    assert records
    for label, dtype, errors, _, _ in records:
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE[dtype], f"{label}: {worst} rel. error {errors[worst]:.3g}"


def _assert_bytes(results):
    for rank, rank_records in enumerate(_records(results)):
        for label, _, _, measured, expected in rank_records:
            if expected is not None:
                assert measured == expected, f"rank {rank} {label}: {measured} vs §4.5 {expected}"


@pytest.mark.slow
def test_attention_matches_sdpa_on_4_ranks(four_ranks):
    _assert_numerics(four_ranks)
    # head cases x causal x dtype, and one gather_sequence check per mesh
    runs = sum(len(head_cases(hp)) * 2 * 2 + 1 for hp, *_ in mesh_configs(4))
    assert len(_records(four_ranks)[0]) == runs


@pytest.mark.slow
def test_bytes_sent_match_paper_formulas_on_4_ranks(four_ranks):
    _assert_bytes(four_ranks)


@pytest.mark.slow
def test_bad_inputs_raise_on_every_rank(four_ranks):
    per_rank = section_results(four_ranks, BAD_INPUTS)
    for name, error, message in per_rank[0]:
        assert error is not None, f"{name}: {message}"
    expected = {"heads % hp": "LoongShapeError", "hp > H_kv, hp % H_kv": "LoongShapeError",
                "seq % 2*cp*hp": "LoongShapeError", "shard_batch seq": "LoongShapeError",
                "dtype mismatch": "LoongShapeError", "device mismatch": "LoongShapeError",
                "inner ring % cp": "LoongMeshError", "world % hp*cp": "LoongMeshError",
                "dp*hp*cp != world": "LoongMeshError", "kwargs of another mesh": "LoongMeshError",
                "head groups split a KV head": "LoongConfigError"}
    assert {name: error for name, error, _ in per_rank[0]} == expected
    for rank_results in per_rank[1:]:  # identical on every rank
        assert [(n, e) for n, e, _ in rank_results] == [(n, e) for n, e, _ in per_rank[0]]
    for _, _, message in per_rank[0]:
        assert "rule:" in message and "fix:" in message


@pytest.mark.slow
def test_head_groups_match_sdpa_and_exchange_a_shared_kv_head_once(four_ranks):
    for hp, cp in HEAD_GROUP_MESHES:
        per_rank = section_results(four_ranks, (HEAD_GROUPS, hp, cp))
        # hp=2: 3 query heads a rank (groups 3); hp=4: 3 with a 1-3 KV heads (3); hp=1: 6 (2, 3, 6)
        assert len(per_rank[0]) >= 3, per_rank[0]
        for records in per_rank:
            for label, errors, sent, expected, stride in records:
                worst = max(errors, key=errors.get)
                assert errors[worst] <= TOLERANCE[torch.float64], f"{label}: {worst} {errors}"
                assert sent == expected, f"{label}: sent {sent}, expected {expected}"
                # token-major: the output projection's transpose reads it as is
                assert stride[1] == HEAD_DIM, f"{label}: out strides {stride}"


@pytest.mark.slow
def test_attention_matches_sdpa_on_8_ranks(eight_ranks):
    _assert_numerics(eight_ranks)


@pytest.mark.slow
def test_bytes_sent_match_paper_formulas_on_8_ranks(eight_ranks):
    _assert_bytes(eight_ranks)


def test_expected_bytes_is_the_paper_formula_in_fp16():
    """The test's formula reduces to §4.5's in the paper's units (fp16, B = 1, D = H·Dh)."""
    hp, cp, heads, kv_heads, seq = 4, 8, 32, 8, 1024
    got = expected_bytes(hp, cp, heads, kv_heads, seq, torch.float16, False)
    hidden, sp, batch = heads * HEAD_DIM, hp * cp, BATCH
    size_kv = max(kv_heads, hp) / heads * 4 * seq * hidden / sp * batch
    size_q = 2 * seq * hidden / sp * batch
    assert got["fwd"]["p2p"] == (cp - 1) * size_kv
    assert got["fwd"]["all_to_all"] == (2 * size_q + 2 * size_kv / 2) * (hp - 1) / hp


def test_mesh_configs_cover_every_factorisation():
    assert len(mesh_configs(4)) == 3 + 2 * 2 + 1
    assert len(mesh_configs(8)) == 4 + 3 * 2 + 2 * 2 + 1
