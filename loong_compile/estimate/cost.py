"""2D-Attention cost model (LoongTrain 4.5) and the per-layer time the planner ranks by.

Per transformer layer and micro-batch, one GPU of a ``d_hp x d_cp`` grid spends

* SeqAlltoAll: forward (q, k, v in; out back) and backward (the same volume again), each
  ``sum(Size(q, k, v, out)) * (d_hp - 1)/d_hp`` bytes per GPU (4.5.4), not overlapped;
* Double-Ring attention: ``d_cp/w`` outer steps of ``w`` micro-steps each.  A micro-step
  computes ``alpha_c * S^2 D / (d_cp * d_sp)`` (3x that in the backward, 4.5.2) while a KV
  chunk of ``Size(kv) = max(Hkv, d_hp)/H * 4SD/d_sp`` bytes moves (4.5.3; KV and dKV in the
  backward); per inner ring ``T = (w-1) * max(T_comp, T_inner) + max(T_comp, T_outer)``,
  the last outer step having no outer transfer.

Which transfers are intra-node (NVLink) and which inter-node (the node's NICs, shared by
the flows that leave it) follows from the placement: every rank's peers are enumerated.
``layer_cost`` adds what the planner needs to compare activation policies: the layer's
projections (2 FLOPs per weight per token forward, twice that backward), the forward a
policy recomputes, and MEMO's offload / prefetch time where it exceeds the compute it
hides behind.  Two additions to 4.5, both stated in the breakdown: each micro-step's merge of partial outputs
(forward: out/lse rescaling; backward: dQ accumulation), memory-bound at HBM bandwidth, and
a per-message latency.  ``alpha_c = 2 / attention_rate``: causal attention does 4 S^2 D / 2
FLOPs forward (in sliding-window layers 4 D per attended pair instead); the rate FlashAttention
reaches grows with the block a ring step hands it (``attention_rate``).  The layer's
elementwise ops (norms, RoPE, SwiGLU, residual adds) are memory-bound at HBM bandwidth.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.hardware import HardwareProfile
from loong_compile.estimate.memory import ParallelConfig, attention_transfer_bytes
from loong_compile.estimate.models import ModelSpec
from loong_compile.parallel.rules import PLACEMENTS, rank_of, ring_position

FLOPS_PER_PAIR_DIM = 4.0         # QK^T and PV: 2 matmuls x 2 FLOPs per MAC per (query, key, dim)
BACKWARD_FACTOR = 3.0            # LoongTrain 4.5.2
MERGE_BYTES_PER_ELEMENT = 12.0   # fp32 accumulator read + block read + accumulator write


def attention_rate(hw: HardwareProfile, block_tokens: float) -> float:
    """FLOP/s FlashAttention reaches on blocks of ``block_tokens`` keys per call: the long-block
    efficiency, halved at ``attention_half_block`` tokens (saturation curve)."""
    return hw.peak_tflops * 1e12 * hw.attention_efficiency * block_tokens / (block_tokens + hw.attention_half_block)


def elementwise_elements(model: ModelSpec) -> float:
    """Elements per token one layer's forward reads and writes outside GEMMs and attention: two
    RMSNorms (read x, write y: 4h), two residual adds (6h), RoPE on q and k (2(a + k) d_head),
    the gated activation (read gate and up, write: 3 h_ffn).  The backward moves twice that."""
    return 10 * model.hidden + 2 * (model.heads + model.kv_heads) * model.head_dim + 3 * model.activated_ffn


@dataclasses.dataclass(frozen=True)
class Hop:
    """The slowest of one kind of concurrent P2P transfer (every rank sends one)."""

    link: str          # "nvlink", "network" or "none"
    seconds: float
    flows_per_nic: float


@dataclasses.dataclass(frozen=True)
class AttentionCost:
    """One layer's 2D-Attention time on one GPU, with its parts (seconds, bytes)."""

    compute_fwd_step_s: float
    compute_bwd_step_s: float
    merge_step_s: float
    kv_chunk_bytes: float
    inner_fwd: Hop
    outer_fwd: Hop
    inner_bwd: Hop
    outer_bwd: Hop
    ring_fwd_s: float
    ring_bwd_s: float
    alltoall_bytes: float
    alltoall_link: str
    alltoall_fwd_s: float
    alltoall_bwd_s: float

    @property
    def forward_s(self) -> float:
        return self.alltoall_fwd_s + self.ring_fwd_s

    @property
    def backward_s(self) -> float:
        return self.alltoall_bwd_s + self.ring_bwd_s

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(forward_s=self.forward_s, backward_s=self.backward_s, total_s=self.total_s)
        return out


def _hop(flows: list[tuple[int, int]], nbytes: float, hw: HardwareProfile) -> Hop:
    """Time of a set of concurrent transfers (src rank, dst rank): the slowest one."""
    if not flows:
        return Hop("none", 0.0, 0.0)
    node = hw.gpus_per_node
    leaving = Counter(src // node for src, dst in flows if src // node != dst // node)
    entering = Counter(dst // node for src, dst in flows if src // node != dst // node)
    if not leaving:
        return Hop("nvlink", hw.intra_latency_us * 1e-6 + nbytes / (hw.nvlink_gbps * 1e9), 0.0)
    # A flow uses one NIC at full rate; more flows than NICs share them.
    crowd = max(max(leaving.values()), max(entering.values()))
    per_flow = hw.nic_gbps * 1e9 * min(1.0, hw.nics_per_node / crowd)
    return Hop("network", hw.inter_latency_us * 1e-6 + nbytes / per_flow, crowd / hw.nics_per_node)


def _ring_time(w: int, n_outer: int, compute: float, inner: Hop, outer: Hop) -> float:
    """``n_outer = d_cp/w`` inner rings of ``(w-1) max(T_c, T_inner) + max(T_c, T_outer)``; the
    last outer step launches no outer transfer (4.5.3)."""
    return (n_outer * (w - 1) * max(compute, inner.seconds)
            + (n_outer - 1) * max(compute, outer.seconds) + compute)


def _alltoall(config: ParallelConfig, placement: str, held_bytes: float,
              hw: HardwareProfile) -> tuple[float, str]:
    """SeqAlltoAll of ``held_bytes`` per GPU (1/d_hp of it to each HP peer) within every HP
    group at once: the NVLink share of a GPU vs the NIC share of a node, whichever is slower."""
    hp, cp = config.hp, config.cp
    if hp == 1:
        return 0.0, "none"
    node = hw.gpus_per_node
    per_peer = held_bytes / hp
    intra_max, inter_per_node = 0.0, Counter()
    for dp_i in range(config.dp):
        for cp_i in range(cp):
            group = [rank_of(dp_i, cp_i, j, cp, hp, placement) for j in range(hp)]
            for r in group:
                inter = sum(1 for q in group if q != r and q // node != r // node)
                intra = hp - 1 - inter
                intra_max = max(intra_max, intra * per_peer)
                inter_per_node[r // node] += inter * per_peer
    inter_max = max(inter_per_node.values())
    if inter_max > 0:
        seconds = max(intra_max / (hw.nvlink_gbps * 1e9),
                      inter_max / (hw.nics_per_node * hw.nic_gbps * 1e9)) + hw.inter_latency_us * 1e-6
        return seconds, "network"
    return intra_max / (hw.nvlink_gbps * 1e9) + hw.intra_latency_us * 1e-6, "nvlink"


def _ring_flows(config: ParallelConfig, placement: str) -> tuple[list, list]:
    """(inner-ring flows, outer-ring flows) as (src, dst) ranks over the whole world."""
    cp, hp, w = config.cp, config.hp, config.inner_ring
    n_outer = cp // w
    inner, outer = [], []
    for dp_i in range(config.dp):
        for hp_i in range(hp):
            for cp_i in range(cp):
                ring, j = ring_position(cp_i, w)
                src = rank_of(dp_i, cp_i, hp_i, cp, hp, placement)
                if w > 1:
                    inner.append((src, rank_of(dp_i, ring * w + (j + 1) % w, hp_i, cp, hp, placement)))
                if n_outer > 1:
                    outer.append((src, rank_of(dp_i, ((ring + 1) % n_outer) * w + j, hp_i, cp, hp, placement)))
    return inner, outer


def attention_cost(model: ModelSpec, config: ParallelConfig, placement: str, hw: HardwareProfile,
                   dtype_bytes: int = 2) -> AttentionCost:
    """Predicted 2D-Attention time of one layer for ``config`` (``hp``, ``cp``, ``inner_ring``,
    ``dp``, ``micro_batch``, ``seq``) under ``placement`` on ``hw``."""
    config.validate(model)
    if placement not in PLACEMENTS:
        raise LoongConfigError(f"placement={placement!r}", f"placement must be one of {', '.join(PLACEMENTS)}",
                               "pass head_first or context_first")
    if config.tp != 1 or config.pp != 1:
        raise LoongConfigError(f"tp={config.tp}, pp={config.pp}",
                               "the 2D-Attention cost model covers dp x cp x hp meshes (tp = pp = 1)",
                               "use the memory estimate alone for tp/pp configurations")
    seq, batch, width = config.seq, config.micro_batch, model.heads * model.head_dim
    cp, hp, sp_size, w = config.cp, config.hp, config.sp, config.inner_ring
    flops = FLOPS_PER_PAIR_DIM * batch * model.attended_pairs(seq, config.doc_length) * width
    attn_fwd = flops / (cp * sp_size) / attention_rate(hw, seq / cp)
    merge = 0.0 if cp == 1 else MERGE_BYTES_PER_ELEMENT * batch * seq * width / sp_size / (hw.hbm_gbps * 1e9)
    compute_fwd = attn_fwd + merge
    compute_bwd = BACKWARD_FACTOR * attn_fwd + merge

    chunk, held = attention_transfer_bytes(model, config, dtype_bytes)     # Size(kv), sum of Size(q,k,v,out)
    chunk *= model.kv_fraction(seq, cp, config.doc_length)  # masks: only the chunks ranks need
    inner_flows, outer_flows = _ring_flows(config, placement)
    inner_fwd, outer_fwd = _hop(inner_flows, chunk, hw), _hop(outer_flows, chunk, hw)
    inner_bwd, outer_bwd = _hop(inner_flows, 2 * chunk, hw), _hop(outer_flows, 2 * chunk, hw)
    n_outer = cp // w
    ring_fwd = _ring_time(w, n_outer, compute_fwd, inner_fwd, outer_fwd)
    ring_bwd = _ring_time(w, n_outer, compute_bwd, inner_bwd, outer_bwd)

    a2a_s, a2a_link = _alltoall(config, placement, held, hw)
    return AttentionCost(compute_fwd, compute_bwd, merge, chunk, inner_fwd, outer_fwd, inner_bwd,
                         outer_bwd, ring_fwd, ring_bwd, held * (hp - 1) / hp, a2a_link, a2a_s, a2a_s)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's forward + backward on one GPU: attention, projections, recompute, and the
    part of MEMO's host transfers that compute cannot hide."""

    attention: AttentionCost
    dense_fwd_s: float
    elementwise_fwd_s: float
    recompute_s: float
    transfer_s: float
    transfer_stall_s: float

    @property
    def total_s(self) -> float:
        return (self.attention.total_s + 3 * (self.dense_fwd_s + self.elementwise_fwd_s) + self.recompute_s
                + self.transfer_stall_s)

    def to_dict(self) -> dict:
        return {"attention": self.attention.to_dict(), "dense_fwd_s": self.dense_fwd_s,
                "dense_bwd_s": 2 * self.dense_fwd_s, "elementwise_fwd_s": self.elementwise_fwd_s,
                "elementwise_bwd_s": 2 * self.elementwise_fwd_s, "recompute_s": self.recompute_s,
                "transfer_s": self.transfer_s, "transfer_stall_s": self.transfer_stall_s,
                "total_s": self.total_s}


def layer_cost(model: ModelSpec, config: ParallelConfig, placement: str, hw: HardwareProfile,
               policy: str, alpha: float = 0.0, offload_bytes: float = 0.0,
               dtype_bytes: int = 2) -> LayerCost:
    """``attention_cost`` plus projections, recompute under ``policy`` (``full`` recomputes the
    whole forward, as ``full_offload`` does, ``sc++`` all but attention, ``memo`` the ``1 - alpha``
    token share of the non-attention forward), and ``offload_bytes`` per layer moved to host and
    back (memo, full_offload)."""
    attention = attention_cost(model, config, placement, hw, dtype_bytes)
    tokens = config.micro_batch * config.seq / config.sp
    dense_fwd = 2 * tokens * model.activated_layer_params / (hw.peak_tflops * 1e12 * hw.matmul_efficiency)
    elementwise = dtype_bytes * tokens * elementwise_elements(model) / (hw.hbm_gbps * 1e9)
    local_fwd = dense_fwd + elementwise
    recompute = {"none": 0.0, "full": local_fwd + attention.forward_s,
                 "full_offload": local_fwd + attention.forward_s, "sc++": local_fwd,
                 "memo": (1 - alpha) * local_fwd}[policy]
    transfer = offload_bytes / (hw.pcie_gbps * 1e9)
    forward = attention.forward_s + local_fwd
    backward = attention.backward_s + 2 * local_fwd + recompute
    stall = max(0.0, transfer - forward) + max(0.0, transfer - backward)
    return LayerCost(attention, dense_fwd, elementwise, recompute, transfer, stall)
