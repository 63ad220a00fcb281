"""Double-Ring attention with ``cp`` ranks simulated in one process: one thread per
CP rank, and a loopback exchange (``LoopbackExchange``, the interface of
``loong_compile.ops.comm.Exchange``) that hands tensors between them through queues.

gpu-check runs it on one GPU in bf16; the tests run it on CPU in float64.  Both
compare with full-sequence SDPA (one process, autograd)."""

from __future__ import annotations

import queue
import threading
from unittest import mock

import torch
from torch import Tensor

from loong_compile.parallel.tokens import local_token_indices
from loong_compile.parallel.rules import ring_position
from loong_compile.ops.attention import ring

_current = threading.local()   # .rank and .fabric of the thread's simulated CP rank


class LoopbackFabric:
    """The ring groups of one CP group (names as the real mesh gives them to
    ``DoubleRing``: member CP ranks in group-rank order) and one FIFO per
    (group, sender, receiver)."""

    def __init__(self, cp: int, inner_ring: int):
        w, n = inner_ring, cp // inner_ring
        self.members: dict[str, list[int]] = {"dkv_outer": list(range(cp))}
        for i in range(n):
            self.members[f"kv_inner{i}"] = self.members[f"dkv_inner{i}"] = [i * w + j for j in range(w)]
        for j in range(w):
            self.members[f"kv_outer{j}"] = [i * w + j for i in range(n)]
        self._queues: dict[tuple[str, int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def queue(self, group_name: str, sender: int, receiver: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((group_name, sender, receiver), queue.Queue())


class LoopbackExchange:
    """``Exchange(tensor, group_name, next_rank, prev_rank)`` between threads of one process."""

    timeout_s = 120.0

    def __init__(self, tensor: Tensor, group_name: str, next_rank: int, prev_rank: int):
        fabric = _current.fabric
        me = fabric.members[group_name].index(_current.rank)
        fabric.queue(group_name, me, next_rank).put(tensor.clone())
        self._source = fabric.queue(group_name, prev_rank, me)

    def wait(self) -> Tensor:
        return self._source.get(timeout=self.timeout_s)


class LoopbackRing(ring.DoubleRing):
    """CP rank ``rank``'s place in a simulated Double-Ring (no process groups)."""

    def __init__(self, cp: int, inner_ring: int, rank: int):
        self.cp, self.w, self.n_outer = cp, inner_ring, cp // inner_ring
        self.rank = rank
        self.i, self.j = ring_position(rank, inner_ring)
        self.kv_inner, self.dkv_inner = f"kv_inner{self.i}", f"dkv_inner{self.i}"
        self.kv_outer, self.dkv_outer = f"kv_outer{self.j}", "dkv_outer"


def ring_attention(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, *, cp: int, inner_ring: int,
                   is_causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, dq, dk, dv)`` in sequence order: each CP rank's zigzag shard through
    ``ring_forward`` and ``ring_backward``, ``cp`` ranks in ``cp`` threads.
    Inputs ``(B, H, S, D)``; ``k``/``v`` may have fewer heads (GQA)."""
    scale = q.size(-1) ** -0.5
    fabric = LoopbackFabric(cp, inner_ring)
    results: dict[int, tuple[Tensor, ...]] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        _current.rank, _current.fabric = rank, fabric
        try:
            idx = local_token_indices(q.size(2), cp, 1, rank, 0).to(q.device)
            shard = [t.index_select(2, idx).contiguous() for t in (q, k, v, dout)]
            double_ring = LoopbackRing(cp, inner_ring, rank)
            out, lse = ring.ring_forward(*shard[:3], is_causal, scale, double_ring)
            grads = ring.ring_backward(shard[3], *shard[:3], out, lse, is_causal, scale, double_ring)
            results[rank] = (idx, out, *grads)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    with mock.patch.object(ring, "Exchange", LoopbackExchange):
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=LoopbackExchange.timeout_s * 2)
    if errors:
        raise errors[0]
    if len(results) != cp:
        raise TimeoutError(f"{cp - len(results)} simulated CP ranks did not finish")
    full = [torch.empty_like(t) for t in (q, q, k, v)]
    for idx, *parts in results.values():
        for whole, part in zip(full, parts):
            whole[:, :, idx] = part
    return tuple(full)


def sdpa_reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, *,
                   is_causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, dq, dk, dv)`` of full-sequence SDPA (one process, autograd)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, enable_gqa=k.size(1) != q.size(1))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad
