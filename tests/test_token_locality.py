"""passes/safety/token_locality.py on Dynamo graphs: what mixes tokens is refused, per-token work passes.

The graphs stand for one rank's share (T = 12 tokens) of a sequence split over cp = 2 ranks.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import dynamo_graph
from loong_compile import LoongConfig
from loong_compile.errors import LoongTokenMixingError
from loong_compile.passes.base import PassContext
from loong_compile.passes.safety.token_locality import TokenLocalityPass

B, T, D = 2, 12, 32


def check(fn, *inputs, returned=False, **options):
    """Run the pass on fn's graph; fn's result is computed on (+ 1) unless ``returned``."""
    options.setdefault("allow_graphs_without_attention", True)
    ctx = PassContext(config=LoongConfig(cp=2, **options))
    graph = dynamo_graph(fn if returned else (lambda *a: fn(*a) + 1), *inputs)
    return TokenLocalityPass().run(graph, ctx)


def hidden(width=D):
    return torch.randn(B, T, width)


def labels():
    return torch.randint(0, 10, (B, T))


def test_per_token_work_passes():
    w = torch.randn(D, D)

    def block(x):  # RMSNorm over the feature axis, a projection, an activation
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return F.silu(x @ w).sum() / 1000  # a token sum scaled by a constant stays exact

    summary = check(block, hidden())
    assert summary["tokens_per_rank"] == T and summary["matched"] > 0


def test_feature_axis_equal_to_the_token_count_is_not_a_token_axis():
    x = hidden(width=T)  # hidden size == tokens per rank: the trailing axis is still features
    assert check(lambda x: x.softmax(-1) * x.mean(-1, keepdim=True), x)["matched"] > 0


@pytest.mark.parametrize("name,fn,words", [
    ("shifted labels", lambda labels: F.pad(labels, (0, 1), value=-100)[..., 1:] * 2,
     ["pad", "shift_labels=", "test_token_locality.py"]),
    ("slice", lambda x: x[:, 1:], ["indexing", "token axis 1"]),
    ("last token", lambda x: x[:, -1], ["indexing -1"]),
    ("cumsum", lambda x: x.cumsum(1), ["cumsum along the token axis"]),
    ("roll", lambda x: torch.roll(x, 1, dims=1), ["roll"]),
    ("cat", lambda x: torch.cat([x, x], dim=1), ["cat along the token axis"]),
    ("mean over tokens", lambda x: x.mean(), ["mean over the token axis", "num_items_in_batch"]),
    ("softmax over tokens", lambda x: x.softmax(1), ["softmax along the token axis"]),
    ("eager attention", lambda x: (x @ x.transpose(1, 2)).softmax(-1) @ x,
     ["token x token", "attn_implementation='sdpa'"]),
    ("local positions", lambda x: x + torch.arange(T)[None, :, None], ["arange", "position_ids="]),
])
def test_token_mixing_is_refused(name, fn, words):
    inputs = (labels(),) if name == "shifted labels" else (hidden(),)
    with pytest.raises(LoongTokenMixingError) as info:
        check(fn, *inputs, returned=name == "shifted labels")  # keeps the argument's name
    message = str(info.value)
    assert all(w in message for w in words), message
    assert "fix:" in message and f"{T} tokens per rank" in message


def test_loss_mean_is_refused_and_sum_over_a_global_count_passes():
    logits, y = torch.randn(B, T, 10), labels()
    with pytest.raises(LoongTokenMixingError, match="reduction='mean'"):
        check(lambda a, b: F.cross_entropy(a.flatten(0, 1), b.flatten()), logits, y)
    check(lambda a, b: F.cross_entropy(a.flatten(0, 1), b.flatten(), reduction="sum") / 100,
          logits, y)


def test_dividing_by_a_local_token_count_is_refused():
    def loss(a, b):
        per_token = F.cross_entropy(a.flatten(0, 1), b.flatten(), reduction="none")
        return per_token.sum() / (b != -100).sum()

    with pytest.raises(LoongTokenMixingError, match="truediv of a sum over this rank's tokens"):
        check(loss, torch.randn(B, T, 10), labels())


def test_mixing_inside_activation_checkpointing_is_found():
    def fn(x):
        return torch.utils.checkpoint.checkpoint(lambda y: y.cumsum(1), x, use_reentrant=False)

    with pytest.raises(LoongTokenMixingError, match="cumsum"):
        check(fn, hidden())


def test_values_only_returned_are_reported_not_refused():
    def fn(x):  # a KV cache keeping the last tokens: returned, never computed on
        return x * 2, x[:, -4:]

    summary = check(fn, hidden(), returned=True)
    assert len(summary["local_only_outputs"]) == 1 and "indexing" in summary["local_only_outputs"][0]


def test_custom_ops_on_token_data_must_be_declared_token_local():
    @torch.library.custom_op("loong_test::scale_tokens", mutates_args=())
    def scale_tokens(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    scale_tokens.register_fake(lambda x: torch.empty_like(x))
    fn = lambda x: torch.ops.loong_test.scale_tokens(x) + 1  # noqa: E731
    with pytest.raises(LoongTokenMixingError, match="token_local_ops=\\['loong_test::scale_tokens'\\]"):
        check(fn, hidden())
    torch._dynamo.reset()
    assert check(fn, hidden(), token_local_ops=("loong_test::scale_tokens",))["matched"] > 0


def test_a_graph_without_attention_is_an_error_by_default():
    with pytest.raises(LoongTokenMixingError, match="no attention call.*allow_graphs_without_attention"):
        check(lambda x: x * 2, hidden(), allow_graphs_without_attention=False)
