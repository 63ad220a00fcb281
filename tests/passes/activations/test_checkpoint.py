"""Selective Checkpoint++ (LoongTrain §5.2): the recompute tags on the joint graph, per policy,
and what the partition makes of them (attention never recomputed)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from loong_compile.passes.fx.aten_ops import attention_ops, is_attention
from loong_compile.passes.fx.walks import tangent_dependent
from loong_compile.passes.activations.layers import find_layers
from helpers import Probe, mixing_model, run_step

MUST_SAVE, PREFER_RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


class JointProbe:
    """Runs after the library's joint pass: keeps the tagged joint graph's facts."""

    name, stage = "joint_probe", "joint"

    def enabled(self, config):
        return True

    def run(self, joint, ctx):
        graph = joint.graph
        backward = tangent_dependent(graph)
        self.layers = find_layers(graph, lambda n: n not in backward)
        self.tags = {n: n.meta.get("recompute") for n in graph.nodes}
        self.attention = [n for n in graph.nodes if is_attention(n) and n not in backward]
        return {}


def test_attention_ops_are_looked_up_by_name():
    names = {str(op) for op in attention_ops()}
    assert {"aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
            "aten._scaled_dot_product_efficient_attention"} <= names
    import loong_compile.ops  # noqa: F401  registers the ring op
    assert "loong.ring_attention_fwd" in {str(op) for op in attention_ops()}


@pytest.mark.parametrize("op", ["ring_attention_fwd", "masked_attention_fwd"])
def test_a_layer_is_found_by_either_2d_attention_op(op):
    # The masked op runs every padded, packed or windowed model under hp*cp > 1: its layers
    # went unfound, so sc++ and memo silently left them to Inductor's partition (issue 23)
    import loong_compile.ops  # noqa: F401  registers the ops
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(1, 2, 4, 8)
    in_layer = {"nn_module_stack": {"layers.0": ("L['self'].layers[0]", torch.nn.Module)}}
    attention = graph.call_function(getattr(torch.ops.loong, op).default, (x, x, x))
    out = graph.call_function(operator.getitem, (attention, 0))
    residual = graph.call_function(torch.ops.aten.add.Tensor, (x, out))
    for node in (attention, out, residual):
        node.meta.update(in_layer, val=x.meta["val"])
    head = graph.call_function(torch.ops.aten.neg.default, (residual,))
    head.meta.update(nn_module_stack={"norm": ("L['self'].norm", torch.nn.Module)}, val=x.meta["val"])
    graph.output(head)
    layers = find_layers(graph)
    assert layers.names == ["layers.0"] and layers.attention == {0: [attention]}
    assert layers.inputs == {0: [x]} and layers.leaving == {residual}


def _tags(policy, model="example", make=None):
    probe = JointProbe()   # runs right after the library's joint pass, before the partition
    run_step(model, {"activations": policy}, probe=probe, make=make)
    return probe


@pytest.mark.parametrize("policy", ["none", "sc++", "memo"])
def test_tags_per_policy(policy):
    probe = _tags(policy)
    tags, layers = probe.tags, probe.layers
    assert len(probe.attention) == 2
    attention = {n for att in probe.attention for n in (att, *att.users)}
    assert all(tags[n] == MUST_SAVE for n in attention)          # every policy: never recomputed
    inputs = {n for ns in layers.inputs.values() for n in ns}
    assert sorted(n.name for n in inputs) == ["add_5", "embedding"]
    saved = {n for n, tag in tags.items() if tag == MUST_SAVE}
    recompute = {n for n, tag in tags.items() if tag == PREFER_RECOMPUTE}
    if policy == "none":
        assert saved == attention and not recompute
    elif policy == "memo":
        assert saved == attention | inputs and not recompute
    else:   # sc++: everything else inside the layers is recomputed
        assert saved == attention | inputs | layers.leaving
        assert recompute == set(layers.node_layer) - saved
        assert [n.name for n in layers.leaving] == ["add_11"]      # the final norm's input


def test_sc_plus_plus_recomputes_everything_but_the_attention():
    probe = Probe()
    run_step("example", {"activations": "sc++"}, probe=probe)
    split, = probe.graphs
    assert not [n for n in split.backward.graph.nodes if is_attention(n)]   # not recomputed
    recomputed = {n.meta["nn_module_stack"] and list(n.meta["nn_module_stack"].values())[-1][0]
                  for n in split.backward.graph.nodes if n.meta.get("nn_module_stack")}
    assert any("feed_forward" in str(m) for m in recomputed)                # the rest is
    assert any("wq" in str(m) for m in recomputed)


def test_random_ops_stay_saved_under_sc_plus_plus():
    probe = _tags("sc++", model="dropout_tags", make=mixing_model(0.25))
    random = [n for n in probe.tags if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert random and all(probe.tags[n] == MUST_SAVE for n in random)
