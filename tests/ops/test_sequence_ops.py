"""The whole-sequence values of ``loong_compile/ops/sequence.py`` on 2 and 4 gloo ranks against
one process: the next token's label, the label count, the layout's positions.

Every layout the mesh makes (cp only, hp only, both, and the zigzag with hp inside each CP
shard), labels with ``-100`` scattered and on rank boundaries, two batch rows: each rank's
result must be one process's value at that rank's tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong_compile.testing import run_distributed

pytestmark = pytest.mark.multirank  # spawns gloo ranks (pytest -m 'not multirank' leaves it out)

SEQ = 48


def full_labels() -> torch.Tensor:
    labels = torch.randint(0, 50, (2, SEQ), generator=torch.Generator().manual_seed(3))
    labels[0, ::5] = -100          # some on rank and chunk boundaries
    labels[1, SEQ // 2] = -100
    return labels


def _on_rank(rank: int, world: int, hp: int, cp: int) -> dict[str, bool]:
    import loong_compile as lc
    from loong_compile.ops.sequence import layout_positions, next_token_labels, sequence_label_count
    from loong_compile.parallel.tokens import mesh_token_indices

    mesh = lc.init_mesh(hp=hp, cp=cp)
    groups = mesh.document_kwargs()
    labels = full_labels()
    index = mesh_token_indices(SEQ, mesh)
    local = labels[:, index].contiguous()
    shifted = F.pad(labels, (0, 1), value=-7)[..., 1:]   # one process's shift, any fill
    mine = next_token_labels(local, -7, **groups)
    count = sequence_label_count(local, -100, sp_group=mesh.group_names["sp"])
    positions = layout_positions(local.size(1), hp=hp, cp=cp, hp_group=groups["hp_group"],
                                 cp_group=groups["cp_group"], device=torch.device("cpu"))
    return {"shift": torch.equal(mine, shifted[:, index]),
            "count": int(count) == int((labels != -100).sum()),
            "positions": torch.equal(positions, index),
            "dtype": mine.dtype == local.dtype and count.dim() == 0}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hp,cp", [(2, 1), (2, 2), (1, 4)])
def test_each_rank_gets_one_process_values_at_its_tokens(hp, cp):
    results = run_distributed(_on_rank, hp * cp, hp, cp, timeout=240)
    failing = {rank: [k for k, ok in r.items() if not ok] for rank, r in enumerate(results)
               if not all(r.values())}
    assert not failing, f"hp={hp}, cp={cp}: ranks differ from one process in {failing}"
