"""What the input checks share: one exchange per call, so that every rank of the sequence raises
the same error before the graph's first collective, or none does.

A check (``RankCheck``) finds some numbers on its rank (its ``rows``: a verdict, a checksum, a
flag from ``shard_batch``'s record) and judges the numbers of every rank of the sequence.  A call
exchanges the findings of all its checks at once: each rank writes its column of one
``(rows, sp)`` float64 tensor, zeros elsewhere, and one all-reduce over the sequence's group
gives every rank the whole table (a sum of one value and zeros is that value, exactly), read on
the host once.  The checks then judge the same table in the same order on every rank, so the
first that fails raises the same error everywhere.  A check that has nothing to compare at a
call (``wanted`` False: positions already verified) leaves the exchange; a call no check wants
exchanges nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from loong_compile._compat.distributed import resolve_process_group


class RankCheck:
    """One check of a call's arguments, made on every rank of the sequence."""

    rows = 1

    def wanted(self, args: Sequence[Any]) -> bool:
        """Whether this call needs the check (decided alike on every rank, from the arguments'
        identities, never their values)."""
        return True

    def local(self, args: Sequence[Any]) -> torch.Tensor | Sequence[float]:
        """This rank's ``rows`` numbers (on the arguments' device, or host values)."""
        raise NotImplementedError

    def judge(self, found: list[list[float]], args: Sequence[Any]) -> None:
        """Raise, on every rank alike, from ``found``: ``rows`` lists of one number per rank of
        the sequence, in the order of ``mesh.sp_ranks``."""
        raise NotImplementedError


def agree(checks: Sequence[RankCheck], args: Sequence[Any], mesh: Any) -> None:
    """Run ``checks`` on this call's ``args``: one all-reduce for all of them, then each judges."""
    wanted = [check for check in checks if check.wanted(args)]
    if not wanted:
        return
    device = _device_of(args)
    place = mesh.sp_ranks.index(mesh.rank)
    found = torch.zeros(sum(check.rows for check in wanted), mesh.sp, dtype=torch.float64,
                        device=device)
    row = 0
    for check in wanted:
        mine = check.local(args)
        mine = mine if isinstance(mine, torch.Tensor) else torch.tensor(mine, dtype=torch.float64)
        found[row:row + check.rows, place] = mine.to(device, torch.float64)
        row += check.rows
    dist.all_reduce(found, group=resolve_process_group(mesh.group_names["sp"]))
    table = found.tolist()
    row = 0
    for check in wanted:
        check.judge(table[row:row + check.rows], args)
        row += check.rows


def _device_of(args: Sequence[Any]) -> torch.device:
    """Where the exchange runs: the first argument off the host (NCCL's device), else the host."""
    devices = [a.device for a in args if isinstance(a, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
