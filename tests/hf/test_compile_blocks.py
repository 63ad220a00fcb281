"""``lc.hf.compile_blocks``: a model compiled block by block equals one process (issue 51).

Four gloo ranks at hp=2 x cp=2, float64, against one process on the whole sequence
(``trust_reference.reference``): the habits that are silently wrong, or refused, when blocks
are compiled by hand -- ``labels=`` (the loss in the head's graph, shifted over the whole
sequence), packed documents and padded rows (the masks built inside the blocks), a window
shorter than a rank's share, Gemma 3's local and global layers -- under ``aot_eager``, and the
Gemma 3 and padded cells again under Inductor with ``sc++`` and ``memo``.  One spawn runs every
cell, the references computed here meanwhile.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from trust_cases import (WINDOW_SHARD, Case, case_model, label_count, packed_documents,
                         padding_mask, shifted, summed_loss, token_ids)
from trust_reference import INDUCTOR_TOLERANCE, reference, relative_error, tolerance

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]
pytest.importorskip("transformers")

INDUCTOR = {"lowering": "inductor", "inductor_options": {"cpp.simdlen": 1}}
CELLS = [
    (Case("llama", habit="labels"), {"lowering": "aot_eager"}),
    (Case("qwen2", habit="padding"), {"lowering": "aot_eager"}),
    (Case("mistral", window=WINDOW_SHARD, habit="packed_use_cache_false"), {"lowering": "aot_eager"}),
    (Case("gemma3", window=WINDOW_SHARD, habit="packed_use_cache_false"),
     {**INDUCTOR, "activations": "sc++"}),
    (Case("qwen2", habit="padding"), {**INDUCTOR, "activations": "memo", "alpha": 1.0}),
]


def _cell(case: Case, options: dict, mesh) -> tuple[float, dict]:
    import torch.distributed as dist

    import loong_compile as lc
    from loong_compile.parallel.tokens import mesh_token_indices

    torch._dynamo.reset()
    model = lc.hf.compile_blocks(case_model(case, torch.float64), hp=2, cp=2,
                                 rank_check_timeout=60, **options)
    ids = token_ids()
    packed = case.habit.startswith("packed")
    batch = lc.shard_batch(ids, ids, mesh, document_ids=packed_documents() if packed else None)
    kwargs = {"position_ids": batch.position_ids, **({"use_cache": False} if packed else {})}
    labels, count = batch.labels, label_count()
    if case.habit == "padding":
        index = mesh_token_indices(ids.size(1), mesh)
        kwargs["attention_mask"] = padding_mask()[:, index].contiguous()
        labels = labels.masked_fill(shifted(padding_mask())[:, index] == 0, -100)
        count = int((shifted(ids).masked_fill(shifted(padding_mask()) == 0, -100) != -100).sum())
    if case.habit == "labels":   # transformers' loss, in the head's compiled graph
        loss = model(batch.input_ids, labels=batch.input_ids, **kwargs).loss
    else:
        loss = summed_loss(model(batch.input_ids, **kwargs).logits, labels, count)
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.double()
        dist.all_reduce(grad)
        grads[name] = grad.numpy()
    return loss.item(), grads


def _cells(rank: int, world: int) -> list:
    import loong_compile as lc

    mesh = lc.init_mesh(hp=2, cp=2)
    return [_cell(case, options, mesh) for case, options in CELLS]


def test_blocks_compiled_one_by_one_equal_one_process():
    from loong_compile.testing import run_distributed

    with ThreadPoolExecutor(1) as background:
        references = background.submit(lambda: [reference(case) for case, _ in CELLS])
        results = run_distributed(_cells, 4, timeout=840)[0]
        references = references.result()
    for (case, options), got, want in zip(CELLS, results, references):
        bound = max(tolerance(case), INDUCTOR_TOLERANCE if options["lowering"] == "inductor" else 0)
        error = relative_error(got, want)
        assert error <= bound, f"{case.name} {options}: relative error {error:.1e} > {bound:.1e}"
