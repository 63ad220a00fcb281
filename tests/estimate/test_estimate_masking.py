"""The estimator's closed forms for documents and windows, against the runtime's plan."""

from __future__ import annotations

import pytest
import torch

from helpers import allowed_pairs
from loong_compile.cli import main
from loong_compile.estimate.masking import causal_pairs, kv_chunk_fraction
from loong_compile.ops.masks.blocks import mask_plan


def equal_documents(seq: int, length: int) -> torch.Tensor:
    return (torch.arange(seq) // length).unsqueeze(0)


@pytest.mark.parametrize("seq,window,length", [(64, None, None), (64, 8, None), (64, None, 16),
                                               (64, 5, 16), (96, 40, 32), (96, 200, 48)])
def test_causal_pairs_counts_what_the_mask_allows(seq, window, length):
    """m^2/2 + (L-m)m per document of L, m = min(window, L) (LoongTrain's s^2/2 convention):
    the exact count less half the diagonal band's edge, m/2 per document."""
    length = length or seq
    reach = min(window or length, length)
    exact = int(allowed_pairs(equal_documents(seq, length), True, window).sum())
    assert causal_pairs(seq, window, length) == pytest.approx(exact - seq / length * reach / 2)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("window,length", [(None, None), (8, None), (12, None), (33, None),
                                           (None, 16), (None, 24), (20, 32)])
def test_kv_fraction_is_the_plans_busiest_rank(cp, window, length):
    """Windows alone: equal to the chunks the plan has the busiest rank serve; with documents
    an upper bound (the closed form lets documents start anywhere)."""
    seq = 192
    ids = equal_documents(seq, length or seq)
    plan = mask_plan(ids, True, window, cp, tiles_per_chunk=1)
    served = max(sum(len(r) for r in plan.serves(rank).values()) for rank in range(cp))
    from_plan = served / (2 * (cp - 1))
    closed = kv_chunk_fraction(seq, cp, window, length)
    if length is None:
        assert closed == pytest.approx(from_plan)
    else:
        assert from_plan <= closed + 1e-12


def test_cli_says_what_it_assumed(capsys):
    main(["estimate", "--model", "7b-gqa", "--seq", "65536", "--cp", "8", "--capacity-gib", "80",
          "--window", "8192", "--doc-length", "4096"])
    out = " ".join(capsys.readouterr().out.split())
    assert "documents of 4096 tokens" in out and "window of 8192 tokens" in out
    assert f"FLOPs x{causal_pairs(65536, 8192, 4096) / causal_pairs(65536, None, None):.3f}" in out
    assert f"bytes x{kv_chunk_fraction(65536, 8, 8192, 4096):.3f}" in out
