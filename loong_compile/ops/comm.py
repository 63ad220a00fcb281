"""Point-to-point transfers of the 2D-Attention ops and the byte counters of all their traffic.

Ring and masked-exchange bytes are counted in ``Exchange`` / ``DirectExchange``, which
run inside the custom ops' eager implementations, so they count real traffic also when
the ops sit in a compiled graph.  The SeqAlltoAll and the scans' all-gather are functional
collectives (ops/attention/alltoall.py, ops/scans/exchange.py): their bytes are counted when they run
eagerly; in a compiled graph Inductor runs them, and the generated code, not this counter,
shows them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from loong_compile._compat.distributed import is_tracing, resolve_process_group

_BYTES = {"all_to_all": 0, "p2p": 0, "all_gather": 0}


def comm_counters() -> dict[str, int]:
    """Bytes this rank has sent to other ranks since the last reset: ``all_to_all``, ``p2p`` and
    ``all_gather`` (the scans' exchange, ops/scans/exchange.py: its payload to each other rank)."""
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
        # each work holds its tensor until dropped: the sent block is freed here, not when the
        # Exchange goes (a ring keeps it until its next hop otherwise)
        while self._works:   # a gloo work waited on twice never returns
            self._works.pop().wait()
        return self._received


class DirectExchange:
    """Tensors sent straight to several peers of one group, and tensors received from several,
    all posted at once (masked 2D-Attention's exchange instead of a ring).

    ``sends``: peer -> tensor; ``receives``: peer -> tensor to fill (shape and dtype known
    from the plan).  ``tag`` separates two exchanges between the same pair in flight at once.
    """

    def __init__(self, group_name: str, sends: dict[int, torch.Tensor],
                 receives: dict[int, torch.Tensor], tag: int = 0):
        self._received = receives
        ops = [dist.P2POp(dist.isend, t, group=group(group_name), group_peer=peer, tag=tag)
               for peer, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, group=group(group_name), group_peer=peer, tag=tag)
                for peer, t in receives.items()]
        self._works = dist.batch_isend_irecv(ops) if ops else []
        _BYTES["p2p"] += sum(t.numel() * t.element_size() for t in sends.values())

    def wait(self) -> dict[int, torch.Tensor]:
        """The received tensors, once every transfer completed (may be called again)."""
        while self._works:  # a gloo work waited on twice never returns
            self._works.pop().wait()
        return self._received


def count_all_gather(payload: torch.Tensor, group_size: int) -> None:
    """Count the bytes of an all-gather of ``payload``: it reaches each of the other ranks.  Only
    real traffic, as ``count_all_to_all``."""
    if not is_tracing():
        _BYTES["all_gather"] += payload.numel() * payload.element_size() * (group_size - 1)


def count_all_to_all(send: torch.Tensor, group_size: int) -> None:
    """Count the bytes of an equal-split all-to-all of ``send`` that leave this rank (its own
    piece stays).  Only real traffic: a traced call (compiling) counts nothing."""
    if not is_tracing():
        _BYTES["all_to_all"] += send.numel() * send.element_size() * (group_size - 1) // group_size
