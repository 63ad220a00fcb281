"""Gated linear recurrences on a rank's tokens, exact: Mamba-2's SSD and gated linear attention
(``delta=False``), gated DeltaNet of Qwen3-Next and Qwen3.5 (``delta=True``).

Per head, with a state ``S`` of ``(dk, dv)`` and token ``t``'s query, key, value, log-decay
``g_t <= 0`` and (delta rule) rate ``beta_t``::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T                                   (delta=False)
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T     (delta=True)
    o_t = S_t^T q_t

``S_t`` is affine in the state a run of tokens starts from: ``S_end = M S_start + N``, and every
output of the run is ``o_t = o0_t + S_start^T qeff_t`` (LASP-2).  Each rank computes, for each
of its runs from a zero state (transformers' chunked form, chunks of ``chunk`` tokens), ``o0``,
``qeff`` and the run's ``(M, N)``; ``M`` is ``(dk, dk)`` with the delta rule and a scalar
without.  One all-gather of every run's ``(M, N)`` (``ops/scans/exchange.py``) lets each rank fold
the runs before its own in sequence order into the state each of its runs starts from, and
correct its outputs.  Backward is autograd's through the same computation (the state's gradient
reaches the earlier runs' ranks through the exchange's reduce-scatter).

Packed documents: the state is zero again at each document start, as the kernels users run
reset it (``ops/scans/documents.py``): a start at token ``t`` is ``exp(g_t) = 0``, and the chunked
form keeps it exact by masking every decay across a start (``_chunk_terms``) rather than by an
infinite log-decay, whose running sums would be ``-inf - (-inf)``.  A run holding a start then has
``M = 0``, so the fold over the runs carries nothing from before it, on any rank.

``gated_delta_rule`` and ``mamba2_scan`` are what the scans stage emits for transformers'
``torch_chunk_gated_delta_rule`` and ``mamba2_chunk_scan`` (passes/scans/gated_delta.py,
mamba2.py): their input layouts and float32 compute around ``gated_scan``, the heads split over
the HP group first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loong_compile.ops.attention.alltoall import seq_all_to_all
from loong_compile.ops.scans.documents import document_starts, run_documents
from loong_compile.ops.scans.exchange import (gather_summaries, group_runs, my_place, pick, place_tensor,
                                              same_run_lengths)


# tokens per block of the chunked form (fla's and transformers' default)
CHUNK = 64


def gated_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, delta: bool,
               chunk: int, hp: int, cp: int, places: list[tuple[int, int]], group_rank: int | None,
               scan_group: str, documents: Tensor | None = None) -> Tensor:
    """``q``, ``k`` ``(B, H, T, dk)``, ``v`` ``(B, H, T, dv)``, ``g`` and ``beta`` ``(B, H, T)``: this
    rank's ``T`` tokens in local order (queries already scaled as the model scales them).  One
    process's outputs ``(B, H, T, dv)`` of the whole sequence's recurrence from a zero state, at
    this rank's tokens; with ``documents`` (``(B, S)``: ``ops/scans/documents.py::scan_documents``
    of the whole sequence) from a zero state at each document start.  ``hp``, ``cp``, ``places``,
    ``group_rank`` (or None: ``scan_exchange.my_place``), ``scan_group``: ``LoongMesh.scan_kwargs``."""
    size = len(places)
    runs = group_runs(q.size(2) * size, hp, cp, places)
    # where the runs are alike, the start states of every rank's runs, this rank's picked at run time
    me = 0 if size == 1 else None if same_run_lengths(runs) else my_place(group_rank, scan_group, size)
    place = place_tensor(group_rank, scan_group, size, q.device) if me is None else None
    starts = [None] * len(runs[me or 0]) if documents is None else \
        [document_starts(n) for n in run_documents(documents, runs, 1, place, me)]
    summaries, offset = [], 0
    for (_, length), run_starts in zip(runs[me or 0], starts):
        part = slice(offset, offset + length)
        summaries.append(run_summary(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part],
                                     None if beta is None else beta[:, :, part], delta, chunk,
                                     run_starts))
        offset += length
    every = _start_states(runs, [(m, n) for _, _, m, n in summaries], size, scan_group)
    if me is None:
        states = [pick(torch.stack([rank_states[j] for rank_states in every]), place)
                  for j in range(len(runs[0]))]
    else:
        states = every[me]
    return torch.cat([o0 + qeff @ state for (o0, qeff, _, _), state in zip(summaries, states)], 2)


def gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                     l2norm: bool, hp: int, cp: int, hp_group: str, cp_group: str,
                     documents: Tensor | None = None) -> Tensor:
    """transformers' ``torch_chunk_gated_delta_rule`` (fla's ``chunk_gated_delta_rule``) of the
    whole sequence from a zero state, at this rank's tokens: ``query``, ``key`` ``(B, T, Hk, dk)``,
    ``value`` ``(B, T, Hv, dv)``, ``g`` and ``beta`` ``(B, T, Hv)`` -> ``(B, T, Hv, dv)`` in
    ``query``'s dtype, computed in float32 as transformers does; with ``documents``
    (``scan_documents``' ``(B, S)``) from a zero state at each document start, as fla's
    ``cu_seqlens=``.  Under ``hp > 1`` the heads are split over the HP group by the all-to-all
    attention uses, and each rank scans its CP shard over the CP group (``hp_group``,
    ``cp_group``: ``LoongMesh.document_kwargs()``'s)."""
    dtype, heads = query.dtype, value.size(2)
    # the gradients leave in the inputs' own layout: the transposed layout the scan's would have
    # reaches a cat in the model's backward, whose output strides eager and fake tensors
    # disagree on (AOTAutograd then views it wrongly)
    query, key, value, g, beta = (_ContiguousGrad.apply(x) for x in (query, key, value, g, beta))
    if key.size(2) != heads:    # grouped value heads: each key head serves consecutive ones
        query, key = (x.repeat_interleave(heads // key.size(2), dim=2) for x in (query, key))
    tensors = [query, key, value, g, beta]
    if hp > 1:
        tensors = seq_all_to_all(tensors, 2, 1, hp, hp_group)
    query, key, value, g, beta = (x.transpose(1, 2).to(torch.float32).contiguous() for x in tensors)
    if l2norm:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    out = gated_scan(query * query.size(-1) ** -0.5, key, value, g, beta, True, CHUNK, hp=1, cp=cp,
                     places=[(c, 0) for c in range(cp)], group_rank=None, scan_group=cp_group,
                     documents=documents)
    out = out.transpose(1, 2)
    if hp > 1:
        out = seq_all_to_all([out], 1, 2, hp, hp_group)[0]
    return out.to(dtype)


def mamba2_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                dt_softplus: bool, dt_min: float, dt_max: float, hp: int, cp: int, hp_group: str,
                cp_group: str, documents: Tensor | None = None) -> Tensor:
    """transformers' ``mamba2_chunk_scan`` (Mamba-2's SSD, mamba_ssm's
    ``mamba_chunk_scan_combined``; Falcon-H1, Bamba, NemotronH, Zamba2) of the whole sequence
    from a zero state, at this rank's tokens: ``x`` ``(B, T, H, P)``, ``dt`` ``(B, T, H)``, ``A``,
    ``D`` and ``dt_bias`` ``(H,)``, ``B`` and ``C`` ``(B, T, G, N)`` -> ``(B, T, H, P)``, computed
    in float32 as transformers does (the skip term ``D x`` in ``D``'s dtype where wider).  The
    step is the gated recurrence without the delta rule: ``k = B``, ``q = C``, ``v = x dt``,
    ``g = A dt``.  Heads, groups and ``documents`` (mamba_ssm's ``seq_idx=``) as
    ``gated_delta_rule``'s."""
    x, dt, B, C = (_ContiguousGrad.apply(t) for t in (x, dt, B, C))
    dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt.clamp(min=dt_min, max=dt_max)
    heads, x = x.size(2), x.float()
    B, C = (t.float().repeat_interleave(heads // t.size(2), dim=2) for t in (B, C))
    skip = D[..., None] * x      # token by token: before the heads leave this rank
    tensors = [C, B, x * dt[..., None].float(), A.to(torch.float32) * dt.float()]
    if hp > 1:
        tensors = seq_all_to_all(tensors, 2, 1, hp, hp_group)
    q, k, v, g = (t.transpose(1, 2).contiguous() for t in tensors)
    out = gated_scan(q, k, v, g, None, False, CHUNK, hp=1, cp=cp, places=[(c, 0) for c in range(cp)],
                     group_rank=None, scan_group=cp_group, documents=documents).transpose(1, 2)
    if hp > 1:
        out = seq_all_to_all([out], 1, 2, hp, hp_group)[0]
    return (out + skip).contiguous()    # token-major, as transformers' (callers view it)


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def run_summary(q, k, v, g, beta, delta: bool, chunk: int,
                starts: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One run of consecutive tokens from a zero state: ``(o0, qeff, M, N)`` (module docstring);
    ``M`` is ``(B, H, dk, dk)`` with ``delta``, ``(B, H, 1, 1)`` without.  ``starts`` ``(B, T)``:
    the tokens that start a document (the state before each is dropped), or None."""
    batch, heads, _, dk = k.shape
    if delta:
        M = torch.eye(dk, dtype=k.dtype, device=k.device).expand(batch, heads, dk, dk)
    else:
        M = k.new_ones(batch, heads, 1, 1)
    N = k.new_zeros(batch, heads, dk, v.size(-1))
    outputs, effective = [], []
    for first in range(0, q.size(2), chunk):
        part = slice(first, first + chunk)
        block = _chunk_terms(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part],
                             None if beta is None else beta[:, :, part], delta,
                             None if starts is None else starts[:, part])
        read, intra, values, k_cum, k_decayed, decay = block
        if delta:   # a query reads the state through the deltas the chunk wrote before it
            read = read - intra @ k_cum
        outputs.append(intra @ values + read @ N)
        effective.append(read @ M if delta else read * M)
        if delta:
            N = decay * N + k_decayed.transpose(-1, -2) @ (values - k_cum @ N)
            M = decay * M - k_decayed.transpose(-1, -2) @ (k_cum @ M)
        else:
            N = decay * N + k_decayed.transpose(-1, -2) @ values
            M = decay * M
    return torch.cat(outputs, 2), torch.cat(effective, 2), M, N


def _chunk_terms(q, k, v, g, beta, delta: bool, starts: Tensor | None):
    """The within-chunk terms of the chunked form (transformers' ``torch_chunk_gated_delta_rule``,
    fla's ``chunk_gated_delta_rule``): the queries decayed to the chunk start, the causal
    decayed scores, the values (with the delta rule: solved through the chunk's unit lower
    triangular system, and the keys that read the start state likewise), the keys decayed to the
    chunk end, and the chunk's whole decay.  With ``starts`` ``(B, L)`` every decay across a
    document start is zero: between two tokens of different documents, from the chunk start to a
    token after a start, from a token to the chunk end past a start."""
    # the log-decays summed in float64: a decay between two tokens is the difference of two
    # sums that grow with the chunk (-150 and -148, say), and float32 would keep that difference
    # of 2 to 1e-5 only (measured: 3e-7 of the output at chunks of 64, 1e-7 at 4, against 1e-16)
    dtype, cumulative = q.dtype, g.to(torch.float64).cumsum(-1)
    length = g.size(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    # each token's document within the chunk (0: the one the chunk's start state belongs to)
    segment = None if starts is None else starts.cumsum(-1).unsqueeze(1)
    if segment is not None:
        causal = causal & (segment.unsqueeze(-1) == segment.unsqueeze(-2))
    pairwise = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill(
        ~causal, float("-inf")).exp().to(dtype)
    intra = (q @ k.transpose(-1, -2)) * pairwise
    to_end, whole = (cumulative[..., -1:] - cumulative).exp(), cumulative[..., -1].exp()
    from_start = cumulative.exp()       # each token's decay since the chunk start
    if segment is not None:
        from_start = from_start * (segment == 0)
        to_end = to_end * (segment == segment[..., -1:])
        whole = whole * (segment[..., -1] == 0)
    from_start = from_start.to(dtype).unsqueeze(-1)
    values, k_cum = v, None
    if delta:
        k_beta = k * beta.unsqueeze(-1)
        system = (k_beta @ k.transpose(-1, -2)) * pairwise
        values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                               unitriangular=True)
        k_cum = torch.linalg.solve_triangular(system, k_beta * from_start, upper=False,
                                              unitriangular=True)
    read = q * from_start
    k_decayed = k * to_end.to(dtype).unsqueeze(-1)
    return read, intra, values, k_cum, k_decayed, whole.to(dtype)[..., None, None]


def _start_states(runs, transitions, size: int, scan_group: str) -> list[list[Tensor]]:
    """The state each run of each rank starts from (ranks in group order): every run's
    ``(M, N)`` gathered, folded in sequence order."""
    M0, N0 = transitions[0]
    if size == 1:
        return [[torch.zeros_like(N0)]]
    per_rank = max(len(r) for r in runs)
    flat = [torch.cat([m.flatten(-2), n.flatten(-2)], -1) for m, n in transitions]
    flat += [torch.zeros_like(flat[0])] * (per_rank - len(flat))
    gathered = gather_summaries(torch.stack(flat), size, scan_group)   # (size, R, B, H, m + n)
    split = M0[0, 0].numel()
    order = sorted((first, rank, j) for rank, rank_runs in enumerate(runs)
                   for j, (first, _) in enumerate(rank_runs))
    state, starts, last = torch.zeros_like(N0), {}, order[-1][0]
    for first, rank, j in order:
        starts[rank, j] = state
        if first == last:
            break
        M = gathered[rank, j, ..., :split].unflatten(-1, M0.shape[-2:])
        N = gathered[rank, j, ..., split:].unflatten(-1, N0.shape[-2:])
        state = (M @ state if M.size(-1) > 1 else M * state) + N
    return [[starts[r, j] for j in range(len(rank_runs))] for r, rank_runs in enumerate(runs)]


def state_bytes(batch: int, heads: int, dk: int, dv: int, delta: bool, runs_per_rank: int,
                element_size: int) -> int:
    """What one rank sends per call to each other rank of the group: each run's ``M``
    (``dk x dk`` with the delta rule, one number without) and ``N`` (``dk x dv``), per row and
    head (docs/attention.md, "Scans")."""
    return runs_per_rank * batch * heads * ((dk * dk if delta else 1) + dk * dv) * element_size
