"""2D-Attention (LoongTrain §4.1, Algorithm 1): head-parallel all-to-all × Double-Ring.

``attention_2d(q, k, v, is_causal=..., scale=..., **mesh.attention_kwargs())``
has the semantics of ``F.scaled_dot_product_attention`` on the full sequence,
given this rank's tokens in the layout of ``loong_compile.parallel.tokens``
(V may have its own head dim ``D_v``, as in MLA; every step carries it, and the
output has it):

1. KV replication (§4.2): if ``hp > H_kv``, each KV head is repeated
   ``hp / H_kv`` times (``repeat_interleave``, so its gradient is the sum of
   the replicas'); otherwise KV travels with its ``H_kv`` heads.
2. SeqAlltoAll over the HP group: ``(B, H, S/sp, D) -> (B, H/hp, S/cp, D)``.
3. Double-Ring attention over the CP group -> ``(out, lse)``; with
   ``document_ids`` / ``window``, the masked direct exchange (ops/attention/masked.py).
4. SeqAlltoAll back: ``out`` to ``(B, H, S/sp, D_v)``.

With ``head_groups = G > 1`` steps 2-4 run for one group of ``H / G`` heads at a time
(ops/attention/head_groups.py), so that one group's attention working set is live at once.

Everything is a traceable op (custom ops with fake kernels and autograd), so
a model calling this stays one graph under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loong_compile.parallel.tokens import check_sequence_length
from loong_compile.errors import LoongConfigError, LoongMeshError, LoongShapeError
from loong_compile.parallel.rules import (head_group_violation, head_violation,
                                          inner_ring_violation)
from loong_compile.ops.attention.alltoall import seq_all_to_all
from loong_compile.ops.attention.head_groups import head_group_parts, join_heads
from loong_compile.ops.attention.masked import masked_attention_fwd
from loong_compile.ops.masks.step import masked_attention_plan
from loong_compile.ops.attention.ring import ring_attention_fwd


def attention_2d(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float | None = None,
                 hp: int = 1, cp: int = 1, inner_ring: int = 1, hp_group: str = "",
                 kv_inner_group: str = "", kv_outer_group: str = "", dkv_inner_group: str = "",
                 dkv_outer_group: str = "", return_lse: bool = False, enable_gqa: bool = True,
                 document_ids: Tensor | None = None, window: int | None = None,
                 mask_plan: Tensor | None = None, sinks: Tensor | None = None,
                 head_groups: int = 1):
    """Distributed exact attention of this rank's tokens; ``(B, H, S/sp, D_v)``: q's batch,
    heads and tokens, v's head dim.

    Masks (docs/attention.md, "Masked attention"): ``document_ids`` ``(B, S)``
    integer ids of the GLOBAL sequence in global order, the same on every rank
    (``sequence_document_ids`` builds them): query ``i`` sees key ``j`` only if
    ``document_ids[b, i] == document_ids[b, j] >= 0`` (negative = padding, which
    sees and is seen by nothing; ids from ``ops.masks.blocks.CHUNK_MAJOR`` up: a document in
    ``shard_batch(balance_documents=True)``'s order, where causality and the window count
    the document's own tokens, ops/masks/blocks.py).  ``window``: with ``is_causal``, key ``j`` is
    seen only if ``i - j < window`` (transformers' sliding window).  A row that
    sees no key returns zeros (LSE ``-inf``).  With either given, the CP step is
    the masked direct exchange of ops/attention/masked.py instead of the Double-Ring.  Its plan is
    made on the host from one copy of the ids: pass ``mask_plan=masked_attention_plan(ids,
    S, is_causal, window or 0, cp, dkv_outer_group)`` made once per step to every layer's
    call (as the backend does), else each call makes its own (ops/masks/step.py).

    K/V may have fewer heads than q (GQA).  ``enable_gqa=False`` is SDPA's:
    K/V have q's head count or one head (which broadcasts); any other count
    raises ``LoongShapeError`` as SDPA raises.

    ``sinks``: one logit per query head, ``(H,)``, that joins every query's softmax with a zero
    value (gpt-oss's attention sinks, ops/attention/sinks.py), counted once per query across every KV
    block and rank; it gets its gradient.

    ``head_groups``: run the all-to-all, the ring and the all-to-all back for that many groups of
    heads one after the other (ops/attention/head_groups.py); it divides the query heads a rank
    holds after the all-to-all, and divides its KV heads or is a multiple of them.

    ``return_lse=True`` also returns the log-sum-exp per query row,
    ``(B, H, S/sp)`` in float32 (float64 for float64 inputs), not differentiable.
    Raises ``LoongShapeError`` / ``LoongMeshError`` before any collective; the
    checks use only local shapes and mesh sizes, so every rank raises alike.
    """
    check_attention_inputs(q, k, v, hp=hp, cp=cp, inner_ring=inner_ring, enable_gqa=enable_gqa,
                           head_groups=head_groups)
    ring_groups = (kv_inner_group, kv_outer_group, dkv_inner_group, dkv_outer_group)
    check_group_names(hp, cp, inner_ring, hp_group, ring_groups)
    seq_len = q.size(2) * hp * cp
    check_mask_inputs(document_ids, window, is_causal, q, seq_len)
    if window is not None and window >= seq_len:
        window = None
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    kv_heads = k.size(1)
    if hp > kv_heads:  # LoongTrain §4.2: one KV head per HP rank
        k = k.repeat_interleave(hp // kv_heads, dim=1)
        v = v.repeat_interleave(hp // kv_heads, dim=1)
    rows = None
    if sinks is not None:  # per query row, so that the rows take their heads' sinks along
        check_sinks(sinks, q)
        rows = sinks.view(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)
    if document_ids is not None:
        document_ids = document_ids.to(torch.int64)
    if (document_ids is not None or window is not None) and mask_plan is None:
        mask_plan = masked_attention_plan(document_ids, seq_len, is_causal, window or 0, cp,
                                          dkv_outer_group)

    def attend(q, k, v, rows):   # one group of heads, in CP layout
        if document_ids is None and window is None:
            return ring_attention_fwd(q, k, v, is_causal, scale, cp, inner_ring, *ring_groups,
                                      rows)
        return masked_attention_fwd(q, k, v, document_ids, mask_plan, is_causal, window or 0,
                                    scale, cp, dkv_outer_group, rows)

    groups = head_group_parts(q, k, v, rows, hp, head_groups)
    outs, lses = [], []
    for q_part, kv_parts, row_part in groups:
        sent = [q_part, *([] if row_part is None else [row_part]), *kv_parts]
        if hp > 1:
            sent = seq_all_to_all(sent, 1, 2, hp, hp_group)
        if kv_parts:   # the group's K/V (else the previous group's, which it shares)
            k_here, v_here = sent[-2:]
        q_here = sent[0]
        row_here = None if row_part is None else sent[1].squeeze(-1)
        out, lse = attend(q_here, k_here, v_here, row_here)
        if hp > 1:
            (out,) = seq_all_to_all([out], 2, 1, hp, hp_group)
            if return_lse:
                (lse,) = seq_all_to_all([lse.unsqueeze(-1)], 2, 1, hp, hp_group)
                lse = lse.squeeze(-1)
        outs.append(out)
        lses.append(lse)
    if head_groups > 1:
        out, lse = join_heads(outs, hp), (join_heads(lses, hp) if return_lse else None)
    return (out, lse) if return_lse else out


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, *, hp: int, cp: int,
                           inner_ring: int, enable_gqa: bool = True,
                           head_groups: int = 1) -> None:
    """Raise ``LoongShapeError`` unless q, k, v fit 2D-Attention on an ``hp × cp`` grid."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if t.dim() != 4:
            raise LoongShapeError(f"{name} of shape {tuple(t.shape)}",
                                  "q, k, v are (batch, heads, local sequence, head dim) as "
                                  "in SDPA",
                                  "transpose to (B, H, S, D) before attention")
        if not t.is_floating_point():
            raise LoongShapeError(f"{name}.dtype={t.dtype}", "q, k, v are floating point",
                                  "cast q, k and v to one float dtype")
    if not (q.dtype == k.dtype == v.dtype):
        raise LoongShapeError(f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}",
                              "q, k and v have one dtype", f"cast k and v to {q.dtype}")
    if not (q.device == k.device == v.device):
        raise LoongShapeError(f"devices q={q.device}, k={k.device}, v={v.device}",
                              "q, k and v live on one device", f"move k and v to {q.device}")
    batch, heads, seq, head_dim = q.shape
    # as SDPA: k has q's head dim (scores are q . k), v may have its own (MLA: D_v != D_qk)
    if tuple(k.shape) != (batch, k.size(1), seq, head_dim) or \
            tuple(v.shape) != (batch, k.size(1), seq, v.size(-1)):
        raise LoongShapeError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}",
                              "k is (B, H_kv, S, D) and v (B, H_kv, S, D_v): q's batch, local "
                              "sequence length and, for k, head dim; v's head dim may differ",
                              "pass k with q's head dim, and k and v with one head count")
    kv_heads = k.size(1)
    if not enable_gqa and kv_heads not in (1, heads):
        raise LoongShapeError(f"{heads} query heads with {kv_heads} KV heads and enable_gqa=False",
                              "without GQA, K/V have the query heads or one head, as in SDPA",
                              "pass enable_gqa=True, or repeat the KV heads to the query heads")
    violation = head_violation(heads, kv_heads, hp)
    if violation:
        raise LoongShapeError(*violation)
    violation = head_group_violation(heads, kv_heads, hp, head_groups)
    if violation:   # the option, not the call: refused on one rank too (passes/attention)
        raise LoongConfigError(*violation)
    violation = inner_ring_violation(cp, inner_ring)
    if violation:
        raise LoongMeshError(violation.what, violation.rule,
                             "build the arguments with "
                             "loong_compile.init_mesh(...).attention_kwargs()")
    check_sequence_length(seq * hp * cp, cp, hp)


def check_sinks(sinks: Tensor, q: Tensor) -> None:
    """Raise ``LoongShapeError`` unless ``sinks`` is one float logit per query head."""
    if tuple(sinks.shape) != (q.size(1),) or not sinks.is_floating_point():
        raise LoongShapeError(f"sinks of shape {tuple(sinks.shape)} and dtype {sinks.dtype}",
                              f"sinks are one float logit per query head: ({q.size(1)},)",
                              "pass the module's sinks parameter (one value per head)")


def check_mask_inputs(document_ids: Tensor | None, window: int | None, is_causal: bool,
                      q: Tensor, seq_len: int) -> None:
    """Raise ``LoongShapeError`` unless the masks fit the global ``(B, S)`` sequence."""
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise LoongShapeError(f"window={window!r}", "a sliding window is a positive number "
                                  "of tokens", "pass an int >= 1, or window=None for none")
        if not is_causal:
            raise LoongShapeError(f"window={window} with is_causal=False",
                                  "a sliding window looks back only: it needs is_causal=True",
                                  "pass is_causal=True (or express the mask as document_ids)")
    if document_ids is None:
        return
    want = (q.size(0), seq_len)
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool or \
            tuple(document_ids.shape) != want:
        raise LoongShapeError(f"document_ids of shape {tuple(document_ids.shape)} and dtype "
                              f"{document_ids.dtype}",
                              f"document_ids are integer ids (B, S) = {want} of the whole "
                              "sequence in global order, the same on every rank",
                              "build them with loong_compile.ops.sequence_document_ids")
    if document_ids.device != q.device:
        raise LoongShapeError(f"document_ids on {document_ids.device}, q on {q.device}",
                              "document_ids live on q's device", f"move them to {q.device}")


def check_group_names(hp: int, cp: int, inner_ring: int, hp_group: str,
                      ring_groups: tuple[str, ...]) -> None:
    """Every group the ops will talk on must be named (a mesh built for other sizes is not)."""
    outer = cp // inner_ring
    needed = {"hp_group": (hp_group, hp > 1), "kv_inner_group": (ring_groups[0], inner_ring > 1),
              "kv_outer_group": (ring_groups[1], outer > 1),
              "dkv_inner_group": (ring_groups[2], inner_ring > 1),
              "dkv_outer_group": (ring_groups[3], cp > 1)}
    missing = [name for name, (value, used) in needed.items() if used and not value]
    if missing:
        raise LoongMeshError(f"no process group for {missing} with hp={hp}, cp={cp}, "
                             f"inner_ring={inner_ring}",
                             "every group a 2D-Attention of these sizes talks on is named",
                             "pass **loong_compile.init_mesh(hp=..., cp=..., inner_ring=...)"
                             ".attention_kwargs()")
