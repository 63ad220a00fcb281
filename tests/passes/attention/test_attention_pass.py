"""passes/attention/attention_2d.py on Dynamo graphs of small attention functions (no process group needed)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from loong_compile import LoongConfig, LoongConfigError, LoongUnsupportedError
from loong_compile.ops import attention_2d
from loong_compile.passes.attention.attention_2d import Attention2DPass, balanced_exact
from loong_compile.passes.base import PassContext
from graph_helpers import FakeMesh, dynamo_graph
from helpers import hf_masked_attention

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


def test_unproven_mask_is_refused_with_node_and_source_line():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    gm = dynamo_graph(fn, *qkv(kv_heads=H), torch.ones(S, S, dtype=torch.bool))
    with pytest.raises(LoongUnsupportedError) as e:
        run_pass(gm)
    msg = str(e.value)
    assert "attn_mask" in msg and "test_attention_pass.py" in msg and "fix:" in msg
    assert "neither position_ids nor the 2-D attention_mask" in msg


POSITIONS = torch.arange(S).expand(B, -1)
PADDING = torch.ones(B, S, dtype=torch.long)


def _mask_ops(gm) -> list[str]:
    """What is left of a mask's subgraph (transformers': diff/cumsum/arange/index)."""
    return [n.name for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"
            and getattr(n.target, "__name__", "") in ("diff", "arange", "new_ones")]


@pytest.mark.parametrize("padded", [False, True])
def test_transformers_masks_become_document_ids_and_their_subgraph_dies(padded):
    from loong_compile.ops import sequence_document_ids

    kw = {"attention_mask": PADDING} if padded else {}
    gm = dynamo_graph(hf_masked_attention("create_causal_mask"), *qkv(kv_heads=H), POSITIONS, **kw)
    summary, _ = run_pass(gm)
    (call,) = calls(gm, attention_2d)
    docs = call.kwargs["document_ids"]
    made = docs.args[0] if padded else docs       # padding alone: ids of (positions, padding)
    # with padding alone the positions are no input (only the mask read them): the padding
    # numbers the documents, whose numbers are dropped
    assert made.target is sequence_document_ids
    assert made.args[0].name == ("l_attention_mask_" if padded else "l_position_ids_")
    assert (made.args[1] is not None) == padded
    assert padded == (docs.target is torch.clamp)
    assert call.kwargs["is_causal"] is True and "window" not in call.kwargs
    assert not _mask_ops(gm)
    change = summary["changed"][0]
    assert change["mask"]["proven"] == ("causal, key padding from attention_mask" if padded
                                        else "causal, documents from position_ids")
    assert "packed" in change["mask"]["probes"] and change["document_ids"] == docs.name
    # the step's mask plan, made once from those ids, handed to the call
    plan = call.kwargs["mask_plan"]
    assert plan.target is torch.ops.loong.masked_attention_plan.default and plan.args[0] is docs
    assert [d["node"] for d in summary["document_ids"]][-1] == plan.name
    assert len(summary["document_ids"]) == 2 + padded


def test_masked_calls_in_checkpoint_bodies_share_one_document_ids_call():
    from loong_compile.ops import sequence_document_ids
    import transformers.masking_utils as masking
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=16, num_attention_heads=2, attn_implementation="sdpa")

    def layer(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2

    def fn(q, k, v, position_ids):
        mask = masking.create_causal_mask(config=config, inputs_embeds=q[:, 0],
                                          attention_mask=None, past_key_values=None,
                                          position_ids=position_ids)
        for _ in range(2):
            q = torch.utils.checkpoint.checkpoint(layer, q, k, v, mask, use_reentrant=False)
        return q

    gm = dynamo_graph(fn, *qkv(kv_heads=H), POSITIONS)
    summary, _ = run_pass(gm)
    assert len(calls(gm, sequence_document_ids)) == 1 and summary["mask_operands_dropped"] == 2
    assert len(calls(gm, torch.ops.loong.masked_attention_plan.default)) == 1
    bodies = [m for m in gm.modules() if m is not gm and isinstance(m, torch.fx.GraphModule)]
    for body in bodies:
        (call,) = calls(body, attention_2d)
        assert call.kwargs["document_ids"].op == "placeholder"
        assert call.kwargs["mask_plan"].op == "placeholder"
        assert all(p.users for p in body.graph.find_nodes(op="placeholder"))
    assert not _mask_ops(gm)


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


def mla_keys(kv, k_rot, nope):
    """Keys as transformers' DeepSeek-V3 builds them: written in place into an empty tensor."""
    keys = kv.new_empty(*kv.shape[:-1], nope + k_rot.size(-1))
    keys[..., :nope].copy_(kv[..., :nope])
    keys[..., nope:].copy_(k_rot.expand(-1, kv.size(1), -1, -1))
    return keys


def test_value_head_dim_of_its_own_is_carried():
    """MLA: q/k heads of 24, v heads of 16, as SDPA takes them; the output has v's head dim."""
    def fn(q, kv, k_rot):
        v = kv[..., 16:]
        return F.scaled_dot_product_attention(q, mla_keys(kv, k_rot, 16), v, is_causal=True)

    g = torch.Generator().manual_seed(0)
    q, kv, k_rot = (torch.randn(*shape, generator=g) for shape in
                    ((B, H, S, 24), (B, H, S, 32), (B, 1, S, 8)))
    gm = dynamo_graph(fn, q, kv, k_rot)
    summary, _ = run_pass(gm)
    (node,) = calls(gm, attention_2d)
    assert node.meta["example_value"].shape == (B, H, S, 16)
    (site,) = summary["changed"]
    assert (site["head_dim"], site["value_head_dim"]) == (24, 16)
    assert site["scale"] == pytest.approx(24 ** -0.5)  # SDPA's default: q's head dim


@pytest.mark.parametrize("checkpointed", [False, True])
def test_in_place_writes_survive_the_rewrite(checkpointed):
    """The rewrite removes what only the replaced calls read; an in-place write reads as unused
    (nothing takes its result) and must stay: without it the keys are uninitialised memory."""
    def layer(q, kv, k_rot):
        return F.scaled_dot_product_attention(q, mla_keys(kv, k_rot, 8), kv, is_causal=True)

    def fn(q, kv, k_rot):
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(layer, q, kv, k_rot, use_reentrant=False)
        return layer(q, kv, k_rot)

    g = torch.Generator().manual_seed(0)
    q, kv, k_rot = (torch.randn(*shape, generator=g) for shape in
                    ((B, H, S, D), (B, H, S, 16), (B, 1, S, 8)))
    gm = dynamo_graph(fn, q, kv, k_rot)
    run_pass(gm)
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    (call,) = [n for graph in graphs for n in graph.nodes if n.target is attention_2d]
    writes = [n for n in call.graph.nodes if n.target == "copy_"]
    assert len(writes) == 2 and all(w < call for w in writes)


class Windowed(torch.nn.Module):
    """An attention module with transformers' attribute, called without a mask."""

    def __init__(self, window):
        super().__init__()
        self.sliding_window = window

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("window,applied", [(4, "refused"), (8, 8), (31, 31), (32, None),
                                            (None, None)])
def test_a_window_the_local_length_cannot_show_comes_from_the_module(window, applied,
                                                                     monkeypatch):
    from loong_compile.errors import LoongTokenMixingError
    from loong_compile.passes.fx import traced_modules

    module = Windowed(window)
    gm = dynamo_graph(module, *qkv(kv_heads=H))  # S=8 per rank, 32 over hp*cp=4 ranks
    monkeypatch.setattr(traced_modules, "compiled_module", lambda gm: module)
    if applied == "refused":  # transformers builds a mask whenever the window fits the rank
        with pytest.raises(LoongTokenMixingError, match=f"sliding_window={window}.*shorter than "
                                                        "this rank's 8 tokens"):
            run_pass(gm)
        return
    summary, _ = run_pass(gm)
    (call,) = calls(gm, attention_2d)
    assert call.kwargs.get("window") == applied
    assert summary["changed"][0]["window_from"] == (None if applied is None else "module")


def _args_only(forward):
    """A decorator that takes the call as ``*args`` (as transformers 5.24's ``deprecate_kwarg``
    does): Dynamo's frame then holds the model as ``args[0]``, and has no ``self``."""
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapped


class WrappedModel(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.block = torch.nn.ModuleList([Windowed(window)])

    @_args_only
    def forward(self, q, k, v):
        return self.block[0](q, k, v)


GLOBAL_MODEL = WrappedModel(20)


@pytest.mark.parametrize("how", ["wrapped_forward", "global_in_step", "local_in_step"])
def test_the_attention_module_is_found_however_the_model_is_reached(how):
    """transformers 5.24 wraps ``forward``: a window read only from ``L['self']`` was lost and
    Qwen2/Mistral windows ran as full causal attention (the trust matrix's windowed cases)."""
    from loong_compile.passes.attention import model_facts
    from loong_compile.passes.fx import traced_modules

    found = []

    def backend(gm, example_inputs):
        root = traced_modules.compiled_module(gm)
        (node,) = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
        found.append((root, traced_modules.module_of(root, node)))
        return gm.forward

    local_model = WrappedModel(20)
    model, fn = {"wrapped_forward": (GLOBAL_MODEL, GLOBAL_MODEL),
                 "global_in_step": (GLOBAL_MODEL, lambda q, k, v: GLOBAL_MODEL(q, k, v)),
                 "local_in_step": (local_model, lambda q, k, v: local_model(q, k, v))}[how]
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*qkv(kv_heads=H))
    ((root, attention),) = found
    assert root is model and attention is model.block[0]
    assert model_facts.sliding_window(attention, root) == 20


def test_an_attention_module_that_cannot_be_found_is_refused_not_taken_as_windowless(monkeypatch):
    from loong_compile.errors import LoongTokenMixingError
    from loong_compile.passes.fx import traced_modules

    gm = dynamo_graph(WrappedModel(20), *qkv(kv_heads=H))  # path L['args'][0].block.0
    monkeypatch.setattr(traced_modules, "compiled_module", lambda gm: None)  # outside the frame
    with pytest.raises(LoongTokenMixingError, match="cannot find.*sliding window"):
        run_pass(gm)


def test_a_scale_dynamo_made_symbolic_is_read_as_the_number_it_is():
    """Issue 23 item 10: a second model running the same attention code with another scale
    made Dynamo recompile with the float as a symbol, which was refused as not constant."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(q, k, v, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=capture, fullgraph=True)
    q, k, v = qkv(kv_heads=H)
    compiled(q, k, v, 0.25)
    compiled(q, k, v, 0.5)                     # automatic dynamic: the scale is a SymFloat now
    gm = graphs[-1]
    assert any(isinstance(n.meta.get("example_value"), torch.SymFloat) for n in gm.graph.nodes)
    summary, _ = run_pass(gm)
    (call,) = calls(gm, attention_2d)
    assert call.kwargs["scale"] == 0.5
    assert summary["changed"][0]["scale_specialised"] is True


class WindowedMask(torch.nn.Module):
    """transformers' sliding-window mask over packed positions, in a module declaring it."""

    def __init__(self, window):
        super().__init__()
        self.sliding_window = window
        self.attend = hf_masked_attention("create_sliding_window_causal_mask", window)

    def forward(self, q, k, v, position_ids):
        return self.attend(q, k, v, position_ids)


@pytest.mark.parametrize("window,declared,applied", [
    (5, 5, 5),          # shorter than a rank's 8 tokens: the probes see it
    (20, 20, 20),       # between a rank's 8 and the sequence's 32 tokens: from the module
    (5, 6, "refused"),  # the mask and the module disagree
])
def test_sliding_window_masks_take_the_window_of_the_mask_or_the_module(
        window, declared, applied, monkeypatch):
    from loong_compile.errors import LoongTokenMixingError
    from loong_compile.passes.fx import traced_modules

    module = WindowedMask(window)
    gm = dynamo_graph(module, *qkv(kv_heads=H), POSITIONS)
    module.sliding_window = declared
    monkeypatch.setattr(traced_modules, "compiled_module", lambda gm: module)
    if applied == "refused":
        with pytest.raises(LoongTokenMixingError, match="sliding_window=6.*the mask's window is 5"):
            run_pass(gm)
        return
    summary, _ = run_pass(gm)
    (call,) = calls(gm, attention_2d)
    assert call.kwargs["window"] == applied and "document_ids" in call.kwargs
    assert summary["changed"][0]["window_from"] == ("mask" if window < S else "module")


def test_one_rank_rewrites_the_masks_it_proves_and_keeps_every_other_call():
    """hp = cp = 1 (issue 36): a mask the pass proves becomes the masked op on one rank (the S x S
    mask's subgraph dies); a mask it does not prove, and a call without a mask, stay as they
    are (nothing is refused where one rank holds the whole sequence)."""
    ctx = PassContext(config=LoongConfig(), mesh=None)
    assert Attention2DPass().enabled(ctx.config)
    gm = dynamo_graph(hf_masked_attention("create_causal_mask"), *qkv(kv_heads=H), POSITIONS,
                      attention_mask=PADDING)
    summary = Attention2DPass().run(gm, ctx)
    (call,) = calls(gm, attention_2d)
    assert call.kwargs["hp"] == call.kwargs["cp"] == 1 and "document_ids" in call.kwargs
    assert not _mask_ops(gm) and not summary["kept"]
    assert summary["changed"][0]["mask"]["proven"] == "causal, key padding from attention_mask"

    def fn(q, k, v, mask):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                + F.scaled_dot_product_attention(q, k, v, is_causal=True))

    gm = dynamo_graph(fn, *qkv(kv_heads=H), torch.ones(S, S, dtype=torch.bool))
    summary = Attention2DPass().run(gm, ctx)
    assert not calls(gm, attention_2d) and summary["matched"] == 1 and not summary["changed"]
    (kept,) = summary["kept"]
    assert "neither position_ids nor the 2-D attention_mask" in kept["reason"]
    assert len([n for n in gm.graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention
                or n.target is F.scaled_dot_product_attention]) == 2


def test_one_rank_with_head_groups_groups_the_calls_it_rewrites():
    """hp = cp = 1 with head_groups (issue 52): a call whose mask the pass rewrites runs its
    heads a group at a time and the report says so; a call without a mask stays SDPA; a count
    that splits a KV head's query heads is the option's error, refused on one rank too."""
    masked_call = hf_masked_attention("create_causal_mask")
    ctx = PassContext(config=LoongConfig(head_groups=2), mesh=None)
    gm = dynamo_graph(masked_call, *qkv(kv_heads=H), POSITIONS, attention_mask=PADDING)
    summary = Attention2DPass().run(gm, ctx)
    (call,) = calls(gm, attention_2d)
    assert call.kwargs["head_groups"] == 2 and call.kwargs["hp"] == call.kwargs["cp"] == 1
    assert summary["changed"][0]["head_groups"] == 2 and not summary["kept"]

    def plain(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = dynamo_graph(plain, *qkv(kv_heads=H))
    assert not calls(gm, attention_2d) and not Attention2DPass().run(gm, ctx)["matched"]
    bad = PassContext(config=LoongConfig(head_groups=3), mesh=None)
    with pytest.raises(LoongConfigError, match=r"head_groups=3 .*fix: use head_groups in \[1, 2, 4\]"):
        Attention2DPass().run(dynamo_graph(masked_call, *qkv(kv_heads=H), POSITIONS,
                                           attention_mask=PADDING), bad)


def test_the_balanced_order_is_exact_only_where_every_call_reads_documents_causally():
    """The fact the input check reads (checks/inputs.py): shard_batch's balanced document order
    passes only to a graph whose every attention is a causal mask of documents from the
    positions, with at least one such call (sequence_document_ids verifies the order there)."""
    documents = {"is_causal": True, "documents_alone": True}
    assert balanced_exact([documents, documents])
    assert not balanced_exact([])
    assert not balanced_exact([documents, {"is_causal": True, "documents_alone": False}])
    assert not balanced_exact([documents, {"is_causal": False, "documents_alone": True}])


@pytest.mark.parametrize("config,expected", [
    ({}, None),                                        # Falcon-H1's "hybrid": no window anywhere
    ({"sliding_window": 64}, "UnknownLayerType"),      # a window it might apply: refused
    ({"attention_chunk_size": 16}, "UnknownLayerType"),
])
def test_a_layer_type_it_does_not_know_is_full_only_where_nothing_keeps_a_window(config, expected):
    from types import SimpleNamespace

    from loong_compile.passes.attention import model_facts

    attention = SimpleNamespace(layer_idx=0, config=SimpleNamespace(layer_types=["hybrid"], **config))
    if expected is None:
        assert model_facts.sliding_window(attention, None) is None
    else:
        with pytest.raises(model_facts.UnknownLayerType, match="hybrid"):
            model_facts.sliding_window(attention, None)
