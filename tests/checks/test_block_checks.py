"""Blocks compiled on their own, by hand (issue 51): exact where a block sees what it needs,
refused by name on every rank where it cannot (``loong_compile/checks/blocks.py``).

``model.model.layers[i].compile(backend="loong", ...)``: transformers builds the masks and the
loss outside the blocks, eagerly, from each rank's own tokens.  Plain rows need no mask and are
exact, the loss computed over the whole sequence (here by the test, and by transformers given
``shift_labels=`` and the sequence's count); a batch of packed documents or of padded rows would
give a rank without a document start, or without a padded token, plain causal attention across
the sequence's documents or onto its padding, and ``labels=`` would be shifted and averaged
within each rank -- refused on both ranks, before the blocks' first collective.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from helpers import error_of
from trust_cases import Case, case_model, label_count, packed_documents, padding_mask, summed_loss, token_ids
from trust_reference import reference, relative_error, tolerance

pytestmark = pytest.mark.multirank

PLAIN = Case("llama")


def _blocks_compiled(case: Case, hp: int, cp: int) -> torch.nn.Module:
    import loong_compile as lc

    model = case_model(case, torch.float64)
    for layer in model.model.layers:
        layer.compile(backend=lc.LoongBackend({"hp": hp, "cp": cp, "lowering": "aot_eager",
                                               "rank_check_timeout": 60}))
    return model


def _summed(loss: torch.Tensor, model: torch.nn.Module) -> tuple[float, dict]:
    """The loss and the gradients, summed over the ranks."""
    import torch.distributed as dist

    loss = loss.detach()
    dist.all_reduce(loss)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)
    return loss.item(), {k: v.numpy() for k, v in grads.items()}


def _per_block(rank: int, world: int) -> dict:
    import loong_compile as lc

    mesh = lc.init_mesh(hp=1, cp=world)
    ids = token_ids()
    out = {}
    model = _blocks_compiled(PLAIN, 1, world)
    batch = lc.shard_batch(ids, ids, mesh)
    loss = summed_loss(model(batch.input_ids, position_ids=batch.position_ids).logits,
                       batch.labels, label_count())
    loss.backward()
    out["plain"] = _summed(loss, model)
    # transformers' loss around the blocks, eager on this rank's tokens: from labels= refused;
    # from shift_labels= with the sequence's count (the documented fix), exact
    out["labels"] = error_of(partial(model, batch.input_ids, position_ids=batch.position_ids,
                                     labels=batch.input_ids))
    model.zero_grad()
    loss = model(batch.input_ids, position_ids=batch.position_ids, labels=batch.labels,
                 shift_labels=batch.labels, num_items_in_batch=batch.num_labels).loss
    loss.backward()
    out["shift_labels"] = _summed(loss, model)
    del batch
    # the rule as the check applies it: blocks called while a batch of packed documents is
    # alive are refused on every rank, whatever they are given (the documented false positive)
    torch._dynamo.reset()
    model = _blocks_compiled(PLAIN, 1, world)
    kept = lc.shard_batch(ids, ids, mesh, document_ids=packed_documents())
    plain = lc.shard_batch(ids, ids, mesh)
    out["plain_beside_packed"] = error_of(partial(model, plain.input_ids,
                                                  position_ids=plain.position_ids))
    del kept, plain
    # documents whose only start (token 4) lies on rank 0: rank 1 builds no mask
    one_start = torch.tensor([[0] * 4 + [1] * (ids.size(1) - 4)] * ids.size(0))
    for habit, cut, kwargs in (
            ("packed", {"document_ids": packed_documents()}, {"use_cache": False}),
            ("packed_one_start", {"document_ids": one_start}, {"use_cache": False}),
            # the cache on (transformers then reads no documents from the positions)
            ("packed_no_mask", {"document_ids": packed_documents()}, {}),
            ("padding", {"attention_mask": padding_mask()}, {})):
        # each a first step: every rank compiles its blocks for it (a rank that reuses a graph
        # compiled for another batch skips the compile check that tells it another rank refused)
        torch._dynamo.reset()
        model = _blocks_compiled(PLAIN, 1, world)
        batch = lc.shard_batch(ids, ids, mesh, **cut)
        kwargs = {"position_ids": batch.position_ids, **kwargs}
        if batch.attention_mask is not None:
            kwargs["attention_mask"] = batch.attention_mask
        out[habit] = error_of(partial(model, batch.input_ids, **kwargs))
        del batch
    return out


@pytest.mark.timeout(300)
def test_hand_compiled_blocks_are_exact_on_plain_rows_and_refuse_what_they_cannot_see():
    from loong_compile.testing import run_distributed

    results = run_distributed(_per_block, 2, timeout=240)
    assert relative_error(results[0]["plain"], reference(PLAIN)) <= tolerance(PLAIN)
    shift = Case("llama", habit="shift_labels")
    assert relative_error(results[0]["shift_labels"], reference(shift)) <= tolerance(shift)
    # a mask transformers built outside reaches the block, which cannot prove it: the attention
    # pass refuses it (where a rank has none, the compile check refuses on every rank); no mask
    # on any rank: nothing in the block tells it the batch
    built_outside = ("LoongUnsupportedError", ["cannot be distributed exactly", "attention_mask"])
    # ... or, on whichever rank's compile check sees it first, the ranks' graphs differ
    mismatch = ("LoongRankMismatchError", ["rank"])
    blind = ("LoongUnsupportedError", ["receives nothing of the batch", "packed documents",
                                       "compile the whole model"])
    eager_loss = ("LoongShapeError", ["LlamaForCausalLM.forward(labels=...)", "compile_blocks",
                                      "shift_labels=batch.labels", "lc.next_token_loss"])
    for habit, allowed in (("labels", [eager_loss]), ("packed", [built_outside]), ("padding", [built_outside, mismatch]),
                           ("packed_one_start", [built_outside, mismatch]),
                           ("packed_no_mask", [blind, mismatch]),
                           ("plain_beside_packed", [blind])):
        for rank, verdict in enumerate(result[habit] for result in results):
            assert any(verdict.startswith(error + ":") and all(w in verdict for w in words)
                       for error, words in allowed), f"{habit} on rank {rank}: {verdict}"
