"""Point-to-point and all-to-all transfers of the 2D-Attention ops, with byte counters.

The counters live here because every byte the ops send goes through these two
functions; they run inside the custom ops' eager implementations, so they
count real traffic also when the ops sit in a compiled graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loong_compile._compat import resolve_process_group

_BYTES = {"all_to_all": 0, "p2p": 0}


def comm_counters() -> dict[str, int]:
    """Bytes this rank has sent to other ranks since the last reset: ``all_to_all`` and ``p2p``."""
    return dict(_BYTES)


def reset_comm_counters() -> None:
    for kind in _BYTES:
        _BYTES[kind] = 0


def group(name: str) -> dist.ProcessGroup:
    return resolve_process_group(name)


class Exchange:
    """One ring hop in flight: ``tensor`` going to ``next``, one like it coming from ``prev``."""

    def __init__(self, tensor: torch.Tensor, group_name: str, next_rank: int, prev_rank: int):
        pg = group(group_name)
        self._received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, group=pg, group_peer=next_rank),
               dist.P2POp(dist.irecv, self._received, group=pg, group_peer=prev_rank)]
        self._works = dist.batch_isend_irecv(ops)
        _BYTES["p2p"] += tensor.numel() * tensor.element_size()

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._received


def all_to_all(send: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """``all_to_all_single`` of equal splits along dim 0; counts the bytes leaving this rank."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group(group_name))
    _BYTES["all_to_all"] += send.numel() * send.element_size() * (group_size - 1) // group_size
    return received
