"""Masked blocks on flex_attention (ops/attention/flex.py), on the CPU.

The forward runs torch's eager ``flex_attention`` with the plan's ``BlockMask`` of each block
(flex's CPU forward) against the dense reference; the backward, which flex has not on CPU,
runs its contract: a differentiable stand-in that computes what flex computes (the scores
masked by the BlockMask's own ``mask_mod``, the output and the LSE) takes flex's place, so the
gradient through the merge of the blocks and the masks of the plan are what is checked.
gpu-check runs the real kernel both ways.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from helpers import masked_reference, masked_relative_error
from loong_compile.ops import attention_2d, masked_attention_plan
from loong_compile.ops.attention import flex, kernels
from loong_compile.ops.masks import step as step_mask
from loong_compile.ops.masks.documents import number_documents
from loong_compile.parallel.balance import balanced_order

pytestmark = pytest.mark.compat  # flex_attention's API moves between torch versions

SEQ, BATCH = 64, 2
CASES = {  # name: (document ids (B, S), is_causal, window)
    "documents": (torch.tensor([[0] * 13 + [1] * 30 + [2] * 21, [0] * 40 + [1] * 24]), True, None),
    "padding and documents": (torch.tensor([[-1] * 5 + [0] * 27 + [1] * 32,
                                            [0] * 50 + [-1] * 14]), True, None),
    "window": (None, True, 11),
    "documents and window": (torch.tensor([[0] * 24 + [1] * 40] * 2), True, 9),
    "documents, not causal": (torch.tensor([[0] * 24 + [1] * 40, [0] * 7 + [1] * 57]), False, None),
}


def _balanced(cp: int = 2):
    """Documents of 9, 20 and 27 tokens (and 8 of room) in shard_batch's balanced order for
    cp = 2: their ids as sequence_document_ids reads them, and their positions."""
    starts = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    starts[:, [0, 9, 29]] = True
    real = (torch.arange(SEQ) < 56).expand(BATCH, SEQ)
    order = balanced_order(starts & real, real, cp)
    return number_documents(order.positions, None, 1, cp), order.positions


BALANCED_IDS, BALANCED_POSITIONS = _balanced()
CASES["balanced documents and window"] = (BALANCED_IDS, True, 7)
POSITIONS = {"balanced documents and window": BALANCED_POSITIONS}


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """Masked blocks take the flex path on the CPU; returns the count of flex calls."""
    calls = {"forward": 0, "backward": 0}
    monkeypatch.setattr(step_mask, "uses_flex", lambda like: True)
    for name in calls:
        original = getattr(kernels, f"flex_{name}")

        def counted(*args, _original=original, _name=name):
            calls[_name] += 1
            return _original(*args)
        monkeypatch.setattr(kernels, f"flex_{name}", counted)
    return calls


def dense_flex(q, k, v, mask, scale):
    """What flex_attention(..., return_lse=True) computes, differentiable on the CPU."""
    allowed = create_mask(mask.mask_mod, q.size(0) if mask.shape[0] > 1 else 1, 1,
                          q.size(2), k.size(2), device=q.device)
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))
    return probs @ v, lse


def qkv_dout(heads: int, kv_heads: int, head_dim: int, v_head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, h, SEQ, d, generator=gen, dtype=torch.float64)
            for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, v_head_dim),
                         (heads, v_head_dim))]


@pytest.mark.parametrize("case", CASES)
def test_flex_forward_with_the_plans_block_masks_equals_the_reference(flex_on_cpu, case):
    ids, is_causal, window = CASES[case]
    q, k, v, dout = qkv_dout(4, 2, 16, 16)
    handle = masked_attention_plan(ids, SEQ, is_causal, window or 0, 1, "")
    for _ in range(2):  # two layers of one step: the block masks are made once
        out, lse = attention_2d(q, k, v, is_causal=is_causal, document_ids=ids, window=window,
                                mask_plan=handle, return_lse=True)
    want_out, want_lse, *_ = masked_reference(q, k, v, dout, ids, is_causal, window,
                                              POSITIONS.get(case))
    assert masked_relative_error(out, want_out) < 1e-12
    assert masked_relative_error(lse, want_lse) < 1e-12
    mask = step_mask._STEP_MASKS[handle]
    partial = [b for b in mask.mine.blocks if not b.full]
    assert partial and flex_on_cpu["forward"] == 2 * len(partial)
    assert set(mask._flex_masks) == set(partial)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_heads,v_head_dim", [(2, 16), (4, 24)])
def test_flex_backward_through_the_merge_equals_the_reference(flex_on_cpu, monkeypatch, case,
                                                              kv_heads, v_head_dim):
    monkeypatch.setattr(flex, "_flex", dense_flex)
    ids, is_causal, window = CASES[case]
    q, k, v, dout = qkv_dout(4, kv_heads, 16, v_head_dim, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_2d(*leaves, is_causal=is_causal, document_ids=ids, window=window)
    grads = torch.autograd.grad(out, leaves, dout)
    want_out, _, *want_grads = masked_reference(q, k, v, dout, ids, is_causal, window,
                                                POSITIONS.get(case))
    assert masked_relative_error(out, want_out) < 1e-12
    for name, got, want in zip("qkv", grads, want_grads):
        assert masked_relative_error(got, want) < 1e-10, name
    assert flex_on_cpu["backward"] == flex_on_cpu["forward"] > 0
