"""The token layout: zigzag CP shards split over HP ranks, shifted labels, its checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loong_compile.parallel.tokens import (
    IGNORE_INDEX,
    PACKED,
    PADDED,
    SHIFTED,
    alive_with,
    check_sequence_length,
    gather_sequence,
    local_token_indices,
    made_with,
    mesh_token_indices,
    sequence_divisor,
    shard_batch,
    token_runs,
)
from loong_compile.errors import LoongShapeError
from loong_compile.parallel.mesh import LoongMesh, init_mesh, rank_layout

sizes = st.sampled_from([1, 2, 3, 4, 8])


@settings(max_examples=60, deadline=None)
@given(cp=sizes, hp=sizes, multiple=st.integers(1, 5))
def test_ranks_partition_the_sequence(cp, hp, multiple):
    seq = multiple * sequence_divisor(cp, hp)
    held = [local_token_indices(seq, cp, hp, c, h) for c in range(cp) for h in range(hp)]
    assert all(len(t) == seq // (cp * hp) for t in held)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))


@settings(max_examples=40, deadline=None)
@given(cp=sizes, hp=sizes, multiple=st.integers(1, 5))
def test_hp_group_concatenation_is_the_zigzag_cp_shard(cp, hp, multiple):
    """What the all-to-all gathers (HP pieces in HP order) is chunks c and 2cp-1-c, in order."""
    seq = multiple * sequence_divisor(cp, hp)
    chunk = seq // (2 * cp)
    for c in range(cp):
        shard = torch.cat([local_token_indices(seq, cp, hp, c, h) for h in range(hp)])
        if cp == 1:
            assert torch.equal(shard, torch.arange(seq))
        else:
            want = torch.cat([torch.arange(c * chunk, (c + 1) * chunk),
                              torch.arange((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)])
            assert torch.equal(shard, want)


@settings(max_examples=40, deadline=None)
@given(cp=sizes, hp=sizes, multiple=st.integers(1, 5))
def test_token_runs_are_the_local_tokens_as_maximal_runs(cp, hp, multiple):
    """What the scans read (ops/scans/exchange.py): a rank's tokens in local order, cut only
    where two neighbours in local order are not neighbours in the sequence."""
    seq = multiple * sequence_divisor(cp, hp)
    for c in range(cp):
        for h in range(hp):
            runs = token_runs(seq, cp, hp, c, h)
            assert torch.equal(torch.cat([torch.arange(first, first + n) for first, n in runs]),
                               local_token_indices(seq, cp, hp, c, h))
            assert all(a + n != b for (a, n), (b, _) in zip(runs, runs[1:])), runs


def test_zigzag_balances_causal_work():
    """Each CP shard's causal attention covers the same number of (query, key) pairs."""
    cp, seq = 4, 64
    work = [int((local_token_indices(seq, cp, 1, c, 0) + 1).sum()) for c in range(cp)]
    assert len(set(work)) == 1


def test_layout_picture_of_the_docstring():
    assert [local_token_indices(16, 2, 2, c, h).tolist() for c in range(2) for h in range(2)] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_sequence_length_must_divide():
    check_sequence_length(24, 2, 3)
    with pytest.raises(LoongShapeError, match="multiple of 2\\*cp\\*hp = 12"):
        check_sequence_length(18, 2, 3)
    with pytest.raises(LoongShapeError, match="fix: .* 24"):
        check_sequence_length(20, 2, 3)
    check_sequence_length(9, 1, 3)  # cp = 1: no zigzag, hp pieces only


def test_shard_batch_on_one_process_shifts_labels_globally():
    mesh = init_mesh()
    ids = torch.arange(20).reshape(2, 10)
    batch = shard_batch(ids, ids.clone(), mesh)
    assert torch.equal(batch.input_ids, ids)
    assert torch.equal(batch.position_ids, torch.arange(10).expand(2, 10))
    assert torch.equal(batch.labels[:, :-1], ids[:, 1:])
    assert (batch.labels[:, -1] == IGNORE_INDEX).all()
    assert torch.equal(gather_sequence(batch.input_ids, mesh), ids)
    assert shard_batch(ids, None, mesh).labels is None


def test_shard_batch_checks_shapes():
    mesh = init_mesh()
    with pytest.raises(LoongShapeError, match="2-D"):
        shard_batch(torch.zeros(8, dtype=torch.long), None, mesh)
    with pytest.raises(LoongShapeError, match="same shape"):
        shard_batch(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long), mesh)


@pytest.mark.parametrize("batch", [1, 2])
def test_shard_batch_outputs_have_one_memory_layout_on_every_rank(batch):
    """Dynamo guards on strides and storage offsets: ranks whose inputs differ there compile
    different graphs (a view at an HP rank's offset did, at batch size 1: issue 10, obs 7)."""
    layout = rank_layout(1, 2, 2, "head_first")
    ids = torch.arange(batch * 32).reshape(batch, 32)
    seen = set()
    for rank in range(4):
        mesh = LoongMesh(1, 2, 2, 1, "head_first", rank, layout, None, {}, {})
        packed = shard_batch(ids, ids, mesh, cu_seqlens=torch.tensor([0, 5, 32]),
                             attention_mask=torch.ones_like(ids))
        for t in (*shard_batch(ids, ids, mesh)[:3], *packed[:4]):
            assert t.is_contiguous() and t.storage_offset() == 0, (rank, t.stride(), t.storage_offset())
            seen.add((t.shape, t.stride()))
    assert len(seen) == 1


def test_num_labels_counts_the_whole_batch_on_every_rank():
    """What each rank divides its summed loss by (issue 22): the shifted labels of the whole
    batch that are not -100, one 0-dim tensor, the same on every rank."""
    layout = rank_layout(1, 2, 2, "head_first")
    ids = torch.arange(2 * 32).reshape(2, 32)
    labels = ids.masked_fill(ids % 5 == 0, -100)
    want = int((torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1) != -100).sum())
    for rank in range(4):
        mesh = LoongMesh(1, 2, 2, 1, "head_first", rank, layout, None, {}, {})
        num = shard_batch(ids, labels, mesh).num_labels
        assert num.dim() == 0 and num.dtype == torch.int64 and int(num) == want < 2 * 31


def _four_rank_meshes():
    layout = rank_layout(1, 2, 2, "context_first")
    return [LoongMesh(1, 2, 2, 1, "context_first", rank, layout, None, {}, {}) for rank in range(4)]


def test_shard_batch_packed_positions_restart_at_every_document():
    """document_ids, cu_seqlens over S and over B*S name the same documents: each rank gets the
    positions-within-document of the tokens the layout gives it, and the padding mask's."""
    ids = torch.arange(2 * 16).reshape(2, 16)
    documents = torch.tensor([[0] * 3 + [1] * 8 + [2] * 5, [7] * 3 + [8] * 8 + [9] * 5])
    packed = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]).expand(2, 16)
    padding = (torch.arange(16) < 13).long().expand(2, 16)
    for mesh in _four_rank_meshes():
        index = mesh_token_indices(16, mesh)
        forms = [{"document_ids": documents}, {"cu_seqlens": torch.tensor([0, 3, 11, 16])},
                 {"cu_seqlens": torch.tensor([0, 3, 11, 16, 19, 27, 32])}]
        for form in forms:
            batch = shard_batch(ids, ids, mesh, attention_mask=padding, **form)
            assert torch.equal(batch.position_ids, packed[:, index]), form
            assert torch.equal(batch.input_ids, ids[:, index])
            assert torch.equal(batch.attention_mask, padding[:, index])
            want_labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)[:, index]
            assert torch.equal(batch.labels, want_labels)
        assert shard_batch(ids, None, mesh).attention_mask is None


def test_shard_batch_remembers_what_its_values_do_not_show():
    """What the input checks ask of a tensor a compiled graph receives, told by the tensor (or a
    view of it), not its values: input ids cut from documents that start inside a row (the
    layout's order and the balanced order; not one document per row), of rows with padding, and
    labels shifted over the sequence; not a copy, not another output, not once the batch is gone."""
    ids = torch.arange(2 * 16).reshape(2, 16)
    one_per_row = torch.tensor([[0] * 16, [1] * 16])
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, -3:] = 0
    for mesh in _four_rank_meshes():
        packed = shard_batch(ids, ids, mesh, cu_seqlens=torch.tensor([0, 3, 11, 16]))
        balanced = shard_batch(ids, ids, mesh, document_ids=torch.tensor([[0] * 8 + [1] * 8] * 2),
                               balance_documents=True)
        plain = shard_batch(ids, ids, mesh)
        padded = shard_batch(ids, ids, mesh, attention_mask=padding)
        assert made_with(packed.input_ids, PACKED) and made_with(balanced.input_ids, PACKED)
        assert made_with(packed.input_ids[:, 1:], PACKED)   # a view
        assert not made_with(packed.input_ids.clone(), PACKED)
        assert not made_with(packed.position_ids, PACKED)
        assert not made_with(plain.input_ids, PACKED) and not made_with(plain.input_ids, PADDED)
        assert not made_with(shard_batch(ids, ids, mesh, document_ids=one_per_row).input_ids,
                             PACKED)
        assert made_with(padded.input_ids, PADDED) and not made_with(padded.input_ids, PACKED)
        assert not made_with(shard_batch(ids, ids, mesh, attention_mask=torch.ones_like(ids)
                                         ).input_ids, PADDED)
        assert made_with(plain.labels, SHIFTED) and made_with(plain.labels.view(-1), SHIFTED)
        assert not made_with(plain.input_ids, SHIFTED) and not made_with(ids, SHIFTED)
        assert alive_with(PACKED) and alive_with(PADDED)
        del packed, balanced, padded
        assert not alive_with(PACKED) and not alive_with(PADDED)


@pytest.mark.parametrize("kwargs,what", [
    ({"document_ids": torch.zeros(2, 16, dtype=torch.long),
      "cu_seqlens": torch.tensor([0, 16])}, "both"),
    ({"document_ids": torch.zeros(2, 15, dtype=torch.long)}, "document_ids of shape"),
    ({"document_ids": torch.zeros(2, 16)}, "dtype torch.float32"),
    ({"cu_seqlens": torch.tensor([0, 5, 15])}, "[0, 5, 15]"),
    ({"cu_seqlens": torch.tensor([1, 5, 16])}, "[1, 5, 16]"),
    ({"cu_seqlens": torch.tensor([0, 5, 5, 16])}, "[0, 5, 5, 16]"),
    ({"cu_seqlens": torch.tensor([0, 20, 32])}, "[0, 20, 32]"),  # crosses the row end 16
    ({"cu_seqlens": torch.tensor([[0, 16]])}, "(1, 2)"),
    ({"attention_mask": torch.ones(2, 8)}, "attention_mask of shape"),
])
def test_shard_batch_refuses_bad_documents(kwargs, what):
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(LoongShapeError, match="fix:") as error:
        shard_batch(ids, None, init_mesh(), **kwargs)
    assert what in str(error.value)
