"""Masked attention without processes: the plan, the kernel's empty-row contract, one-process
``attention_2d`` with masks (eager and compiled) and its refusals."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import allowed_pairs, masked_reference, masked_relative_error
from loong_compile.parallel.tokens import local_token_indices, packed_positions
from loong_compile.errors import LoongShapeError
from loong_compile.ops import attention_2d, sequence_document_ids
from loong_compile.ops.attention.kernels import _math_backward, _math_forward, attention_backward, \
    attention_forward
from loong_compile.ops.masks.documents import number_documents
from loong_compile.ops.masks.blocks import CHUNK_MAJOR, TILES_PER_CHUNK, mask_plan, tile_edges
from loong_compile.parallel.balance import balanced_order


def random_documents(gen: torch.Generator, batch: int, seq: int, pad_start: int,
                     pad_end: int) -> torch.Tensor:
    """Contiguous documents of random lengths (some of 1 token), padding (-1) at either end."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=gen)[:int(torch.randint(0, 8, (1,), generator=gen))]
        starts = torch.zeros(seq, dtype=torch.long)
        starts[cuts + 1] = 1
        ids = starts.cumsum(0)
        ids[:pad_start] = -1
        ids[seq - pad_end:] = -1
        rows.append(ids)
    return torch.stack(rows)


PLAN_CASES = [  # (cp, seq, is_causal, window, pad_start, pad_end, seed), 4 tiles per chunk
    (1, 40, True, None, 0, 0, 0), (2, 48, True, 5, 3, 0, 1), (2, 48, False, None, 0, 7, 2),
    (4, 64, True, None, 5, 5, 3), (4, 64, True, 9, 0, 0, 4), (4, 64, True, 30, 0, 2, 5),
    (8, 96, True, 4, 0, 0, 6), (8, 96, False, None, 11, 0, 7), (8, 96, True, 13, 2, 3, 8),
]


@pytest.mark.parametrize("cp,seq,is_causal,window,pad_start,pad_end,seed", PLAN_CASES)
def test_plan_computes_exactly_the_blocks_with_allowed_pairs(cp, seq, is_causal, window,
                                                             pad_start, pad_end, seed):
    """Brute force over every (query tile, key tile): a block exists iff some pair is allowed
    there, its crop holds every allowed pair, no pair is covered twice, and a rank receives
    exactly the columns its blocks read."""
    gen = torch.Generator().manual_seed(seed)
    ids = random_documents(gen, 2, seq, pad_start, pad_end)
    check_plan(ids, allowed_pairs(ids, is_causal, window), is_causal, window, cp)


BALANCED_CASES = [  # (cp, seq, window, seed): causal, documents in the balanced order
    (2, 48, None, 0), (2, 64, 5, 1), (4, 96, None, 2), (4, 96, 9, 3), (8, 256, None, 4),
    (8, 256, 20, 5),
]


@pytest.mark.parametrize("cp,seq,window,seed", BALANCED_CASES)
def test_plan_of_balanced_documents_computes_exactly_the_blocks_with_allowed_pairs(
        cp, seq, window, seed):
    """The same brute force for rows in shard_batch's balanced order, their ids as
    sequence_document_ids numbers them from the positions: the rule compares positions in the
    document, which balance.py gives independently of the plan."""
    gen = torch.Generator().manual_seed(seed)
    starts = random_documents(gen, 2, seq, 0, 0).diff(dim=1, prepend=torch.full((2, 1), -1)) != 0
    used = seq - 2 * cp * 8  # room for up to 8 documents' pads
    real = (torch.arange(seq) < used).expand(2, seq)
    order = balanced_order(starts & real, real, cp)
    ids = number_documents(order.positions, None, 1, cp)
    assert (ids >= CHUNK_MAJOR).all(1).any(), "no row in the balanced order: nothing tested"
    check_plan(ids, allowed_pairs(ids, True, window, order.positions), True, window, cp)


def check_plan(ids, allowed_each, is_causal, window, cp):
    seq = ids.size(1)
    allowed = allowed_each.any(0)  # the batch union
    plan = mask_plan(ids, is_causal, window, cp, TILES_PER_CHUNK)
    positions = [local_token_indices(seq, cp, 1, r, 0) for r in range(cp)]
    edges = list(plan.edges)
    if not (ids >= CHUNK_MAJOR).any():
        assert edges == tile_edges(seq, cp, TILES_PER_CHUNK)
    tile_of = torch.bucketize(torch.arange(seq), torch.tensor(edges), right=True) - 1
    covered = torch.zeros(seq, seq, dtype=torch.long)
    blocks_per_tile_pair = torch.zeros(len(edges) - 1, len(edges) - 1, dtype=torch.long)
    for rank, rank_plan in enumerate(plan.ranks):
        assert rank_plan.blocks == tuple(sorted(rank_plan.blocks, key=lambda b: (b.owner - rank) % cp))
        for block in rank_plan.blocks:
            rows = positions[rank][slice(*block.rows)]
            cols = positions[block.owner][slice(*block.cols)]
            assert allowed[rows][:, cols].any(), f"rank {rank}: block {block} has no allowed pair"
            # contiguous documents: full exactly when every pair is allowed in every batch row
            assert block.full == bool(allowed_each[:, rows][:, :, cols].all()), (rank, block)
            covered[rows.unsqueeze(1), cols.unsqueeze(0)] += 1
            q_tiles, k_tiles = tile_of[rows].unique(), tile_of[cols].unique()
            assert len(q_tiles) == len(k_tiles) == 1, "a block stays inside one tile pair"
            blocks_per_tile_pair[q_tiles[0], k_tiles[0]] += 1
            if block.owner != rank:
                assert any(start <= block.cols[0] and block.cols[1] <= stop
                           for start, stop in rank_plan.needs[block.owner])
        for owner, ranges in rank_plan.needs.items():
            assert owner != rank and plan.serves(owner)[rank] == ranges
            read = torch.zeros(seq // cp, dtype=torch.bool)
            for block in rank_plan.blocks:
                if block.owner == owner:
                    read[slice(*block.cols)] = True
            # each range is spanned by the columns read in it: ends are read, nothing outside
            received = torch.zeros_like(read)
            for start, stop in ranges:
                received[start:stop] = True
                assert read[start] and read[stop - 1]
            assert not (read & ~received).any()
    assert covered[allowed].min() == 1, "an allowed pair lies in no block"
    assert covered.max() <= 1, "a pair lies in two blocks (it would be counted twice)"
    tile_pairs_allowed = torch.zeros_like(blocks_per_tile_pair, dtype=torch.bool)
    tile_pairs_allowed[tile_of.unsqueeze(1).expand(seq, seq)[allowed],
                       tile_of.unsqueeze(0).expand(seq, seq)[allowed]] = True
    assert torch.equal(blocks_per_tile_pair.bool(), tile_pairs_allowed)


def test_plan_of_a_window_reads_only_the_previous_chunk():
    """cp=4, window = one chunk: a rank needs at most its chunks' predecessors, never all."""
    seq, cp = 64, 4
    plan = mask_plan(torch.zeros(1, seq, dtype=torch.long), True, seq // (2 * cp), cp)
    for rank, rank_plan in enumerate(plan.ranks):
        # chunk r needs chunk r-1 (rank r-1); chunk 2cp-1-r needs chunk 2cp-2-r (rank r+1)
        assert set(rank_plan.needs) == {r for r in (rank - 1, rank + 1) if 0 <= r < cp}


MASKED_KERNELS = {"adapter": (attention_forward, attention_backward), "math": (
    lambda q, k, v, *, is_causal, scale, mask: _math_forward(q, k, v, mask, scale),
    lambda dout, q, k, v, out, lse, *, is_causal, scale, mask: _math_backward(
        dout, q, k, v, out, lse.masked_fill(torch.isinf(lse), 0.0), mask, scale))}


@pytest.mark.parametrize("kernel", sorted(MASKED_KERNELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("v_head_dim", [8, 12])  # V's own head dim (MLA)
def test_masked_kernel_gives_zero_output_and_minus_inf_lse_for_empty_rows(kernel, dtype,
                                                                          v_head_dim):
    forward, backward = MASKED_KERNELS[kernel]
    gen = torch.Generator().manual_seed(0)
    q, dout, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
                     for shape in ((2, 4, 6, 8), (2, 4, 6, v_head_dim), (2, 2, 5, 8),
                                   (2, 2, 5, v_head_dim)))
    mask = torch.rand(2, 1, 6, 5, generator=gen) < 0.6
    mask[0, 0, 1] = False   # rows that see nothing
    mask[1, 0, 4] = False
    out, lse = forward(q, k, v, is_causal=False, scale=0.3, mask=mask)
    grads = backward(dout, q, k, v, out, lse, is_causal=False, scale=0.3, mask=mask)
    empty = ~mask.any(-1).expand(2, 4, 6)
    assert [t.shape for t in (out, *grads)] == [dout.shape, q.shape, k.shape, v.shape]
    assert torch.isinf(lse[empty]).all() and (lse[empty] < 0).all()
    assert (out[empty] == 0).all() and (grads[0][empty] == 0).all()
    assert all(torch.isfinite(g).all() for g in (out, *grads))
    # the rows that see keys: the masked softmax
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    want = torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1)
    assert masked_relative_error(lse, want) <= {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("is_causal,window", [(True, None), (False, None), (True, 5), (True, 99)])
def test_one_process_masked_attention_equals_the_reference(compiled, is_causal, window):
    gen = torch.Generator().manual_seed(3)
    ids = random_documents(gen, 2, 24, 2, 3)
    q, dout = (torch.randn(2, 4, 24, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 24, 8, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    q.requires_grad_()

    def attend(q, k, v, position_ids, padding):
        # as the attention pass emits it: the ids from the positions, inside the graph
        ids = sequence_document_ids(position_ids, padding, hp=1, cp=1)
        return attention_2d(q, k, v, is_causal=is_causal, document_ids=ids, window=window,
                            return_lse=True)

    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    fn = torch.compile(attend, backend="aot_eager", fullgraph=True) if compiled else attend
    out, lse = fn(q, k, v, packed_positions(starts), (ids >= 0).long())
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = masked_reference(q, k, v, dout, ids, is_causal, window)
    for got, ref in zip((out, lse, *grads), want):
        assert masked_relative_error(got, ref) <= 1e-12


@pytest.mark.parametrize("is_causal", [True, False])
def test_one_document_a_row_on_one_rank_is_one_kernel_call(is_causal):
    """What the attention pass makes of a mask of padding alone on one rank (issue 36): with no
    pad and no window in the step's ids, the masked op computes the whole row in one kernel
    call (``StepMask.whole``), equal to the reference; a pad, a second document or a window
    keep the blocks."""
    from loong_compile.ops.masks.step import StepMask

    gen = torch.Generator().manual_seed(5)
    ids = torch.zeros(2, 24, dtype=torch.long)
    q, dout = (torch.randn(2, 4, 24, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 24, 8, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    q.requires_grad_()
    assert StepMask(ids, 24, is_causal, None, 1, "").whole
    padded, two = ids.clone(), ids.clone()
    padded[1, :3], two[0, 10:] = -1, 1
    assert not StepMask(padded, 24, is_causal, None, 1, "").whole
    assert not StepMask(two, 24, is_causal, None, 1, "").whole
    assert not StepMask(ids, 24, True, 5, 1, "").whole
    out, lse = attention_2d(q, k, v, is_causal=is_causal, document_ids=ids, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = masked_reference(q, k, v, dout, ids, is_causal, None)
    for got, ref in zip((out, lse, *grads), want):
        assert masked_relative_error(got, ref) <= 1e-12


@pytest.mark.parametrize("kwargs,what", [
    ({"is_causal": False, "window": 4}, "is_causal=False"),
    ({"is_causal": True, "window": 0}, "window=0"),
    ({"is_causal": True, "document_ids": torch.zeros(2, 23, dtype=torch.long)}, "(2, 23)"),
    ({"is_causal": True, "document_ids": torch.zeros(2, 24)}, "torch.float32"),
])
def test_bad_masks_are_refused(kwargs, what):
    q = torch.randn(2, 4, 24, 8)
    with pytest.raises(LoongShapeError, match="fix:") as error:
        attention_2d(q, q, q, **kwargs)
    assert what in str(error.value)


@pytest.mark.parametrize("v_head_dim", [8, 12])  # V's own head dim (MLA)
@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "one_document_a_row"])
def test_opcheck_masked_ops_and_document_ids_on_one_process(v_head_dim, whole):
    """Fake kernels, schemas and autograd registration of the masked ops, the step's plan and the
    document ids (cp = hp = 1: no group), over blocks and in one call (``StepMask.whole``)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.zeros(2, 16, dtype=torch.long) if whole else random_documents(gen, 2, 16, 1, 2)
    window = 0 if whole else 5
    q, k, v, dout = (torch.randn(2, 2, 16, d, generator=gen, dtype=torch.float64)
                     for d in (8, 8, v_head_dim, v_head_dim))
    handle = torch.ops.loong.masked_attention_plan(ids, 16, True, window, 1, "")
    args = (ids, handle, True, window, 0.3, 1, "")
    out, lse = torch.ops.loong.masked_attention_fwd(q, k, v, *args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    checks = {
        "fwd": (torch.ops.loong.masked_attention_fwd, (*leaves, *args)),
        "bwd": (torch.ops.loong.masked_attention_bwd, (dout, q, k, v, out, lse, *args)),
        "plan": (torch.ops.loong.masked_attention_plan, (ids, 16, True, window, 1, "")),
        "document_ids": (torch.ops.loong.sequence_document_ids,
                         (torch.arange(16).remainder(5).expand(2, 16), (ids >= 0).long(),
                          1, 1, "", "", "")),
    }
    for name, (op, op_args) in checks.items():
        outcome = torch.library.opcheck(op, op_args)
        assert all(result == "SUCCESS" for result in outcome.values()), (name, outcome)


def test_sequence_document_ids_on_one_process_numbers_runs_and_marks_padding():
    """transformers' rule: a document starts wherever position[t] != position[t-1] + 1."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [5, 6, 7, 8, 0, 1, 2, 3, 4, 5]])
    padding = torch.tensor([[1] * 10, [0, 0] + [1] * 8])
    got = sequence_document_ids(positions, padding, hp=1, cp=1)
    assert got.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [-1, -1, 0, 0, 1, 1, 1, 1, 1, 1]]
    assert sequence_document_ids(positions, hp=1, cp=1)[1].tolist() == [0] * 4 + [1] * 6


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_chunked_document_ids_are_transformers_chunked_mask(packed):
    """Same ids and causal order = transformers' chunked mask of the whole sequence (Llama 4):
    blocks of the chunk by token index, or from each document's start when packed."""
    import transformers.masking_utils as masking
    from transformers import Llama4TextConfig

    from loong_compile.ops.masks.documents import chunked_document_ids, number_documents

    seq, chunk = 40, 6
    positions = (torch.cat([torch.arange(n) for n in (13, 4, 9, 14)]) if packed
                 else torch.arange(seq))[None]
    config = Llama4TextConfig(hidden_size=16, num_attention_heads=2, attention_chunk_size=chunk,
                              attn_implementation="sdpa")
    want = masking.create_chunked_causal_mask(
        config=config, inputs_embeds=torch.zeros(1, seq, 16), attention_mask=None, cache=None,
        position_ids=positions, allow_is_causal_skip=False)[0, 0]
    documents = number_documents(positions, None, 1, 1) if packed else None
    ids = chunked_document_ids(documents, chunk=chunk, batch=1, seq_len=seq)[0]
    got = (ids[:, None] == ids[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    assert torch.equal(got, want)
