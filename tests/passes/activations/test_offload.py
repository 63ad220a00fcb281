"""Offload and prefetch: the ops, which saved values go to the host, and where the offload,
reload and wait nodes sit in the forward and backward graphs."""

from __future__ import annotations

import pytest
import torch

from loong_compile.ops.offload import OFFLOAD, RELOAD, WAIT
from loong_compile.parallel.rules import CATEGORIES
from loong_compile.passes.activations.classify import ACTIVATION_PLAN
from loong_compile.passes.fx.storage import base_of
from loong_compile.passes.activations.layers import layer_name
from loong_compile.passes.activations.offload import ROUNDING_BUFFER, forward_uses
from helpers import Probe, run_step, tiny_llama


# -- the ops ------------------------------------------------------------------------------

def test_ops_round_trip_on_cpu_keeps_values_and_layout():
    x = torch.randn(3, 5, 7).transpose(0, 2)          # dense, not contiguous
    host = WAIT(OFFLOAD(x), x)
    assert host.device.type == "cpu" and host.stride() == x.stride() and torch.equal(host, x)
    assert host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()   # a copy
    back = RELOAD(host, torch.device("cpu"))
    assert WAIT(back, host) is back and torch.equal(back, x)
    part = x[:, 1:3]                                   # a strided slice: copied densely
    assert torch.equal(WAIT(OFFLOAD(part), part), part)


@pytest.mark.parametrize("op,args", [
    (torch.ops.loong.offload.default, lambda x: (x,)),
    (torch.ops.loong.reload.default, lambda x: (x, torch.device("cpu"))),
])
def test_ops_pass_opcheck(op, args):
    torch.library.opcheck(op, args(torch.randn(4, 6)))


def test_wait_is_never_dead_code():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(WAIT, (graph.call_function(OFFLOAD, (x,)), x))
    graph.output(x)
    assert [n.target for n in graph.nodes if n.op == "call_function" and n.is_impure()] == [WAIT]
    graph.eliminate_dead_code()
    assert WAIT in [n.target for n in graph.nodes]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ops_on_cuda_use_pinned_host_memory_and_a_side_stream():
    x = torch.randn(64, 1024, device="cuda")
    host = OFFLOAD(x)
    assert host.device.type == "cpu" and host.is_pinned()
    host = WAIT(host, x)
    back = WAIT(RELOAD(host, x.device), host)
    torch.cuda.synchronize()
    assert back.device == x.device and torch.equal(back, x)


# -- placement in real graphs ---------------------------------------------------------------

def three_layers():
    return tiny_llama(layers=3)


@pytest.fixture(scope="module")
def offloaded():
    probe = Probe()
    _, _, report = run_step("three", {"activations": "memo", "alpha": 0.5, "resident_layers": 0},
                            probe=probe, make=three_layers)
    split, = probe.graphs
    return split, probe.state[ACTIVATION_PLAN], report


def _layer_nodes(graph, plan):
    """layer index -> nodes of the graph in it (forward nodes; backward by autograd seq_nr)."""
    names = {name: i for i, name in enumerate(plan.layers.names)}
    out = {}
    for n in graph.nodes:
        layer = names.get(layer_name(n)) if n.meta.get("nn_module_stack") else plan.seq_layer.get(
            n.meta.get("seq_nr"))
        if layer is not None and n.op == "call_function" and n.target not in (OFFLOAD, RELOAD, WAIT):
            out.setdefault(layer, []).append(n)
    return out


def test_every_saved_value_of_a_swapped_layer_is_offloaded(offloaded):
    split, plan, report = offloaded
    saved = split.saved_values()
    host = [n for n in saved if n.target is WAIT]
    device = [n for n in saved if n.target is not WAIT]
    owners = [plan.category(u if u in plan.prefixes else base_of(u)) for u in (n.args[1] for n in host)]
    assert {o[0] for o in owners} == {0, 1, 2} and {o[1] for o in owners} == set(CATEGORIES)
    # per layer: its input, attention out + lse, and the token prefixes of its other tensors
    for layer in range(3):
        cats = sorted(c for i, c in owners if i == layer)
        assert cats.count("input") == 1 and cats.count("attention") == 2 and "other" in cats
    # what stays: parameters, ids, RoPE tables, the final norm's values
    assert all(plan.category(base_of(n))[1] not in CATEGORIES for n in device)
    rows = report.summary("offload")["layers"]
    assert all(row["device_bytes"] == 0 for row in rows)


def test_offload_follows_the_last_forward_use_and_waits_before_layer_i_plus_2(offloaded):
    split, plan, _ = offloaded
    fw = split.forward.graph
    order = {n: k for k, n in enumerate(fw.nodes)}
    layers = _layer_nodes(fw, plan)
    for wait in (n for n in fw.nodes if n.target is WAIT):
        copy, source = wait.args[:2]
        assert copy.target is OFFLOAD and copy.args[0] is source
        uses = [u for u in forward_uses(source) if u.target not in (OFFLOAD, WAIT)]
        assert all(order[u] < order[copy] for u in uses)         # after the last use
        layer = plan.category(source if source in plan.prefixes else base_of(source))[0]
        after = next(n for n in list(fw.nodes)[order[wait]:] if n.target not in (OFFLOAD, WAIT))
        if layer + 2 < 3:
            assert after is layers[layer + 2][0]                  # right before layer i + 2
        else:
            assert after.op == "output"


def test_prefetch_starts_with_the_layer_above_and_waits_right_before_first_use(offloaded):
    split, plan, _ = offloaded
    bw = split.backward.graph
    nodes = list(bw.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    layers = _layer_nodes(bw, plan)
    reloads = [n for n in nodes if n.target is RELOAD]
    assert reloads
    for reload in reloads:
        host = reload.args[0]
        assert host.op == "placeholder" and set(host.users) == {reload, *[u for u in host.users if u.target is WAIT]}
        wait, = [u for u in reload.users if u.target is WAIT]
        users = list(wait.users)
        first = min(users, key=order.__getitem__)
        between = nodes[order[wait] + 1:order[first]]
        assert all(n.target in (RELOAD, WAIT) for n in between)   # the wait sits right before the use
        layer = plan.category(_unit(split, host, plan))[0]
        assert reload.meta[ROUNDING_BUFFER] == layer % 2          # MEMO's even / odd staging buffer
        if layer + 1 < 3:   # started where layer i+1's backward starts: the copy overlaps it
            assert order[reload] < order[layers[layer + 1][0]]
            assert sum(order[reload] < order[n] < order[wait] for n in layers[layer + 1]) > 10


def _unit(split, placeholder, plan):
    """The forward value behind a backward placeholder (the wait's source)."""
    index = [n for n in split.backward.graph.nodes if n.op == "placeholder"].index(placeholder)
    wait = split.saved_values()[index]
    source = wait.args[1]
    return source if source in plan.prefixes else base_of(source)


@pytest.mark.parametrize("resident,swapped", [(2, []), (1, ["layers.0"])])
def test_resident_layers_are_not_swapped(resident, swapped):
    """MEMO keeps the last two layers on device (eq. 3's n - 2): the default resident_layers=2."""
    probe = Probe()
    _, _, report = run_step("example", {"activations": "memo", "alpha": 0.5, "resident_layers": resident},
                            probe=probe)
    split, = probe.graphs
    assert report.summary("activations")["swapped_layers"] == swapped
    rows = report.summary("offload")["layers"]
    assert [r["layer"] for r in rows if r["offloaded_bytes"]] == swapped
    assert all(r["device_bytes"] > 0 and r["recomputed_bytes"] == 0 for r in rows if r["layer"] not in swapped)
    offloads = [n for n in split.forward.graph.nodes if n.target is OFFLOAD]
    assert bool(offloads) == bool(swapped)
