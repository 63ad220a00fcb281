"""``lc.hf.compile_blocks``'s contract, in one process: its options are checked when it is
called, not at the first forward, and a model's blocks are compiled once.

Its numbers (issue 51) are trust-matrix cells: at hp=2 x cp=2 under Inductor with sc++ and memo,
beside blocks compiled by hand (``tests/test_trust_matrix_inductor.py``, the blocks' cells).
"""

from __future__ import annotations

import pytest
import torch

from trust_cases import Case, case_model

pytest.importorskip("transformers")


def test_an_unknown_option_is_refused_when_compile_blocks_is_called():
    import loong_compile as lc

    with pytest.raises(lc.LoongConfigError, match="activation"):
        lc.hf.compile_blocks(case_model(Case("llama"), torch.float32), activation="sc++")


def test_a_models_blocks_are_compiled_once():
    import loong_compile as lc

    model = lc.hf.compile_blocks(case_model(Case("llama"), torch.float32), lowering="aot_eager")
    with pytest.raises(lc.LoongConfigError, match="called twice"):
        lc.hf.compile_blocks(model, lowering="aot_eager")
