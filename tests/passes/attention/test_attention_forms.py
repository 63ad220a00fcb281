"""Where attention hides in a model, on 2 gloo ranks (cp=2) against one process, float64.

Attention inside activation checkpointing is rewritten and exact; ``nn.MultiheadAttention``
(which Dynamo keeps as one opaque call, with or without weights) and ``flex_attention`` are
refused with a named error.  Each case is a one-step training run: loss and gradients summed
over the ranks equal one process's on the full sequence.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from helpers import STAND_INS, loong_error_in
from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

B, S, D, HEADS = 2, 32, 16, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).flatten(-2))


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


class MultiheadAttention(torch.nn.Module):
    def __init__(self, need_weights: bool):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(D, HEADS, batch_first=True, dtype=torch.float64)
        self.need_weights = need_weights

    def forward(self, x):
        return self.mha(x, x, x, need_weights=self.need_weights)[0]


class FlexAttention(Block):
    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.out(flex_attention(q, k, v).transpose(1, 2).flatten(-2))


class FlashAttn(Block):
    """flash_attn_func as models call it: (B, S, H, D), GQA by fewer KV heads (the stand-in)."""

    def forward(self, x):
        from flash_attn import flash_attn_func

        q, k, v = (t.unflatten(-1, (HEADS, -1)) for t in self.qkv(x).chunk(3, -1))
        y = flash_attn_func(q, k[:, :, :2], v[:, :, :2], causal=True)
        return x + self.out(y.flatten(-2))


MODELS = {"checkpointed_sdpa": lambda: Checkpointed(), "flash_attn_func": lambda: FlashAttn(),
          "mha_sdpa_path": lambda: MultiheadAttention(need_weights=False),
          "mha_weights": lambda: MultiheadAttention(need_weights=True),
          "flex_attention": lambda: FlexAttention()}
# the one-process reference of flash-attn (the stand-in) keeps its LSE in float32, as flash-attn
FLOAT32_INSIDE = {"flash_attn_func": 1e-6}
REFUSED = {"mha_sdpa_path": ["multi_head_attention_forward", "scaled_dot_product_attention"],
           "mha_weights": ["multi_head_attention_forward"], "flex_attention": ["flex_attention"]}


def _model(name):
    torch.manual_seed(0)
    return MODELS[name]().double().train()


def _inputs():
    return torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _step(model, x, forward=None):
    loss = (model if forward is None else forward)(x).pow(2).sum() / (B * S)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _on_ranks(rank, world, names):
    import torch.distributed as dist

    import loong_compile as lc
    from loong_compile.parallel.tokens import mesh_token_indices

    sys.path.insert(0, str(STAND_INS))  # the flash-attn 2.8 stand-in, for this rank only
    mesh = lc.init_mesh(cp=world)
    index = mesh_token_indices(S, mesh)
    results = {}
    for name in names:
        torch._dynamo.reset()
        model = _model(name)
        compiled = torch.compile(model, backend="loong",
                                 options={"cp": world, "lowering": "aot_eager"})
        try:
            if name == "flex_attention":  # no CPU backward in torch: the forward shows it
                with torch.no_grad():
                    compiled(_inputs()[:, index].contiguous())
            loss, grads = _step(model, _inputs()[:, index].contiguous(), compiled)
        except Exception as exc:  # noqa: BLE001
            error = loong_error_in(exc)
            if error is None:
                raise
            results[name] = ("refused", type(error).__name__, str(error))
            continue
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
        results[name] = ("ok", loss.item(), {n: g.numpy() for n, g in grads.items()})
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(_on_ranks, 2, list(MODELS), timeout=400)[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_attention_form(outcomes, name, stand_ins):
    outcome = outcomes[name]
    if name in REFUSED:
        assert outcome[0] == "refused", f"{name} ran instead of being refused"
        assert outcome[1] == "LoongTokenMixingError" and "fix:" in outcome[2]
        assert all(w in outcome[2] for w in REFUSED[name]), outcome[2]
        return
    assert outcome[0] == "ok", outcome
    ref_loss, ref_grads = _step(_model(name), _inputs())
    rtol = FLOAT32_INSIDE.get(name, 1e-10)
    assert abs(outcome[1] - ref_loss.item()) <= rtol * abs(ref_loss.item())
    for param, grad in ref_grads.items():
        torch.testing.assert_close(torch.from_numpy(outcome[2][param]), grad, rtol=rtol * 10,
                                   atol=rtol * 1e-2)
