"""Overlap in Inductor's generated code: the reader of the wrapper code (``loong_compile.report.overlap``)
on a hand-written wrapper, then the example Llama under ``memo`` compiled by Inductor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import BUDGET, assert_same_loss_and_grads, tiny_llama, token_ids
from loong_compile import LoongBackend
from loong_compile._compat.inductor import generated_code
from loong_compile.report.overlap import call_body, overlap_of, summary

WRAPPER = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
        cpp_fused_0(primals_1, buf0)
        # a comment: torch.ops.loong.wait_tensor.default(buf2)
        buf1 = torch.ops.loong.offload.default(reinterpret_tensor(buf0, (4, ), (1, ), 0))
        buf2 = buf1
        assert_size_stride(buf2, (4, ), (1, ), 'torch.ops.loong.offload.default')
        del buf1
        buf3 = torch.ops._c10d_functional.all_to_all_single.default(primals_2, [2, 2], [2, 2], '0')
        extern_kernels.mm(buf0, primals_2, out=buf4)
        buf5 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf4, buf4, buf4)
        buf6 = torch.ops.loong.wait_tensor.default(buf2, reinterpret_tensor(buf0, (4, ), (1, ), 0))
        torch.ops._c10d_functional.wait_tensor.default(buf3)
        buf7 = torch.ops.loong.reload.default(buf6, device(type='cpu'))
        buf8 = torch.ops.loong.wait_tensor.default(buf7, buf6)
        return (buf8, )


def get_args():
    return 1
'''


def test_reader_pairs_each_start_with_its_wait_and_counts_the_kernels_between():
    assert call_body(WRAPPER)[0].startswith("primals_1, primals_2 = args")
    assert call_body(WRAPPER)[-1].startswith("return")
    spans = overlap_of(WRAPPER)
    assert [(s.kind, s.kernels_between, s.source) for s in spans] == [
        ("offload", 2, "buf0"), ("all_to_all", 2, "primals_2"), ("reload", 0, "buf6")]
    assert all(s.wait_line is not None and s.wait_line > s.start_line for s in spans)
    kinds = summary(spans)
    assert kinds["offload"]["exposed"] == 0 and kinds["reload"]["exposed"] == 1
    assert kinds["all_to_all"]["min_kernels_between"] == 2


BACKWARD = '''
class Runner:
    def call(self, args):
        buf0 = torch.ops.loong.reload.default(h3, device(type='cpu'), None)
        buf1 = torch.ops.loong.reload.default(h2a, device(type='cpu'), buf0)
        cpp_fused_0(buf0)
        buf2 = torch.ops.loong.wait_tensor.default(buf0, h3, buf9, 3)
        cpp_fused_1(buf2)
        buf3 = torch.ops.loong.wait_tensor.default(buf1, h2a, buf9, 2)
        buf4 = torch.ops.loong.reload.default(h2b, device(type='cpu'), buf3)
        cpp_fused_2(buf3)
        buf5 = torch.ops.loong.wait_tensor.default(buf4, h2b, buf9, 2)
        return (buf5, )
'''


def test_a_prefetch_that_starts_after_its_layer_began_is_late():
    """Layer 2's backward begins at its first reload's wait; its second reload starts after."""
    from loong_compile.report.overlap import late_prefetches

    spans = overlap_of(BACKWARD)
    assert [(s.layer, s.kernels_between) for s in spans] == [(3, 1), (2, 2), (2, 1)]
    assert [s.source for s in late_prefetches(spans)] == ["h2b"]
    assert summary(spans)["reload"]["late_prefetches"] == 1
    assert late_prefetches(overlap_of(BACKWARD.replace("cpp_fused_1(buf2)", "cpp_fused_1(buf2)\n"
                                                       "        buf4 = torch.ops.loong.reload.default(h2b)")
                                      .replace("        buf4 = torch.ops.loong.reload.default(h2b, device(type='cpu'), buf3)\n", ""))) == []


def test_reader_lists_a_start_without_a_wait():
    spans = overlap_of(WRAPPER.replace("torch.ops._c10d_functional.wait_tensor.default(buf3)", "pass"))
    assert [s.wait_line for s in spans if s.kind == "all_to_all"] == [None]
    assert summary(spans)["all_to_all"]["unwaited"] == 1


# -- the example Llama (4 layers, memo) as Inductor generates it ------------------------------

def _example():
    return tiny_llama(layers=4, dim=128, ffn=344), token_ids(1024, batch=1)


def _memo_step(options):
    """One compiled training step of the example Llama at its defaults (4 layers, dim 128, one
    sequence of 1024 tokens: Inductor fuses by the sizes it sees): (loss, grads, generated code
    of each graph, the overlap records of the report).  ``options`` sets ``dump_dir``: the
    backend then compiles past Inductor's caches, and reads every graph's code."""
    (model, ids), reports = _example(), []
    backend = LoongBackend({**BUDGET, "activations": "memo", "alpha": 0.5, "resident_layers": 0,
                            **options}, on_report=reports.append)
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step():
        logits = compiled(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    loss, codes = generated_code(step)
    records = {r.graph_kind: r.summary for r in reports[-1].passes if r.name == "overlap"}
    records["prefetch_order"] = [r.summary for r in reports[-1].passes
                                 if r.name == "prefetch_order" and r.summary["prefetch_layers"]]
    return loss, {n: p.grad for n, p in model.named_parameters()}, codes, records


@pytest.fixture(scope="module")
def memo_one_rank(tmp_path_factory):
    return _memo_step({"dump_dir": str(tmp_path_factory.mktemp("dump"))})


def test_every_offload_and_reload_overlaps_compute_in_the_generated_code(memo_one_rank):
    _, _, codes, records = memo_one_rank
    forward, backward = (overlap_of(code) for code in codes)
    offloads = [s for s in forward if s.kind == "offload"]
    reloads = [s for s in backward if s.kind == "reload"]
    assert len(offloads) == len(reloads) > 4 * 3     # every layer swapped: several tensors each
    assert all(s.wait_line is not None and s.kernels_between >= 1 for s in offloads + reloads), \
        [(s.kind, s.source, s.kernels_between) for s in offloads + reloads]
    assert sorted({s.layer for s in reloads}) == [0, 1, 2, 3]
    assert summary(backward)["reload"]["late_prefetches"] == 0   # each before its layer's backward
    # what the backend reports is what the code says
    assert records["forward"]["kinds"] == summary(forward)
    assert records["backward"]["kinds"] == summary(backward)
    # and it says how it held each layer's prefetch before that layer's backward
    [held] = records["prefetch_order"]      # the schedule stage's pass, on the backward graph
    assert held["prefetch_layers"] == 4 and held["waits_held"] > 0


def test_memo_compiled_by_inductor_computes_what_eager_computes(memo_one_rank):
    loss, grads, _, _ = memo_one_rank
    model, ids = _example()
    logits = model(ids)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    want.backward()
    assert_same_loss_and_grads((loss, grads), (want.detach(), {n: p.grad for n, p in model.named_parameters()}))
