"""passes/schedule/comm_overlap.py on a small post-grad-like graph (no process group needed: the pass
only moves nodes): each exchange starts where its tensor is ready, waits come in start order."""

from __future__ import annotations

import types

import torch
import torch.fx

from loong_compile.passes.schedule.comm_overlap import CommOverlapPass

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


def test_an_exchange_that_starts_after_another_ones_wait_keeps_its_wait_after_its_start():
    """Issue 23 obs 1 (sc++ at hp=2 x cp=2 under Inductor): in the backward the recomputed
    exchanges of one attention call can start after another one's wait; moving their waits
    together put a wait before its start."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = g.call_function(aten.mm.default, (x, w))
    start_a = g.call_function(START, (g.call_function(aten.clone.default, (a,)), [1, 1], [1, 1], "0"))
    unpack_a = g.call_function(aten.clone.default, (g.call_function(WAIT, (start_a,)),))
    b = g.call_function(aten.sin.default, (g.call_function(aten.mm.default, (x, w)),))  # after a's wait
    start_b = g.call_function(START, (g.call_function(aten.clone.default, (b,)), [1, 1], [1, 1], "0"))
    unpack_b = g.call_function(aten.clone.default, (g.call_function(WAIT, (start_b,)),))
    g.output(g.call_function(aten.cat.default, ([unpack_a, unpack_b],)))
    summary = CommOverlapPass().run(g, None)   # lints the graph it leaves
    at = {n: i for i, n in enumerate(g.nodes)}
    for start in (start_a, start_b):
        (wait,) = start.users
        assert at[start] < at[wait]
    assert summary["waits_reordered_for"] == 0


def test_the_pass_runs_only_with_head_parallelism():
    assert CommOverlapPass().enabled(types.SimpleNamespace(hp=2))
    assert not CommOverlapPass().enabled(types.SimpleNamespace(hp=1))


def test_the_exchange_whose_arrival_copies_starts_first():
    """k and v arrive as views (one KV head per rank), q needs an unpacking copy: q's chain and
    start go first though the model projects it last, so q's copy runs while k, v fly."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    nodes = {}
    for name in "vkq":
        packed = g.call_function(aten.clone.default, (g.call_function(aten.mm.default, (x, w)),))
        nodes[f"start_{name}"] = g.call_function(START, (packed, [1, 1], [1, 1], "0"))
    arrivals = []
    for name in "vkq":
        wait = g.call_function(WAIT, (nodes[f"start_{name}"],))
        arrivals.append(g.call_function(aten.clone.default if name == "q" else aten.permute.default,
                                        (wait,) if name == "q" else (wait, [1, 0])))
    g.output(g.call_function(aten.cat.default, (arrivals,)))
    summary = CommOverlapPass().run(g, None)
    starts = [n for n in g.nodes if n.target is START]
    assert starts == [nodes["start_q"], nodes["start_v"], nodes["start_k"]]
    assert summary["chains_ordered"]["groups"][0]["started_in_order"] == [s.name for s in starts]
    g.lint()


def test_order_schedule_keeps_the_collectives_order_and_holds_each_chain_after_the_start_before():
    """Inductor's nodes: x; then (as fusion left them) k's and q's RoPE together ahead of the
    starts, which Inductor chains in the FX order q, k, v."""
    from loong_compile.passes.schedule.exchange_order import order_schedule

    items = [("x", "kernel", "", ()),
             ("rope_k", "kernel", "", (0,)), ("rope_q", "kernel", "", (0,)),
             ("mm_v", "kernel", "", (0,)),
             ("start_q", "start", "", (2,)), ("start_k", "start", "", (1, 4)),
             ("offload_x", "kernel", "loong.offload", (0,)),
             ("start_v", "start", "", (3, 5)),
             ("wait_q", "wait", "", (4,)), ("wait_k", "wait", "", (5,)), ("wait_v", "wait", "", (7,))]
    order, holds, report = order_schedule(items)
    names = [items[i][0] for i in order]
    assert names[:8] == ["x", "offload_x", "rope_q", "start_q", "rope_k", "start_k", "mm_v", "start_v"]
    assert set(holds) == {(1, 4), (3, 5)}         # k's RoPE after q's start, v's mm after k's
    assert report["groups"][0]["started_in_order"] == ["start_q", "start_k", "start_v"]


def test_a_layers_prefetches_are_issued_together_and_its_waits_held_after_them():
    """Inductor's order with one of layer 2's reloads after the first wait of another."""
    from loong_compile.passes.schedule.prefetch_order import hold_prefetches

    items = [("anchor", "kernel", "", ()),
             ("reload_a", "kernel", "loong.reload", (0,)),
             ("wait_a", "kernel", "loong.wait_tensor", (1, 0)),
             ("use_a", "kernel", "", (2,)),
             ("reload_b", "kernel", "loong.reload", (0,)),
             ("wait_b", "kernel", "loong.wait_tensor", (4, 0))]
    order, holds, report = hold_prefetches(items, list(range(len(items))))
    assert [items[i][0] for i in order] == ["anchor", "reload_a", "reload_b", "wait_a", "use_a", "wait_b"]
    assert sorted(holds) == [(2, 4), (5, 1)]
    assert report == {"prefetch_layers": 1, "reloads_moved": 1, "waits_held": 2}
    # on torch 2.13 a reload's result reaches its wait through an output handle (MultiOutput)
    handled = items[:2] + [("handle_a", "kernel", "", (1,)), ("wait_a", "kernel", "loong.wait_tensor", (2, 0)),
                           ("use_a", "kernel", "", (3,)), ("reload_b", "kernel", "loong.reload", (0,)),
                           ("handle_b", "kernel", "", (5,)), ("wait_b", "kernel", "loong.wait_tensor", (6, 0))]
    order, holds, _ = hold_prefetches(handled, list(range(len(handled))))
    assert sorted(holds) == [(3, 5), (7, 1)]
    assert order.index(5) < order.index(3)
