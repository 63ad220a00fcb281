"""Masked 2D-Attention (documents, padding, sliding windows) on 4 and 8 gloo ranks.

Against one process on the full sequence in float64 with the same boolean
mask: out, lse, dq, dk, dv of every rank's rows, for every (hp, cp), both
placements and w in {1, 2} where cp allows, MHA and GQA.  Each rank also
checks ``sequence_document_ids`` (from ``shard_batch``'s packed position ids
and padding mask, and from its balanced document order) and that the bytes it sent are what
the plan says.  Each
world size runs in ONE spawn.
"""

from __future__ import annotations

import pytest
import torch

from helpers import Sections, masked_reference, masked_relative_error, section_results
from loong_compile.parallel.tokens import gather_sequence, mesh_token_indices, shard_batch
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import (attention_2d, comm_counters, reset_comm_counters,
                               sequence_document_ids)
from loong_compile.ops.masks.blocks import CHUNK_MAJOR, mask_plan
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

SEQ, BATCH, HEAD_DIM = 96, 2, 8
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}


def mesh_configs(sp: int) -> list[tuple[int, int, str, int]]:
    """(hp, cp, placement, w): every factorisation, both placements where they differ, w in
    {1, 2} where cp allows."""
    configs = []
    for hp in (h for h in range(1, sp + 1) if sp % h == 0):
        cp = sp // hp
        placements = ("head_first", "context_first") if hp > 1 and cp > 1 else ("head_first",)
        configs += [(hp, cp, p, w) for p in placements for w in (1, 2) if cp % w == 0]
    return configs


def documents(*rows: list[tuple[int, int]]) -> torch.Tensor:
    """(B, S) ids from per-row (length, id) runs; id -1 is padding."""
    out = []
    for row in rows:
        out.append(torch.cat([torch.full((length, ), doc) for length, doc in row]))
        assert out[-1].numel() == SEQ
    return torch.stack(out)


# documents shorter than a chunk, boundaries on shard edges (S/8, S/2), one spanning every rank
RANDOM_DOCS = documents([(12, 0), (1, 1), (2, 2), (9, 3), (24, 4), (30, 5), (18, 6)],
                        [(5, 0), (43, 1), (3, 2), (45, 3)])
ONE_DOC_PADDED_END = documents([(91, 0), (5, -1)], [(96, 0)])
PADDED_START = documents([(7, -1), (33, 0), (56, 1)], [(2, -1), (94, 0)])
DOCS_AND_PADDING = documents([(3, -1), (20, 0), (6, 1), (40, 2), (27, 3)],
                             [(11, 0), (37, 1), (46, 2), (2, -1)])


def mask_cases(cp: int) -> dict[str, tuple[torch.Tensor | None, bool, int | None]]:
    """name -> (document ids, is_causal, window)."""
    shard = SEQ // cp
    return {
        "docs causal": (RANDOM_DOCS, True, None),
        "docs non-causal": (RANDOM_DOCS, False, None),
        "one doc, padded end": (ONE_DOC_PADDED_END, True, None),
        "padded start, non-causal": (PADDED_START, False, None),
        "window < chunk": (None, True, 3),
        "window between shard and S": (None, True, shard + 5),
        "window > S": (None, True, SEQ + 10),
        "docs + padding + window": (DOCS_AND_PADDING, True, 10),
    }


def planned_bytes(document_ids, is_causal, window, cp, cp_rank, per_column: int) -> int:
    """What the plan says this CP rank sends forward: the key/value columns others need."""
    if window is not None and window >= SEQ:
        window = None
    if document_ids is None and window is None:
        return -1  # the Double-Ring's case, checked by test_attention_distributed
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long) if document_ids is None else document_ids
    serves = mask_plan(ids, is_causal, window, cp).serves(cp_rank)
    return per_column * sum(stop - start for ranges in serves.values() for start, stop in ranges)


def _check_config(hp, cp, placement, w):
    mesh = init_mesh(hp=hp, cp=cp, placement=placement, inner_ring=w)
    index = mesh_token_indices(SEQ, mesh)
    records = []
    heads = max(4, hp)
    cases = list(mask_cases(cp).items())
    for n, (name, (document_ids, is_causal, window)) in enumerate(cases):
        # MHA and GQA alternate over the cases (both for the first) to keep the spawn short
        for kv_heads in (heads, 2) if n == 0 else ((heads, 2)[n % 2],):
            gen = torch.Generator().manual_seed(100 * n + kv_heads)
            q, dout = (torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64)
                       for _ in range(2))
            k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=gen,
                                dtype=torch.float64) for _ in range(2))
            want = masked_reference(q, k, v, dout, document_ids, is_causal, window)
            dtypes = (torch.float64, torch.float32) if name == "docs + padding + window" \
                else (torch.float64,)
            for dtype in dtypes:
                local = [t[:, :, index].to(dtype).requires_grad_() for t in (q, k, v)]
                reset_comm_counters()
                out, lse = attention_2d(*local, is_causal=is_causal, return_lse=True,
                                        document_ids=document_ids, window=window,
                                        **mesh.attention_kwargs())
                sent = comm_counters()["p2p"]
                grads = torch.autograd.grad(out, local, dout[:, :, index].to(dtype))
                errors = {key: masked_relative_error(g, r[:, :, index]) for key, g, r in
                          zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want)}
                kv_width = max(kv_heads, hp) // hp
                per_column = 2 * BATCH * kv_width * HEAD_DIM * local[0].element_size()
                planned = planned_bytes(document_ids, is_causal, window, cp, mesh.cp_rank,
                                        per_column)
                label = (f"hp={hp} cp={cp} {placement} w={w} {name} H={heads} Hkv={kv_heads} "
                         f"{dtype}")
                records.append((label, dtype, errors, sent, planned))
    return records


def _document_ids_check(hp, cp, placement):
    """shard_batch's packed positions + padding mask -> sequence_document_ids == the ids."""
    mesh = init_mesh(hp=hp, cp=cp, placement=placement)
    ids = DOCS_AND_PADDING
    tokens = torch.arange(BATCH * SEQ).view(BATCH, SEQ)
    batch = shard_batch(tokens, None, mesh, document_ids=ids, attention_mask=(ids >= 0).long())
    got = sequence_document_ids(batch.position_ids, batch.attention_mask,
                                **mesh.document_kwargs())
    # renumber the runs of real tokens 0, 1, ... per row, padding -1
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    want = (starts.cumsum(1) - 1).masked_fill(ids < 0, -1)
    return torch.equal(got, want), got.tolist()


# balance_documents: documents, then right padding as the room for their pads (-1: padding)
BALANCED_DOCS = documents([(20, 0), (6, 1), (40, 2), (30, -1)], [(11, 0), (37, 1), (30, 2), (18, -1)])


def _balanced_check(hp, cp, placement):
    """shard_batch(balance_documents=True) on every rank -> sequence_document_ids reads one id
    per original document, gather_sequence undoes the order, and attention with a window on
    those ids equals one process with the same positions in the document."""
    mesh = init_mesh(hp=hp, cp=cp, placement=placement)
    real = BALANCED_DOCS >= 0
    tokens = torch.arange(BATCH * SEQ).view(BATCH, SEQ)
    batch = shard_batch(tokens, None, mesh, document_ids=BALANCED_DOCS.clamp(min=0),
                        attention_mask=real.long(), balance_documents=True)
    got = sequence_document_ids(batch.position_ids, None, **mesh.document_kwargs())
    back = gather_sequence(batch.input_ids, mesh, token_order=batch.token_order)
    found = {"restored": torch.equal(back[real], tokens[real]),
             "balanced": bool((got >= CHUNK_MAJOR).all())}
    for row in range(BATCH):
        kept = batch.token_order[row] >= 0
        pairs = set(zip(BALANCED_DOCS[row, batch.token_order[row, kept]].tolist(),
                        got[row, kept].tolist()))
        found[f"one id per document, row {row}"] = \
            len(pairs) == len({d for d, _ in pairs}) == len({i for _, i in pairs})
    positions = gather_sequence(batch.position_ids, mesh)
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(BATCH, 4, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64)
            for _ in range(4)]
    index = mesh_token_indices(SEQ, mesh)
    local = [t[:, :, index].contiguous().requires_grad_() for t in full[:3]]
    out = attention_2d(*local, is_causal=True, document_ids=got, window=5,
                       **mesh.attention_kwargs())
    grads = torch.autograd.grad(out, local, full[3][:, :, index])
    want_out, _, *want_grads = masked_reference(*full, got, True, 5, positions)
    errors = [masked_relative_error(g, w[:, :, index])
              for g, w in zip((out, *grads), (want_out, *want_grads))]
    found["exact"] = max(errors) <= TOLERANCE[torch.float64]
    return all(found.values()), (found, errors)


def _held_kv_buffers(hp, cp, placement):
    """The most received KV buffers alive at once in a forward + backward where every rank
    reads every other's keys (one document as long as the sequence)."""
    import weakref
    from unittest import mock

    from loong_compile.ops.attention import masked

    alive: list = []
    most = [0]

    class Tracked(masked.DirectExchange):
        def __init__(self, group_name, sends, receives, tag=0):
            super().__init__(group_name, sends, receives, tag)
            if tag == masked.KV_TAG:
                alive[:] = [r for r in alive if r() is not None]
                alive.extend(weakref.ref(t) for t in receives.values())
                most[0] = max(most[0], len(alive))

    mesh = init_mesh(hp=hp, cp=cp, placement=placement)
    gen = torch.Generator().manual_seed(7)
    local = [torch.randn(BATCH, max(4, hp), SEQ // (hp * cp), HEAD_DIM, generator=gen,
                         dtype=torch.float64).requires_grad_() for _ in range(3)]
    with mock.patch.object(masked, "DirectExchange", Tracked):
        out = attention_2d(*local, is_causal=False, document_ids=ONE_DOC_PADDED_END,
                           **mesh.attention_kwargs())
        torch.autograd.grad(out.sum(), local)
    return most[0]


def _suite(rank, world, configs):
    sections = Sections()
    for config in configs:
        sections.run(config, _check_config, *config)
    for hp, cp, placement, w in configs:
        if w == 1:
            sections.run(("documents", hp, cp, placement), _document_ids_check, hp, cp, placement)
            sections.run(("held", hp, cp, placement), _held_kv_buffers, hp, cp, placement)
            if cp > 1:
                sections.run(("balanced", hp, cp, placement), _balanced_check, hp, cp,
                             placement)
    return sections.results


def _assert_all(results, configs):
    checked = 0
    for config in configs:
        for rank, records in enumerate(section_results(results, config)):
            assert len(records) == len(mask_cases(config[1])) + 2
            for label, dtype, errors, sent, planned in records:
                worst = max(errors, key=errors.get)
                assert errors[worst] <= TOLERANCE[dtype], \
                    f"rank {rank} {label}: {worst} rel. error {errors[worst]:.3g}"
                if planned >= 0:
                    assert sent == planned, f"rank {rank} {label}: sent {sent}, plan {planned}"
                checked += 1
    for key in results[0]:
        if key[0] in ("documents", "balanced"):
            for rank, (equal, got) in enumerate(section_results(results, key)):
                assert equal, f"rank {rank} {key}: {got}"
        if key[0] == "held":  # at most two KV buffers received at once, as in the ring
            for rank, held in enumerate(section_results(results, key)):
                assert held <= 2, f"rank {rank} {key}: {held} received KV buffers alive at once"
    assert checked


@pytest.mark.slow
def test_masked_attention_matches_one_process_on_4_ranks():
    configs = mesh_configs(4)
    _assert_all(run_distributed(_suite, 4, configs, timeout=300), configs)


@pytest.mark.slow
def test_masked_attention_matches_one_process_on_8_ranks():
    configs = mesh_configs(8)
    _assert_all(run_distributed(_suite, 8, configs, timeout=500), configs)


def test_mesh_configs_cover_every_factorisation_and_both_ring_sizes():
    assert mesh_configs(4) == [(1, 4, "head_first", 1), (1, 4, "head_first", 2),
                               (2, 2, "head_first", 1), (2, 2, "head_first", 2),
                               (2, 2, "context_first", 1), (2, 2, "context_first", 2),
                               (4, 1, "head_first", 1)]
