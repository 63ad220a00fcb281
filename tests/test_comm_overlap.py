"""passes/comm_overlap.py on a small post-grad-like graph (no process group needed: the pass
only moves nodes): each exchange starts where its tensor is ready, waits come in start order."""

from __future__ import annotations

import types

import torch
import torch.fx

from loong_compile.passes.comm_overlap import CommOverlapPass

aten = torch.ops.aten
START = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def attention_like_graph() -> tuple[torch.fx.Graph, dict]:
    """Three projections, RoPE-like ops on two of them, then (as AOTAutograd traces the
    attention call) every pack and exchange, the waits in argument order, one consumer."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    q, k, v = (g.call_function(aten.mm.default, (x, w)) for _ in range(3))
    rope_q, rope_k = g.call_function(aten.sin.default, (q,)), g.call_function(aten.cos.default, (k,))
    nodes = {"rope_q": rope_q, "rope_k": rope_k, "v": v}
    for name, t in (("q", rope_q), ("k", rope_k), ("v", v)):
        packed = g.call_function(aten.clone.default, (g.call_function(aten.permute.default, (t, [1, 0])),))
        nodes[f"start_{name}"] = g.call_function(START, (packed, [1, 1], [1, 1], "0"))
    for name in "qkv":
        nodes[f"wait_{name}"] = g.call_function(WAIT, (nodes[f"start_{name}"],))
        nodes[f"unpack_{name}"] = g.call_function(aten.clone.default, (nodes[f"wait_{name}"],))
    g.output(g.call_function(aten.cat.default, ([nodes[f"unpack_{n}"] for n in "qkv"],)))
    return g, nodes


def test_each_start_moves_to_where_its_tensor_is_ready_and_waits_follow_start_order():
    graph, nodes = attention_like_graph()
    summary = CommOverlapPass().run(graph, None)
    at = {n: i for i, n in enumerate(graph.nodes)}
    assert at[nodes["start_v"]] < at[nodes["rope_q"]]              # v's exchange runs under RoPE
    assert at[nodes["start_q"]] < at[nodes["rope_k"]] < at[nodes["start_k"]]
    assert [n for n in graph.nodes if n.target is WAIT] == [nodes["wait_v"], nodes["wait_q"], nodes["wait_k"]]
    assert summary["matched"] == 3 and summary["waits_reordered_for"] == 1
    before, after = summary["nodes_between_start_and_wait"].values()
    assert summary["changed"] >= 2 and all(n >= 1 for n in after), (before, after)


def test_the_pass_runs_only_with_head_parallelism():
    assert CommOverlapPass().enabled(types.SimpleNamespace(hp=2))
    assert not CommOverlapPass().enabled(types.SimpleNamespace(hp=1))
