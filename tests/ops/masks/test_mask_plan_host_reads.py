"""Masked attention reads device data on the host once per step, not once per layer.

One compiled training step of transformers' Llama at hp=2 x cp=2 with packed documents
(positions restarting per document, ``use_cache=False``; in the zigzag's order and in
``shard_batch(balance_documents=True)``'s), 4 gloo ranks: every call of a
Tensor method that copies device data to the host (``item``, ``tolist``, ``cpu``, ``numpy``,
``__bool__``, ``__int__``, ``__float__``, ``__index__``) during one forward + backward after
warm-up is counted, on CUDA each is a device-to-host synchronisation.  The mask plan is made
by one node per step (``loong.masked_attention_plan``), so the count must not grow with
the depth.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from helpers import Sections, section_results, tiny_llama
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
MOST_PER_STEP = 4
SEQ = 64


@contextlib.contextmanager
def counting_host_reads():
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return method

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


# per order: the documents, and the right padding shard_batch(balance_documents=True) pads in
DOCUMENTS = {
    "contiguous": (torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 40 + [1] * 24]), 0),
    "balanced": (torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 40 + [1] * 24]), 8),
}


def _step_reads(layers: int, lowering: str, order: str = "contiguous") -> dict[str, int]:
    from loong_compile import LoongBackend, init_mesh, shard_batch

    mesh = init_mesh(hp=2, cp=2)
    model = tiny_llama(hf=True, layers=layers, max_positions=SEQ)
    model.config.use_cache = False
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    documents, room = DOCUMENTS[order]
    if room:
        real = (torch.arange(SEQ) < SEQ - room).long().expand(2, SEQ)
        batch = shard_batch(ids, ids.masked_fill(real == 0, -100), mesh, document_ids=documents,
                            attention_mask=real, balance_documents=True)
    else:
        batch = shard_batch(ids, ids, mesh, document_ids=documents)
    # scalar CPU kernels: a host read is the wrapper's, whatever the kernels (and they compile faster)
    compiled = torch.compile(model, backend=LoongBackend({"hp": 2, "cp": 2, "lowering": lowering,
                                                          "inductor_options": {"cpp.simdlen": 1}}),
                             fullgraph=True)

    def step():
        out = compiled(batch.input_ids, position_ids=batch.position_ids, labels=batch.labels,
                       shift_labels=batch.labels, num_items_in_batch=batch.num_labels,
                       use_cache=False)
        out.loss.backward()

    for _ in range(2):
        step()
    with counting_host_reads() as counts:
        step()
    from loong_compile.ops.masks.step import rebuilt_step_masks

    assert rebuilt_step_masks() == 0, "a masked call got a handle the step's plan did not make"
    return dict(counts)


def _ranks(rank: int, world: int, lowering: str) -> dict:
    sections = Sections()
    for order in DOCUMENTS:
        for layers in (2, 4):
            sections.run((order, layers), _step_reads, layers, lowering, order)
    return sections.results


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lowering", ["inductor"])
def test_host_reads_per_step_do_not_grow_with_depth(lowering):
    per_rank = run_distributed(_ranks, 4, lowering, timeout=840)
    for order in DOCUMENTS:  # shard_batch's plain zigzag, and its balanced document order
        for layers in (2, 4):
            section_results(per_rank, (order, layers))
        for rank, result in enumerate(per_rank):
            two, four = (sum(result[order, n].values()) for n in (2, 4))
            assert four == two, f"rank {rank}, {order}: {result[order, 2]} with 2 layers, " \
                                f"{result[order, 4]} with 4"
            assert two <= MOST_PER_STEP, f"rank {rank}, {order}: {result[order, 2]} host reads"
