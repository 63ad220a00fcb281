"""passes/attention_2d.py on Dynamo graphs of small attention functions (no process group needed)."""

import pytest
import torch
import torch.nn.functional as F

from loong_compile import LoongConfig, LoongUnsupportedError
from loong_compile.ops import attention_2d
from loong_compile.passes.attention_2d import Attention2DPass
from loong_compile.passes.base import PassContext
from conftest import FakeMesh, dynamo_graph

B, H, HKV, S, D = 2, 4, 2, 8, 16


def run_pass(gm, **config):
    ctx = PassContext(config=LoongConfig(hp=2, cp=2, **config), mesh=FakeMesh())
    summary = Attention2DPass().run(gm, ctx)
    return summary, ctx


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def qkv(kv_heads=HKV):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, S, D, generator=g), torch.randn(B, kv_heads, S, D, generator=g),
            torch.randn(B, kv_heads, S, D, generator=g))


def repeat_kv(x, n):  # Hugging Face's
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


@pytest.mark.parametrize("kind", ["enable_gqa", "repeat_kv", "repeat_interleave"])
def test_gqa_call_becomes_attention_2d_on_unrepeated_kv(kind):
    def fn(q, k, v):
        if kind == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2
        if kind == "repeat_kv":
            k, v = repeat_kv(k, H // HKV), repeat_kv(v, H // HKV)
        else:
            k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3) * 2

    gm = dynamo_graph(fn, *qkv())
    summary, ctx = run_pass(gm)
    (node,) = calls(gm, attention_2d)
    assert not [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    q_arg, k_arg, v_arg = node.args
    assert k_arg.meta["example_value"].shape[1] == HKV  # the ring carries H_kv heads, not H
    assert v_arg.meta["example_value"].shape[1] == HKV
    assert node.kwargs["is_causal"] is True and node.kwargs["hp_group"] == "g_hp"
    assert node.kwargs["scale"] == (None if kind == "enable_gqa" else 0.3)
    assert node.meta["example_value"].shape == (B, H, S, D)
    assert "scaled_dot_product_attention" in node.meta["stack_trace"]
    (site,) = summary["changed"]
    assert summary["matched"] == 1 and site["kv_heads"] == HKV and site["heads"] == H
    assert site["kv_unrepeated"] is (kind != "enable_gqa")  # a repeat was removed
    assert "test_attention_pass.py" in site["source"]
    assert site["node"] == node.name
    # the repeat nodes are gone
    assert not [n for n in gm.graph.nodes if n.target in ("expand", "repeat_interleave")]


def test_tile_repeat_is_not_unrepeated():
    """x.repeat(1, n, 1, 1) maps head h to h % H_kv: not repeat_interleave's mapping."""
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)

    gm = dynamo_graph(fn, *qkv())
    summary, _ = run_pass(gm)
    (node,) = calls(gm, attention_2d)
    assert node.args[1].meta["example_value"].shape[1] == H
    assert summary["changed"][0]["kv_unrepeated"] is False


def test_non_causal_and_every_site_rewritten():
    def fn(q, k, v):
        a = F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(a, k, v, is_causal=True)

    gm = dynamo_graph(fn, *qkv(kv_heads=H))
    summary, _ = run_pass(gm)
    nodes = calls(gm, attention_2d)
    assert [n.kwargs["is_causal"] for n in nodes] == [False, True]
    assert summary["matched"] == 2 and len(summary["changed"]) == 2
    gm.graph.lint()


def test_mask_is_refused_with_node_and_source_line():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    gm = dynamo_graph(fn, *qkv(kv_heads=H), torch.ones(S, S, dtype=torch.bool))
    with pytest.raises(LoongUnsupportedError) as e:
        run_pass(gm)
    msg = str(e.value)
    assert "attn_mask" in msg and "test_attention_pass.py" in msg and "fix:" in msg


def test_dropout_is_refused():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    gm = dynamo_graph(fn, *qkv(kv_heads=H))
    with pytest.raises(LoongUnsupportedError, match="dropout_p=0.1"):
        run_pass(gm)


def test_attention_inside_activation_checkpointing_is_rewritten():
    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    def fn(q, k, v):
        return torch.utils.checkpoint.checkpoint(layer, q, k, v, use_reentrant=False)

    gm = dynamo_graph(fn, *qkv(kv_heads=H))
    summary, _ = run_pass(gm)
    assert summary["matched"] == 1 and summary["changed"][0]["inside"] == "tag_activation_checkpoint"
    bodies = [m for m in gm.modules() if m is not gm and isinstance(m, torch.fx.GraphModule)]
    assert sum(len(calls(m, attention_2d)) for m in bodies) == 1
    assert not any(n.target is F.scaled_dot_product_attention for m in bodies for n in m.graph.nodes)


class Windowed(torch.nn.Module):
    """An attention module with transformers' attribute, called without a mask."""

    def __init__(self, window):
        super().__init__()
        self.sliding_window = window

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("window,refused", [(8, True), (31, True), (32, False), (None, False)])
def test_window_shorter_than_the_global_sequence_is_refused(window, refused, monkeypatch):
    from loong_compile.errors import LoongTokenMixingError
    from loong_compile.passes import model_facts

    module = Windowed(window)
    gm = dynamo_graph(module, *qkv(kv_heads=H))  # S=8 per rank, 32 over hp*cp=4 ranks
    monkeypatch.setattr(model_facts, "compiled_module", lambda: module)
    if refused:
        with pytest.raises(LoongTokenMixingError, match=f"sliding_window={window}.*32"):
            run_pass(gm)
    else:
        summary, _ = run_pass(gm)
        assert summary["changed"][0]["sliding_window"] == window


def test_pass_applies_only_when_the_sequence_is_split():
    p = Attention2DPass()
    assert not p.enabled(LoongConfig())
    assert p.enabled(LoongConfig(cp=2)) and p.enabled(LoongConfig(hp=2))
