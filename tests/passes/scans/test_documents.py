"""passes/scans/documents.py and ops/scans/documents.py: the scans reset at each packed document's
start (issue 51).  The numbers ``scan_documents`` makes and the rows it refuses; the one documents
node the passes make per graph from the positions input (``position_inputs``), shared by every
scan and taken from the attention pass's own ids where it made them; on one process, the scans
left as the model wrote them where the graph has no positions, and rewritten where it has: a
packed batch through Qwen3.5 and Falcon-H1 compiled at hp = cp = 1 is each document alone."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from graph_helpers import StubMesh, dynamo_graph
from loong_compile import LoongBackend, LoongConfig
from loong_compile.errors import LoongShapeError, LoongUnsupportedError
from loong_compile.ops import sequence_document_ids
from loong_compile.ops.masks.blocks import CHUNK_MAJOR, UNREADABLE
from loong_compile.ops.scans.causal_conv import causal_conv1d
from loong_compile.ops.scans.documents import scan_documents
from loong_compile.ops.scans.gated_scan import gated_delta_rule
from loong_compile.passes.base import POSITION_INPUTS, PassContext
from loong_compile.passes.scans.causal_conv import CausalConvPass
from loong_compile.passes.scans.documents import SCAN_DOCUMENTS
from loong_compile.passes.scans.gated_delta import GatedDeltaPass
from trust_cases import Case, case_model, label_count, packed_positions, shifted, summed_loss, token_ids
from trust_reference import reference, relative_error, tolerance

B, T, K, H, D = 2, 12, 4, 2, 4
C = 3 * H * D     # the convolutions' channels: query, key and value


def test_the_numbers_change_at_each_document_start():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3]])
    assert scan_documents(ids).tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]


def test_rows_where_no_reset_can_be_placed_are_refused_by_name():
    balanced = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 1]]) + CHUNK_MAJOR * torch.tensor([[0], [1]])
    with pytest.raises(LoongUnsupportedError, match=r"rows \[1\] .*balance_documents=True.*scan"):
        scan_documents(balanced)
    with pytest.raises(LoongShapeError, match=r"rows \[0\] that are neither packed documents"):
        scan_documents(torch.tensor([[UNREADABLE] * 4, [0, 0, 1, 1]]))


class Mixer(torch.nn.Module):
    """Two short convolutions and a gated delta rule (transformers' torch fallbacks), on hidden
    states and the positions (read by nothing but an identity, as a model's RoPE would)."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(C, K)) for _ in range(2)])

    def forward(self, hidden, positions):
        x = hidden.transpose(1, 2)
        for w in self.convs:
            x = F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=K - 1, groups=C)[:, :, :T])
        q, k, v = x.transpose(1, 2).reshape(B, T, 3, H, D).unbind(2)
        out, _ = torch_chunk_gated_delta_rule(q, k, v, g=-F.softplus(v[..., 0]), beta=v[..., 1].sigmoid(),
                                              use_qk_l2norm_in_kernel=True)
        return out + positions[:, :, None, None]


def scans_of(config: LoongConfig, mesh, with_positions: bool, attention_ids: bool = False):
    """The scans' passes on the mixer's graph: (conv summary, delta summary, graph)."""
    graph = dynamo_graph(Mixer(), torch.randn(B, T, C), torch.arange(T).expand(B, T))
    inputs = list(graph.graph.find_nodes(op="placeholder"))
    positions = next(n for n in inputs if n.meta["example_value"].dtype == torch.int64)
    if attention_ids:   # what the attention pass leaves for a mask of documents alone
        with graph.graph.inserting_after(positions):
            ids = graph.graph.call_function(sequence_document_ids, (positions, None), mesh.document_kwargs())
        ids.meta["example_value"] = positions.meta["example_value"].new_empty((B, T * mesh.sp))
    state = {POSITION_INPUTS: {inputs.index(positions): "RoPE's angle"}} if with_positions else {}
    ctx = PassContext(config=config, mesh=mesh, state=state)
    return CausalConvPass().run(graph, ctx), GatedDeltaPass().run(graph, ctx), graph


@pytest.mark.parametrize("attention_ids", [False, True], ids=["own ids", "attention's ids"])
def test_every_scan_reads_one_documents_node_made_from_the_positions(attention_ids):
    conv, delta, graph = scans_of(LoongConfig(cp=2), StubMesh(cp=2), True, attention_ids)
    (numbers,) = graph.graph.find_nodes(op="call_function", target=SCAN_DOCUMENTS)
    (ids,) = graph.graph.find_nodes(op="call_function", target=sequence_document_ids)
    assert numbers.args == (ids,) and ids.args[0].op == "placeholder"
    scans = [n for n in graph.graph.nodes if n.target in (causal_conv1d, gated_delta_rule)]
    assert len(scans) == 3 and all(n.kwargs["documents"] is numbers for n in scans)
    for record in conv["changed"] + delta["changed"]:
        assert record["documents"].startswith("reset at each document start"), record


def test_without_positions_the_scans_run_each_row_as_one_sequence():
    conv, delta, graph = scans_of(LoongConfig(cp=2), StubMesh(cp=2), False)
    assert len(conv["changed"]) == 2 and len(delta["changed"]) == 1
    assert all(r["documents"].startswith("none: no input of this graph is positions")
               for r in conv["changed"] + delta["changed"])
    assert not graph.graph.find_nodes(op="call_function", target=SCAN_DOCUMENTS)


def test_one_process_without_positions_keeps_the_models_scans():
    from loong_compile.parallel.mesh import one_process_mesh

    conv, delta, graph = scans_of(LoongConfig(), one_process_mesh(), False)
    assert not conv["changed"] and not delta["changed"]
    assert [r["reason"] for r in conv["kept"] + delta["kept"]] == [
        "one process and no documents: the model's own scan computes the same"] * 3
    assert not [n for n in graph.graph.nodes if n.target in (causal_conv1d, gated_delta_rule)]


@pytest.mark.parametrize("arch", ["qwen3_5", "falcon_h1"])
def test_one_process_resets_at_each_packed_document(arch):
    """hp = cp = 1: the backend rewrites the scans too, so that a packed batch is each document
    alone, as under hp·cp > 1 and as the kernels users run (transformers' fallback: 0.64 and
    0.25 off); judged as the trust matrix judges its cells."""
    case = Case(arch, habit="packed_use_cache_false")
    model = case_model(case, torch.float64)
    reports = []
    compiled = torch.compile(model, backend=LoongBackend({"lowering": "aot_eager"}, on_report=reports.append))
    ids = token_ids()
    logits = compiled(ids, position_ids=packed_positions(), use_cache=False).logits
    loss = summed_loss(logits, shifted(ids), label_count())
    loss.backward()
    got = (loss.item(), {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None})
    error = relative_error(got, reference(case))
    assert error <= tolerance(case), f"{arch}: relative error {error:.1e} > {tolerance(case):.1e}"
    scans = [r.summary for report in {id(r): r for r in reports}.values() for r in report.passes
             if r.name in ("causal_conv", "gated_delta", "mamba2")]
    changed = [c for s in scans for c in s["changed"]]
    assert len(changed) >= 2 and not [k for s in scans for k in s["kept"]], scans  # conv and scan
    assert all(c["documents"].startswith("reset at each document start") for c in changed)
