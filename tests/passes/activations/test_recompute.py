"""Token-slice recompute: the token-wise proof op by op on hand-built graphs, the slices it
emits on real graphs, and the fall-backs (a chain that is not token-wise, a random op)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from loong_compile.passes.activations.token_rules import TokenDim, analyse
from helpers import SEQ, Probe, assert_same_loss_and_grads, captured, mixing_model, run_step

S = 8   # tokens in the hand-built graphs


def trace(fn, *shapes):
    """fn's aten graph with fake values; (graph nodes, placeholders in order)."""
    gm = make_fx(fn, tracing_mode="fake")(*(torch.empty(s) for s in shapes))
    nodes = list(gm.graph.nodes)
    return nodes, [n for n in nodes if n.op == "placeholder"]


def token_dims(fn, *shapes, root_dim=1):
    """Token dim of the output and the failures, with the first input's tokens at ``root_dim``."""
    nodes, (x, *_) = trace(fn, *shapes)
    steps, failures = analyse(nodes, {x: TokenDim(root_dim)}, S)
    out = nodes[-1].args[0]
    out = out[0] if isinstance(out, (list, tuple)) else out
    return steps.get(out), failures.get(out), steps


def test_linear_chain_keeps_tokens_through_merged_views():
    def layer(x, w):   # what a Linear on (B, S, D) becomes: flatten B·S, mm, unflatten, heads
        y = torch.mm(x.view(2 * S, 4), w.t())
        return y.view(2, S, 2, 3).transpose(1, 2)

    step, failure, steps = token_dims(layer, (2, S, 4), (6, 4))
    assert failure is None and step.out == TokenDim(2)
    mm = next(n for n in steps if n.target is torch.ops.aten.mm.default)
    assert steps[mm].out == TokenDim(0, outer=2)   # rows = batch x tokens


def test_broadcast_operand_is_sliced_where_it_is_used():
    def rope_like(x, cos):   # x: (B, H, S, D); cos: (B, S, D) without tokens of its own
        return x * cos[:, None]

    nodes, (x, cos) = trace(rope_like, (2, 3, S, 4), (2, S, 4))
    steps, failures = analyse(nodes, {x: TokenDim(2)}, S)
    mul = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
    assert not failures and steps[mul].out == TokenDim(2)
    (operand, where), = steps[mul].slice_operands.items()
    assert operand.args[0] is cos and where == TokenDim(2)   # the unsqueezed cos, at its dim 2


@pytest.mark.parametrize("fn,why", [
    (lambda x: torch.cumsum(x, 1), "a cumulative sum along the sequence"),
    (lambda x: torch.softmax(x, 1), "softmax along the sequence"),
    (lambda x: x.sum(1), "reduces over the sequence"),
    (lambda x: x[:, : S // 2], "slices along the sequence"),
    (lambda x: torch.cat([x, x], 1), "concatenates along the sequence"),
    (lambda x: x.view(2, 2, S // 2, 4), "splits the sequence"),
    (lambda x: torch.bmm(x.transpose(1, 2), x), "both matmul operands carry tokens"),
    (lambda x: torch.flip(x, [2]), "no token-wise rule"),
    (lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0], "random op"),
])
def test_ops_that_mix_tokens_are_not_token_wise(fn, why):
    step, failure, _ = token_dims(fn, (2, S, 4))
    assert step is None and why in failure


@pytest.mark.parametrize("fn,dim", [
    (lambda x: torch.cumsum(x, -1), 1),                 # along the hidden dim: fine
    (lambda x: torch.softmax(x, -1) * x.mean(-1, keepdim=True), 1),
    (lambda x: x.sum(-1), 1),
    (lambda x: torch.cat([x, x], -1)[..., 2:5], 1),
    (lambda x: torch.nn.functional.silu(x).permute(2, 0, 1), 2),
    (lambda x: torch.mm(x.reshape(-1, 4), torch.ones(4, 3)).reshape(2, S, 3), 1),
])
def test_ops_along_other_dims_are_token_wise(fn, dim):
    step, failure, _ = token_dims(fn, (2, S, 4))
    assert failure is None and step.out.dim == dim


# -- real graphs ------------------------------------------------------------------------------

def _slices(graph):
    return [n for n in graph.nodes if n.meta.get("loong") == "token_slice"]


@pytest.mark.parametrize("model_name", ["example", "hf"])
def test_recompute_covers_exactly_the_tokens_not_offloaded(model_name):
    alpha = 0.375
    a = round(alpha * SEQ)
    probe = Probe()
    _, _, report = run_step(model_name, {"activations": "memo", "alpha": alpha, "resident_layers": 0},
                            probe=probe)
    split, = probe.graphs
    # forward: every "other" tensor keeps tokens [0, a) (these are what is offloaded)
    heads = _slices(split.forward.graph)
    assert heads
    for node in heads:
        x, dim, start, end = node.args
        assert start == 0 and end * SEQ == x.meta["val"].shape[dim] * a
    # backward: the layer inputs and attention outputs are cut to tokens [a, s) ...
    tails = _slices(split.backward.graph)
    assert tails
    for node in tails:
        x, dim, start, end = node.args
        assert end == x.meta["val"].shape[dim] and start * SEQ == end * a
    # ... and each rebuilt tensor joins a tokens with s - a recomputed ones, back to full size
    joins = [n for n in split.backward.graph.nodes if n.meta.get("loong") == "token_join"]
    sliced = [v for layer in report.summary("recompute")["layers"] for v in layer["sliced"]]
    assert len(joins) == len(sliced) > 0
    for join in joins:
        pieces, dim = join.args
        head, tail = (p.meta["val"].shape[dim] for p in pieces)
        assert head * (SEQ - a) == tail * a and join.meta["val"].shape[dim] == head + tail
    for layer in report.summary("recompute")["layers"]:
        assert layer["recomputed_tokens"] == [a, SEQ] and layer["recompute_flops"] > 0


def test_cumulative_op_falls_back_to_full_recompute():
    make = mixing_model(0.0)
    ref = run_step("mixing", {"activations": "none"}, make=make)
    loss, grads, report = run_step("mixing", {"activations": "memo", "alpha": 0.5, "resident_layers": 0},
                                   make=make)
    assert_same_loss_and_grads((loss, grads), ref[:2])
    layers = report.summary("recompute")["layers"]
    # The last block's output (read by the head) comes out of the cumsum: recomputed in full.
    full = layers[-1]["full"]
    assert len(full) == 1 and "a cumulative sum along the sequence dimension" in full[0]["reason"]
    assert all(layer["sliced"] for layer in layers)   # what comes before the cumsum is sliced


def test_random_op_is_never_recomputed():
    make = mixing_model(0.25)
    options = {"activations": "memo", "alpha": 0.5, "resident_layers": 0}
    captured("dropout", make)   # Dynamo's trace runs the model once: draw before seeding
    torch.manual_seed(1)
    ref = run_step("dropout", {"activations": "none"}, make=make)
    torch.manual_seed(1)
    loss, grads, report = run_step("dropout", options, make=make)
    assert_same_loss_and_grads((loss, grads), ref[:2])
    kept = [k for layer in report.summary("recompute")["layers"] for k in layer["kept"]]
    assert kept and all(k["reason"] == "its recompute chain has a random op" for k in kept)
