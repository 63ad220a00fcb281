"""The balanced document order (shard_batch(balance_documents=True)): what each rank holds, how
sequence_document_ids reads it back, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loong_compile.errors import LoongShapeError
from loong_compile.ops.masks.documents import number_documents
from loong_compile.ops.masks.blocks import CHUNK_MAJOR, UNREADABLE, mask_plan, mask_positions
from loong_compile.ops.masks.step import StepMask
from loong_compile.parallel.balance import restore
from loong_compile.parallel.mesh import LoongMesh, rank_layout
from loong_compile.parallel.tokens import IGNORE_INDEX, mesh_token_indices, shard_batch

SEQ, CP = 32, 2
# row 0: documents of 3, 9 and 12 tokens, then 8 of right padding (room for the pads);
# row 1: one of 10, one of 14
DOCUMENTS = [[3, 9, 12], [10, 14]]


def _meshes(hp: int = 1):
    layout = rank_layout(1, CP, hp, "head_first")
    return [LoongMesh(1, hp, CP, 1, "head_first", rank, layout, None, {}, {})
            for rank in range(CP * hp)]


def _batch():
    ids = torch.arange(100, 100 + 2 * SEQ).reshape(2, SEQ)
    documents = torch.full((2, SEQ), 99)
    real = torch.zeros(2, SEQ, dtype=torch.long)
    for row, lengths in enumerate(DOCUMENTS):
        documents[row, :sum(lengths)] = torch.repeat_interleave(torch.arange(len(lengths)),
                                                                torch.tensor(lengths))
        real[row, :sum(lengths)] = 1
    return ids, documents, real


def _whole(meshes, field):
    """The balanced rows, from every rank's share."""
    full = torch.empty(2, SEQ, dtype=torch.long)
    for mesh in meshes:
        batch = shard_batch(*_args(), mesh, **_kwargs())
        full[:, mesh_token_indices(SEQ, mesh)] = getattr(batch, field)
    return full


def _args():
    ids, _, real = _batch()
    return ids, ids.masked_fill(real == 0, IGNORE_INDEX)


def _kwargs():
    _, documents, real = _batch()
    return {"document_ids": documents, "attention_mask": real, "balance_documents": True,
            "pad_token_id": 7}


@pytest.mark.parametrize("hp", [1, 2])
def test_every_document_is_dealt_head_and_tail(hp):
    """Chunk k of the row holds chunk k of every document (padded to a multiple of 2·cp with
    pad tokens continuing its positions), so CP rank c holds chunks c and 2cp-1-c of each."""
    meshes = _meshes(hp)
    positions, tokens = _whole(meshes, "position_ids"), _whole(meshes, "input_ids")
    labels = _whole(meshes, "labels")
    chunk = SEQ // (2 * CP)
    ids, unshifted = _args()
    for row, lengths in enumerate(DOCUMENTS):
        padded = [-(-n // (2 * CP)) for n in lengths]   # tokens per chunk
        filler = chunk - sum(padded)
        per_chunk = padded + ([filler] if filler else [])
        sizes = lengths + ([0] if filler else [])
        starts = np.r_[0, np.cumsum(lengths)]
        for k in range(2 * CP):
            at = k * chunk
            for doc, (c, n) in enumerate(zip(per_chunk, sizes)):
                got = positions[row, at:at + c].tolist()
                assert got == list(range(k * c, (k + 1) * c)), (row, k, doc)
                for place, pos in zip(range(at, at + c), got):
                    if pos < n:  # a real token: its own id and its next token's label
                        source = int(starts[doc]) + pos
                        assert tokens[row, place] == ids[row, source]
                        want = unshifted[row, source + 1] if source + 1 < SEQ else IGNORE_INDEX
                        assert labels[row, place] == want
                    else:
                        assert tokens[row, place] == 7 and labels[row, place] == IGNORE_INDEX
                at += c
    batch = shard_batch(*_args(), meshes[0], **_kwargs())
    assert batch.attention_mask is None
    assert int(batch.num_labels) == int((_args()[1][:, 1:] != IGNORE_INDEX).sum())


def test_token_order_restores_the_original_rows():
    meshes = _meshes()
    order = shard_batch(*_args(), meshes[0], **_kwargs()).token_order
    ids, _, real = _batch()
    back = restore(_whole(meshes, "input_ids"), order)
    assert torch.equal(back[real == 1], ids[real == 1])
    assert (back[real == 0] == 0).all()


def test_sequence_document_ids_reads_the_balanced_order_back():
    """From the gathered positions alone: the ids of each original document, numbered from
    CHUNK_MAJOR; the step's mask then compares positions in the document."""
    meshes = _meshes()
    positions = _whole(meshes, "position_ids")
    ids = number_documents(positions, None, 1, CP)
    order = shard_batch(*_args(), meshes[0], **_kwargs()).token_order
    _, documents, _ = _batch()
    assert (ids >= CHUNK_MAJOR).all()
    for row in range(2):
        real = order[row] >= 0
        # one id per original document, different documents different ids
        pairs = set(zip(documents[row, order[row, real]].tolist(), ids[row, real].tolist()))
        assert len(pairs) == len({d for d, _ in pairs}) == len({i for _, i in pairs})
    assert np.array_equal(mask_positions(ids.numpy()), positions.numpy())


def test_plain_and_one_document_rows_keep_their_reading():
    """Contiguous packed positions are read as before; one document is the same either way."""
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4] * 4])
    ids = number_documents(packed, None, 1, CP)
    assert (ids < CHUNK_MAJOR).all() and ids.max() == 7
    plain = torch.arange(SEQ).unsqueeze(0)
    assert torch.equal(number_documents(plain, None, 1, CP), torch.zeros(1, SEQ, dtype=torch.long))


def test_positions_that_fit_no_order_are_refused_by_the_step_mask():
    """Neither packed nor balanced (a document restarting at 5): UNREADABLE in the ids, then a
    named error from the plan, on the host, before any attention runs."""
    bad = torch.tensor([[0, 1, 2, 5, 6, 7, 8, 9] * 4])
    ids = number_documents(bad, None, 1, CP)
    assert (ids == UNREADABLE).all()
    with pytest.raises(LoongShapeError, match="balanced order.*fix:"):
        StepMask(ids, SEQ, True, None, 1, "")  # one CP rank: no process group needed
    # the plan alone treats them as padding: the refusal is the step mask's
    assert mask_plan(ids, True, None, CP).ranks[0].blocks == ()


@pytest.mark.parametrize("change,what", [
    ({"attention_mask": (torch.arange(SEQ) >= 4).long().expand(2, SEQ)}, "right padding"),
    ({"attention_mask": None}, "need 36"),
])
def test_refusals(change, what):
    kwargs = {**_kwargs(), **change}
    with pytest.raises(LoongShapeError, match="fix:") as error:
        shard_batch(*_args(), _meshes()[0], **kwargs)
    assert what in str(error.value)
