"""The 2D-Attention ops are traceable: opcheck, make_fx, torch.compile(fullgraph=True).

The ring ops are custom ops (opcheck); the SeqAlltoAll is functional collectives
(``_c10d_functional.all_to_all_single`` + ``wait_tensor``), one pair per tensor.

One spawn of 4 gloo ranks runs every section; the tests read its results.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers import Sections, section_results
from loong_compile.parallel.tokens import mesh_token_indices
from loong_compile.parallel.mesh import init_mesh
from loong_compile.ops import attention_2d, seq_all_to_all
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

MESHES = [dict(hp=2, cp=2, inner_ring=2, placement="context_first"),  # MHA, both collectives
          dict(hp=4, cp=1), dict(hp=1, cp=4, inner_ring=2)]


def _inputs(mesh, heads, kv_heads, seq, dtype=torch.float64):
    gen = torch.Generator().manual_seed(7)
    index = mesh_token_indices(seq, mesh)
    q, dout = (torch.randn(2, heads, seq, 16, generator=gen, dtype=dtype)[:, :, index]
               for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq, 16, generator=gen, dtype=dtype)[:, :, index]
            for _ in range(2))
    return q, k, v, dout


def _op_counts(graph) -> Counter:
    """Calls of our ops and of functional collectives, by qualified name (Dynamo's graphs
    name an op by its packet, AOT's by its overload)."""
    names = (getattr(getattr(n.target, "overloadpacket", n.target), "_qualified_op_name", "")
             for n in graph.nodes if n.op == "call_function")
    return Counter(name for name in names if name.startswith(("loong::", "_c10d_functional::")))


def _exchanges(hp: int) -> dict:
    """One all-to-all and one wait each for q, k, v and out forward; d_out, dq, dk, dv backward."""
    return {"_c10d_functional::all_to_all_single": 8, "_c10d_functional::wait_tensor": 8} if hp > 1 else {}


def _opcheck(mesh):
    """torch.library.opcheck on each custom op with this mesh's groups (runs them for real),
    and the SeqAlltoAll undone by its reverse (what its backward relies on)."""
    kw = mesh.attention_kwargs()
    q, k, v, dout = _inputs(mesh, 4, 4, 16)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    ring_groups = [kw[f"{kind}_group"]
                   for kind in ("kv_inner", "kv_outer", "dkv_inner", "dkv_outer")]
    ring_args = (True, 0.25, mesh.cp, mesh.inner_ring, *ring_groups)
    out, lse = torch.ops.loong.ring_attention_fwd(q, k, v, *ring_args)
    results = {
        "ring_attention_fwd": torch.library.opcheck(torch.ops.loong.ring_attention_fwd,
                                                    (q2, k2, v2, *ring_args)),
        "ring_attention_bwd": torch.library.opcheck(torch.ops.loong.ring_attention_bwd,
                                                    (dout, q, k, v, out, lse, *ring_args)),
    }
    results = {name: {test: str(outcome) for test, outcome in r.items()}
               for name, r in results.items()}
    if mesh.hp > 1:
        there = seq_all_to_all([q, k], 1, 2, mesh.hp, kw["hp_group"])
        back = seq_all_to_all(there, 2, 1, mesh.hp, kw["hp_group"])
        results["seq_all_to_all"] = {
            "shape": "SUCCESS" if there[0].shape == (2, 4 // mesh.hp, 16 // mesh.cp, 16) else "FAIL",
            "round_trip": "SUCCESS" if all(torch.equal(a, b) for a, b in zip(back, (q, k))) else "FAIL"}
    return results


def _compiled_vs_eager(mesh, backend, heads, kv_heads):
    """Forward and grads of attention_2d under torch.compile(fullgraph=True) vs eager."""
    kwargs = mesh.attention_kwargs()
    q, k, v, dout = _inputs(mesh, heads, kv_heads, 8 * mesh.sp)
    graphs = []

    def recording(gm, example_inputs):  # Dynamo's graph (autograd.Function bodies inside), run as is
        graphs.append(sum((_op_counts(m.graph) for m in gm.modules()
                           if isinstance(m, torch.fx.GraphModule)), Counter()))
        return gm.forward

    def attention(q, k, v):
        return attention_2d(q, k, v, is_causal=True, scale=None, **kwargs)

    results = []
    for fn in (attention, torch.compile(attention, backend=recording if backend == "dynamo"
                                        else backend, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results.append((out.detach(), *torch.autograd.grad(out, leaves, dout)))
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results)]
    zero_grads = [bool((g == 0).all()) for g in results[1][1:]]
    return {"errors": errors, "zero_grads": zero_grads, "dynamo_ops": graphs}


def _joint_graph_counts(mesh):
    """make_fx of forward + backward: each op appears exactly as often as expected."""
    from torch.fx.experimental.proxy_tensor import make_fx

    kwargs = mesh.attention_kwargs()

    def joint(q, k, v, dout):
        out = attention_2d(q, k, v, is_causal=True, scale=None, **kwargs)
        return torch.autograd.grad(out, (q, k, v), dout)

    q, k, v, dout = _inputs(mesh, 4, 2, 8 * mesh.sp)
    graph = make_fx(joint, tracing_mode="fake")(*(t.requires_grad_() for t in (q, k, v)), dout)
    return _op_counts(graph.graph)


def _suite(rank, world):
    sections = Sections()
    section = sections.run
    for spec in MESHES:
        mesh = init_mesh(**spec)
        tag = f"hp{mesh.hp}cp{mesh.cp}"
        section(f"opcheck {tag}", _opcheck, mesh)
        section(f"make_fx {tag}", _joint_graph_counts, mesh)
        section(f"dynamo {tag}", _compiled_vs_eager, mesh, "dynamo", 4, 2)
        section(f"aot_eager {tag}", _compiled_vs_eager, mesh, "aot_eager", 4, 1)
    section("inductor", _compiled_vs_eager, init_mesh(**MESHES[0]), "inductor", 4, 2)
    return sections.results


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_suite, 4, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["hp2cp2", "hp4cp1", "hp1cp4"])
def test_opcheck_passes(four_ranks, tag):
    for per_op in section_results(four_ranks, f"opcheck {tag}"):
        assert per_op
        for op, tests in per_op.items():
            assert all(outcome == "SUCCESS" for outcome in tests.values()), (op, tests)


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["hp2cp2", "hp4cp1", "hp1cp4"])
def test_joint_graph_has_each_op_once(four_ranks, tag):
    for counts in section_results(four_ranks, f"make_fx {tag}"):
        assert counts == Counter({"loong::ring_attention_fwd": 1, "loong::ring_attention_bwd": 1,
                                  **_exchanges(int(tag[2]))})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["dynamo", "aot_eager"])
@pytest.mark.parametrize("tag", ["hp2cp2", "hp4cp1", "hp1cp4"])
def test_fullgraph_compile_matches_eager(four_ranks, backend, tag):
    for result in section_results(four_ranks, f"{backend} {tag}"):
        assert max(result["errors"]) <= 1e-12, result["errors"]
        assert not any(result["zero_grads"])
        if backend == "dynamo":  # one graph: one attention call, its autograd.Function bodies inside
            assert len(result["dynamo_ops"]) == 1
            assert result["dynamo_ops"][0] == Counter({"loong::ring_attention_fwd": 1,
                                                       **_exchanges(int(tag[2]))})


@pytest.mark.slow
def test_inductor_compile_matches_eager(four_ranks):
    for result in section_results(four_ranks, "inductor"):
        assert max(result["errors"]) <= 1e-12, result["errors"]
        assert not any(result["zero_grads"])


@pytest.mark.parametrize("v_head_dim", [16, 8])  # V's own head dim (MLA)
def test_opcheck_with_transposed_inputs_one_process(v_head_dim):
    """Models hand attention (B, S, H, D)-major views; the fake kernels must predict the real
    outputs' shapes and strides for them too, or AOTAutograd plans views that fail at run time."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 8, heads, d, generator=gen, dtype=torch.float64).transpose(1, 2)
               for heads, d in ((4, 16), (2, 16), (2, v_head_dim)))
    args = (True, 0.25, 1, 1, "", "", "", "")
    fwd = torch.library.opcheck(torch.ops.loong.ring_attention_fwd,
                                (q.clone().requires_grad_(), k.clone().requires_grad_(),
                                 v.clone().requires_grad_(), *args))
    out, lse = torch.ops.loong.ring_attention_fwd(q, k, v, *args)
    dout = torch.randn(2, 8, 4, v_head_dim, generator=gen, dtype=torch.float64).transpose(1, 2)
    bwd = torch.library.opcheck(torch.ops.loong.ring_attention_bwd, (dout, q, k, v, out, lse, *args))
    for result in (fwd, bwd):
        assert set(result.values()) == {"SUCCESS"}, result
