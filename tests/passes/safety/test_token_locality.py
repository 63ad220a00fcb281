"""passes/safety/token_locality.py on Dynamo graphs: what mixes tokens is refused, per-token work passes.

The graphs stand for one rank's share (T = 12 tokens) of a sequence split over cp = 2 ranks.
"""

import pytest
import torch
import torch.nn.functional as F

from graph_helpers import dynamo_graph
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


def _write_first_token(x):
    y = x.clone()
    y[:, 0] = 0.0
    return y


def _write_first_feature(x):
    y = x.clone()
    y[:, :, 0] = 0.0
    return y


@pytest.mark.parametrize("name,fn,words", [
    ("gram over tokens", lambda x: x.transpose(1, 2) @ x, ["matmul sums over a token axis"]),
    ("bmm over tokens", lambda x: torch.bmm(x.transpose(1, 2), x), ["bmm sums over a token axis"]),
    ("einsum over tokens", lambda x: torch.einsum("btd,bte->bde", x, x),
     ["einsum sums over a token axis"]),
    ("tokens moved last, viewed back", lambda x: x.transpose(1, 2).reshape(B, T, D),
     ["makes a token-sized axis", "moved last"]),
    ("write to the first token", _write_first_token, ["indexing 0 on the token axis 1"]),
    ("index_fill along tokens", lambda x: x.index_fill(1, torch.tensor([0]), 0.0),
     ["index_fill along the token axis 1"]),
])
def test_what_sums_writes_or_reshapes_across_tokens_is_refused(name, fn, words):
    """Silently wrong before: the local sum over a rank's tokens (a product contracting them),
    a write at a local token index, and a view that interleaves tokens with features were let
    through (their results carry no token-sized axis, or the write's node no user)."""
    with pytest.raises(LoongTokenMixingError) as info:
        check(fn, hidden())
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("name,fn", [
    ("write to a feature", _write_first_feature),
    ("per-token dot product", lambda x: (x.unsqueeze(-2) @ x.unsqueeze(-1)).squeeze(-1)),
    ("per-token outer product over a token-sized feature axis",
     lambda x: torch.einsum("btd,bte->btde", x, x).sum(-1)),
    ("per-token values flattened", lambda x: (x.sum(-1) * 2).view(-1)),
    # a weight whose size is a multiple of the tokens (Falcon's x @ W.T, FFN 2T wide)
    ("weight of token size", lambda x: x @ torch.ones(20, 2 * T).T),
])
def test_per_token_products_writes_and_views_pass(name, fn):
    assert check(fn, hidden(width=2 * T))["matched"] > 0


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


# -- a mixture of experts' dispatch: rows sorted by expert, grouped matmuls, the inverse ---------

EXPERTS, PER_TOKEN, INNER = 4, 2, 48
BIAS = torch.randn(EXPERTS, INNER).to(torch.bfloat16)


def experts_inputs():
    """Hidden states and the router's and experts' weights, in bfloat16 (torch's grouped_mm
    traces no other dtype on CPU)."""
    torch.manual_seed(0)
    return [t.to(torch.bfloat16) for t in (hidden(), torch.randn(D, EXPERTS),
                                            torch.randn(EXPERTS, D, INNER) / 8,
                                            torch.randn(EXPERTS, INNER, D) / 8)]


def dispatch(x, router, up, down, variant="as transformers"):
    """transformers' grouped_mm experts (integrations/moe.py), written out, with one step
    changed by ``variant``."""
    h = x.view(-1, D)
    weights, ids = (h @ router).softmax(-1).topk(PER_TOKEN, dim=-1)
    ids, weights = ids.reshape(-1), weights.reshape(-1)
    ids_s, perm = torch.sort(ids, descending=variant == "descending")
    groups = {"unsorted offsets": ids, "offsets of other ids": torch.sort((ids + 1) % EXPERTS)[0]
              }.get(variant, ids_s)
    offsets = torch.cumsum(torch.histc(groups.float(), bins=EXPERTS, min=0, max=EXPERTS - 1),
                           dim=0, dtype=torch.int32)
    if variant == "constant offsets":
        offsets = torch.tensor([12, 24, 36, 48], dtype=torch.int32)
    first = F.grouped_mm(h[perm // PER_TOKEN], up, offs=offsets)
    if variant == "bias added in place":   # gpt-oss's experts: out.add_(bias[expert_ids_g])
        first.add_(BIAS[ids_s])
    if variant == "written in place through a view":
        first[:, :INNER // 2].mul_(2.0)
    rows = F.grouped_mm(F.silu(first), down, offs=offsets) * weights[perm].unsqueeze(-1)
    if variant == "mixed with unpermuted rows":
        rows = rows + h.repeat_interleave(PER_TOKEN, dim=0)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    back = {"not inverted": rows, "gathered back by the permutation": rows[perm]}.get(
        variant, rows[inverse])
    return back.view(-1, PER_TOKEN, D).sum(1).view_as(x)


@pytest.mark.parametrize("variant", ["as transformers", "bias added in place"])
def test_expert_dispatch_is_proven_token_local(variant):
    summary = check(lambda *a: dispatch(*a, variant=variant), *experts_inputs())
    (proof,) = summary["row_permutations"]
    assert "expert dispatch proven token-local" in proof and "2 grouped matmuls" in proof
    assert "test_token_locality.py" in proof  # where the sort is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_grouped_mm_experts_are_proven_token_local(dtype):
    # float32 compiles to transformers' grouped_mm_fallback op, bfloat16 to torch._grouped_mm
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    block = MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=D, intermediate_size=INNER, num_local_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN, experts_implementation="grouped_mm")).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    (proof,) = check(block, hidden().to(dtype))["row_permutations"]
    assert "integrations/moe.py" in proof and "2 grouped matmuls" in proof


UNPROVEN = ("sort along the token axis 0 of (48,) mixes or moves tokens (not a row permutation "
            "proven undone")


@pytest.mark.parametrize("variant,words", [
    ("descending", ["sort along the token axis"]),  # not the order histc's offsets count in
    ("unsorted offsets", ["histc counts over the token axis"]),
    ("offsets of other ids", [UNPROVEN, "grouped_mm's groups are not the running counts"]),
    ("constant offsets", [UNPROVEN, "grouped_mm's groups are not the running counts"]),
    ("not inverted", [UNPROVEN, "does not keep the permuted rows as the first axis"]),
    ("gathered back by the permutation", [UNPROVEN, "gathers rows the proof cannot align"]),
    ("mixed with unpermuted rows", [UNPROVEN, "combines the permuted rows with"]),
    ("written in place through a view", [UNPROVEN, "writes into permuted rows in place"]),
])
def test_a_dispatch_outside_the_proof_is_refused(variant, words):
    with pytest.raises(LoongTokenMixingError) as info:
        check(lambda *a: dispatch(*a, variant=variant), *experts_inputs())
    message = str(info.value)
    assert all(w in message for w in words) and "fix:" in message, message


def test_counting_over_tokens_is_refused():
    with pytest.raises(LoongTokenMixingError, match="histc counts over the token axis"):
        check(lambda x: x * torch.histc(x.argmax(-1).float(), bins=4, min=0, max=3).sum(), hidden())


def test_looking_up_weights_by_token_ids_and_batching_matmuls_over_tokens_pass():
    # transformers' batched_mm experts: each token's expert weights, one matmul per token
    up = torch.randn(EXPERTS, INNER * 2, D)

    def batched(x, ids):
        return torch.bmm(up[ids.reshape(-1)], x.reshape(-1, D, 1)).squeeze(-1)

    assert check(batched, hidden(), torch.randint(0, EXPERTS, (B, T)))["matched"] > 0


def test_the_routers_load_balancing_loss_is_refused_by_name():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    with pytest.raises(LoongTokenMixingError) as info:
        check(lambda logits: load_balancing_loss_func((logits,), EXPERTS, PER_TOKEN),
              torch.randn(B * T, EXPERTS))
    message = str(info.value)
    assert "load-balancing loss" in message and "output_router_logits=False" in message, message
