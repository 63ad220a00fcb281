"""passes/attention/input_roles.py: positions and masks are found by how they flow, not by their
names (issue 23, observation 8), and run exactly; what is not positions is never taken for them.

Graph-level tests first (no process group); then one spawn of four gloo ranks: a step function
whose positions argument is ``pos`` with packed documents at cp=2 and hp=2 x cp=2, and its
attention mask ``m`` with padding, against one process on the full sequence in float64; and
the layout check of each call applied to ``pos``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graph_helpers import dynamo_graph
from helpers import error_of
from loong_compile.passes.attention.input_roles import rope_positions
from loong_compile.passes.fx.subgraphs import graph_scopes
from loong_compile.testing import run_distributed
from trust_cases import BATCH, SEQ, packed_documents, packed_positions, padding_mask, token_ids
from trust_cases import shifted as _shifted
from trust_reference import relative_error

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

TOLERANCE = 1e-9  # float64 round-off: the model is float64 throughout (Llama's norms upcast
                  # to float32 inside, which one process does alike)


def _rope(gm) -> list[str]:
    return [n.name for n in rope_positions(gm, graph_scopes(gm))]


def _step(model, packed: bool = True):
    """``step(ids, pos, labels)``; ``packed``: as transformers needs for packed documents
    (use_cache=False), else no mask at all (a causal call)."""
    def step(ids, pos, labels):
        logits = model(ids, position_ids=pos, use_cache=not packed).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="sum")
    return step


def test_the_positions_are_what_ropes_angle_is_computed_from_not_ids_or_labels():
    from hf_models import build

    gm = dynamo_graph(_step(build("llama")), token_ids(), packed_positions(), token_ids())
    assert _rope(gm) == ["l_pos_"]


def _angles(ids, pos, table, inv_freq):
    hidden = F.embedding(ids, table)
    rotated = hidden * torch.cos(pos[..., None].float() * inv_freq)
    return torch.sin(hidden) + rotated  # a sine of the hidden states (a snake activation)


def test_token_ids_looked_up_into_an_angle_are_no_positions():
    table, inv_freq = torch.randn(64, 8), torch.rand(8)
    gm = dynamo_graph(_angles, token_ids(), packed_positions(), table, inv_freq)
    assert _rope(gm) == ["l_pos_"]
    gm = dynamo_graph(lambda ids, labels, table: torch.sin(F.embedding(ids, table)).sum()
                      + labels.sum(), token_ids(), token_ids(), table)
    assert _rope(gm) == []


def test_an_angle_of_two_integer_inputs_names_neither():
    # not one tensor of positions; the input check still takes the one named position_ids
    gm = dynamo_graph(lambda pos, offset: torch.cos((pos + offset).float()), packed_positions(),
                      packed_positions())
    assert _rope(gm) == []


# --- four ranks, end to end -------------------------------------------------------------------


def _reference(padded: bool) -> tuple[float, dict]:
    """One process, the full sequence, float64: loss and gradients."""
    from hf_models import build

    model = build("llama")
    ids, labels = token_ids(), _shifted(token_ids())
    if padded:
        labels = labels.masked_fill(_shifted(padding_mask()) == 0, -100)
        logits = model(ids, position_ids=torch.arange(SEQ).expand(BATCH, -1),
                       attention_mask=padding_mask()).logits
    else:
        logits = model(ids, position_ids=packed_positions(), use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum") / int((labels != -100).sum())
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _renamed_inputs(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import loong_compile as lc
    from hf_models import build
    from loong_compile._compat.distributed import resolve_process_group
    from loong_compile.parallel.tokens import mesh_token_indices

    out = {}

    def run(name, hp, cp, padded=False, positions=None, lowering="aot_eager"):
        torch._dynamo.reset()
        mesh = lc.init_mesh(hp=hp, cp=cp)
        model = build("llama")
        ids = token_ids()
        mask = padding_mask() if padded else None
        batch = lc.shard_batch(ids, ids, mesh, attention_mask=mask,
                               document_ids=None if padded else packed_documents())
        labels = batch.labels
        if padded:  # keys and labels of padded tokens
            labels = labels.masked_fill(_shifted(mask)[:, mesh_token_indices(SEQ, mesh)] == 0,
                                        -100)
            count = int((_shifted(ids).masked_fill(_shifted(mask) == 0, -100) != -100).sum())

            def step(ids, pos, m, labels):
                logits = model(ids, position_ids=pos, attention_mask=m).logits
                return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                       reduction="sum")
            args = (batch.input_ids, batch.position_ids, batch.attention_mask, labels)
        else:
            count, step = int(batch.num_labels), _step(model, packed=positions is None)
            args = (batch.input_ids, batch.position_ids if positions is None else positions,
                    labels)
        reports = []
        backend = lc.LoongBackend({"hp": hp, "cp": cp, "lowering": lowering,
                                   "rank_check_timeout": 60}, on_report=reports.append)
        compiled = torch.compile(step, backend=backend, fullgraph=True)

        def train():
            loss = compiled(*args) / count
            loss.backward()
            group = resolve_process_group(mesh.group_names["sp"])
            loss = loss.detach()
            dist.all_reduce(loss, group=group)
            grads = {}
            for n, p in model.named_parameters():
                dist.all_reduce(p.grad, group=group)
                grads[n] = p.grad.numpy()
            out[name] = (loss.item(), grads) if rank == 0 else "ran"

        out[f"{name}_error"] = error_of(train)
        if reports:
            out[f"{name}_roles"] = reports[-1].summary("attention_2d")["inputs"]
            out[f"{name}_checked"] = reports[-1].summary("input_checks")

    run("packed_cp2", 1, 2)
    run("packed_hp2cp2", 2, 2)
    run("padding_hp2cp2", 2, 2, padded=True)
    # positions counted per rank (what a step function makes without shard_batch's), no mask:
    # only the layout check of each call can see them
    run("local_positions", 2, 2, positions=torch.arange(SEQ // 4).expand(BATCH, -1),
        lowering="eager")
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(_renamed_inputs, 4, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("case", ["packed_cp2", "packed_hp2cp2", "padding_hp2cp2"])
def test_renamed_positions_and_mask_run_exactly(four_ranks, case):
    for rank, out in enumerate(four_ranks):
        assert out[f"{case}_error"] == "no error", (rank, out[f"{case}_error"])
        assert out[f"{case}_checked"]["position_ids"] == [
            "graph input 2 (L['pos']), found by RoPE's angle"
            + ("" if case.startswith("padding") else ", the masks' documents")], out
    roles = four_ranks[0][f"{case}_roles"]
    assert roles["position_ids"][0]["input"] == "l_pos_"
    assert (roles["attention_mask"] or {}).get("input") == ("l_m_" if "padding" in case else None)
    error = relative_error(four_ranks[0][case], _reference(case.startswith("padding")))
    assert error <= TOLERANCE, (case, error)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_renamed_positions_are_checked_against_the_layout(four_ranks):
    for rank, out in enumerate(four_ranks):
        message = out["local_positions_error"]
        assert message.startswith("LoongShapeError: position_ids (the compiled function's "
                                  "L['pos'])"), (rank, message)
        assert "count this rank's own tokens from 0" in message and "fix:" in message
