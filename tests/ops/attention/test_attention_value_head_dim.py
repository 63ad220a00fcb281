"""2D-Attention with V's own head dim (MLA: DeepSeek-V2/V3's ``D_v != D_qk``) on 4 gloo ranks.

At hp=2 x cp=2 (head-first with one inner ring, context-first with two), V narrower than Q/K
with as many KV heads as heads (DeepSeek-V3), and wider with one KV head (replicated to hp): the
Double-Ring (causal and not) and the masked exchange (packed documents with
padding and a window) against one process on the full sequence in float64 (SDPA where it has no
mask, the explicit masked softmax otherwise): out, lse, dq, dk, dv of every rank's rows.  The
bytes each rank sends show V travelling with its own head dim: ``D + D_v`` per KV column on the
ring, ``H·D + Ĥ·D + Ĥ·D_v + H·D_v`` per token through the all-to-all.  One spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import Sections, masked_reference, masked_relative_error, section_results
from loong_compile.ops import attention_2d, comm_counters, reset_comm_counters
from loong_compile.parallel.mesh import init_mesh
from loong_compile.parallel.tokens import mesh_token_indices

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

BATCH, SEQ, HEADS = 2, 48, 4
MESHES = [(2, 2, "head_first", 1), (2, 2, "context_first", 2)]
# (query/key head dim, value head dim, KV heads)
HEAD_DIMS = [(24, 16, HEADS), (8, 20, 1)]
DOCS = torch.tensor([[-1] * 3 + [0] * 17 + [1] * 6 + [2] * 22, [0] * 30 + [1] * 16 + [-1] * 2])
# name -> (document ids, is_causal, window); None, None: the Double-Ring
MASKS = {"causal": (None, True, None), "non-causal": (None, False, None),
         "docs + padding + window": (DOCS, True, 10)}
TOLERANCE = 1e-10


def reference(q, k, v, dout, document_ids, is_causal, window):
    """One process, full sequence, float64: (out, lse, dq, dk, dv)."""
    if document_ids is not None or window is not None:
        return masked_reference(q, k, v, dout, document_ids, is_causal, window)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    lse = masked_reference(q, k, v, dout, None, is_causal, None)[1]
    return out.detach(), lse, *torch.autograd.grad(out, (q, k, v), dout)


def ring_bytes(hp, cp, kv_heads, head_dim, v_head_dim):
    """Forward P2P of the Double-Ring: (cp-1) KV chunks of D + D_v columns (float64)."""
    return (cp - 1) * BATCH * (max(kv_heads, hp) // hp) * (SEQ // cp) * (head_dim + v_head_dim) * 8


def all_to_all_bytes(hp, cp, kv_heads, head_dim, v_head_dim):
    """Forward all-to-all: q, k, v there, out back, (hp-1)/hp of each (float64)."""
    kv = max(kv_heads, hp)
    per_token = HEADS * head_dim + kv * head_dim + kv * v_head_dim + HEADS * v_head_dim
    return BATCH * (SEQ // (hp * cp)) * per_token * 8 * (hp - 1) // hp


def _check_mesh(hp, cp, placement, w):
    mesh = init_mesh(hp=hp, cp=cp, placement=placement, inner_ring=w)
    index = mesh_token_indices(SEQ, mesh)
    records = []
    for head_dim, v_head_dim, kv_heads in HEAD_DIMS:
        gen = torch.Generator().manual_seed(head_dim * 100 + v_head_dim)
        q = torch.randn(BATCH, HEADS, SEQ, head_dim, generator=gen, dtype=torch.float64)
        k = torch.randn(BATCH, kv_heads, SEQ, head_dim, generator=gen, dtype=torch.float64)
        v = torch.randn(BATCH, kv_heads, SEQ, v_head_dim, generator=gen, dtype=torch.float64)
        dout = torch.randn(BATCH, HEADS, SEQ, v_head_dim, generator=gen, dtype=torch.float64)
        for name, (document_ids, is_causal, window) in MASKS.items():
            want = reference(q, k, v, dout, document_ids, is_causal, window)
            local = [t[:, :, index].requires_grad_() for t in (q, k, v)]
            reset_comm_counters()
            out, lse = attention_2d(*local, is_causal=is_causal, return_lse=True,
                                    document_ids=document_ids, window=window,
                                    **mesh.attention_kwargs())
            sent = comm_counters()
            grads = torch.autograd.grad(out, local, dout[:, :, index])
            errors = {key: masked_relative_error(g, r[:, :, index]) for key, g, r in
                      zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want)}
            label = f"{placement} w={w} D={head_dim} D_v={v_head_dim} Hkv={kv_heads} {name}"
            expected = {"all_to_all": all_to_all_bytes(hp, cp, kv_heads, head_dim, v_head_dim)
                        + BATCH * HEADS * (SEQ // (hp * cp)) * 8 * (hp - 1) // hp}  # + the lse
            if document_ids is None:
                expected["p2p"] = ring_bytes(hp, cp, kv_heads, head_dim, v_head_dim)
            records.append((label, tuple(out.shape), v_head_dim, errors, sent, expected))
    return records


def _suite(rank, world):
    sections = Sections()
    for config in MESHES:
        sections.run(config, _check_mesh, *config)
    return sections.results


@pytest.fixture(scope="module")
def four_ranks():
    from loong_compile.testing import run_distributed

    return run_distributed(_suite, 4, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", MESHES, ids=lambda c: f"hp{c[0]}cp{c[1]}-{c[2]}-w{c[3]}")
def test_value_head_dim_of_its_own_is_exact_at_hp2_cp2(four_ranks, config):
    checked = 0
    for rank, records in enumerate(section_results(four_ranks, config)):
        for label, out_shape, v_head_dim, errors, sent, expected in records:
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOLERANCE, f"rank {rank} {label}: {worst} {errors[worst]:.3g}"
            assert out_shape == (BATCH, HEADS, SEQ // 4, v_head_dim), label
            for kind, want in expected.items():
                assert sent[kind] == want, f"rank {rank} {label}: {kind} {sent[kind]} != {want}"
            checked += 1
    assert checked == 4 * len(HEAD_DIMS) * len(MASKS)
