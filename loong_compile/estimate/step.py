"""One training step of one configuration: time, model FLOPs and MFU.

A step is one micro-batch per data-parallel replica through every layer (``layer_cost``), the
LM head, and the collectives of the ZeRO stage over all ``dp * cp * hp`` ranks, as FSDP2
runs them (``examples/training.py``, ``shard_with_fsdp2``: one ``fully_shard`` per block):

* ZeRO-3: each block's parameters all-gathered (bf16) before its forward and again before its
  backward, its gradients reduce-scattered (fp32) after it; FSDP2 prefetches the next block's
  all-gather while the current one computes, so a block exposes only what exceeds its compute,
  plus the first all-gather (the root's embedding / head) of the step;
* ZeRO-2 (``reshard_after_forward=False``): one all-gather per block in the forward, the
  reduce-scatter in the backward;
* ZeRO-1: gradients reduce-scattered during the backward (bucketed, overlapped), the updated
  parameters all-gathered after the optimizer step (not overlapped);
* ZeRO-0: gradients all-reduced during the backward (overlapped);
* ZeRO-3 with the states on the host (``--fsdp --offload-states``): as ZeRO-3, each unit's
  parameter shard copied to the device before its all-gather and its gradient shard back to
  the host after its reduce-scatter, over PCIe, on the same streams (FSDP2's copy-in and
  reduce-scatter streams), so they hide behind compute as the collectives do.  The optimizer
  step on the host is not counted.

Collectives are NCCL rings: each rank moves ``(n - 1)/n`` of the buffer (twice for an
all-reduce) at the per-GPU share of the slowest link the group spans, plus ``n - 1`` latencies.
Model FLOPs follow Megatron-LM's count with LoongTrain's causal halving: 3 x (2 FLOPs per
activated weight per token, LM head included, + 4 d per attended pair per head).
"""

from __future__ import annotations

import dataclasses

from loong_compile.estimate.cost import FLOPS_PER_PAIR_DIM, LayerCost
from loong_compile.estimate.equations import GRADIENT_BYTES, WEIGHT_BYTES
from loong_compile.estimate.hardware import HardwareProfile
from loong_compile.estimate.memory import ParallelConfig
from loong_compile.estimate.models import ModelSpec


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds of one step on one GPU, by part, and the MFU they give."""

    layers_s: float
    lm_head_s: float
    gather_s: float          # one block's parameter all-gather (+ its shard's copy from the host)
    reduce_s: float          # one block's gradient reduce-scatter (ZeRO-0: all-reduce; + copy to host)
    exposed_comm_s: float    # what of the ZeRO collectives compute does not hide
    model_flops: float       # per GPU per step
    peak_flops: float

    @property
    def total_s(self) -> float:
        return self.layers_s + self.lm_head_s + self.exposed_comm_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total_s * self.peak_flops)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s, "mfu": self.mfu}


def collective_seconds(nbytes: float, ranks: int, hw: HardwareProfile, passes: int = 1) -> float:
    """A ring all-gather or reduce-scatter (``passes=2``: all-reduce) of an ``nbytes`` buffer over
    ``ranks`` consecutive ranks."""
    if ranks == 1:
        return 0.0
    if ranks <= hw.gpus_per_node:
        bandwidth, latency = hw.nvlink_gbps, hw.intra_latency_us
    else:
        bandwidth = min(hw.nvlink_gbps, hw.nics_per_node * hw.nic_gbps / hw.gpus_per_node)
        latency = hw.inter_latency_us
    return passes * ((ranks - 1) / ranks * nbytes / (bandwidth * 1e9) + (ranks - 1) * latency * 1e-6)


def model_flops_per_sequence(model: ModelSpec, seq: int, doc_length: int = 0) -> float:
    """Training FLOPs of one sequence (forward x 3), as MFU counts them (the pairs the masks
    allow: packed documents of ``doc_length`` tokens, the model's windows)."""
    weights = model.layers * model.activated_layer_params + model.hidden * model.vocab
    attention = model.layers * FLOPS_PER_PAIR_DIM * model.attended_pairs(seq, doc_length) * model.heads * model.head_dim
    return 3 * (2 * seq * weights + attention)


def host_copy_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """A copy of ``nbytes`` between host and device memory."""
    return nbytes / (hw.pcie_gbps * 1e9)


def step_cost(model: ModelSpec, config: ParallelConfig, layer: LayerCost, zero: int,
              hw: HardwareProfile, states_on_host: bool = False) -> StepCost:
    """Step time of ``config`` whose per-layer cost is ``layer``, under ZeRO stage ``zero``
    (``states_on_host``: ZeRO-3's shards on the host)."""
    ranks = config.dp * config.cp * config.hp
    tokens = config.micro_batch * config.seq / config.sp
    matmul_rate = hw.peak_tflops * 1e12 * hw.matmul_efficiency
    lm_head = 3 * 2 * tokens * model.hidden * model.vocab / matmul_rate
    block = model.layer_matmul_params + model.norm_params
    root = model.hidden * model.vocab * (1 if model.tied_embeddings else 2) + model.hidden

    def shard_copy(nbytes: float) -> float:
        """One rank's shard of an ``nbytes`` unit across PCIe, when the states are on the host."""
        return host_copy_seconds(nbytes / ranks, hw) if states_on_host else 0.0

    gather = collective_seconds(WEIGHT_BYTES * block, ranks, hw) + shard_copy(WEIGHT_BYTES * block)
    reduce = (collective_seconds(GRADIENT_BYTES * block, ranks, hw, passes=2 if zero == 0 else 1)
              + shard_copy(GRADIENT_BYTES * block))
    root_gather = collective_seconds(WEIGHT_BYTES * root, ranks, hw) + shard_copy(WEIGHT_BYTES * root)
    forward = layer.attention.forward_s + layer.dense_fwd_s + layer.elementwise_fwd_s
    backward = layer.total_s - forward
    n = model.layers
    if zero == 3:
        exposed = root_gather + n * (max(0.0, gather - forward) + max(0.0, gather + reduce - backward))
    elif zero == 2:
        exposed = root_gather + n * (max(0.0, gather - forward) + max(0.0, reduce - backward))
    else:
        exposed = max(0.0, n * reduce - n * backward)
        if zero == 1:
            exposed += n * gather + root_gather
    flops = config.micro_batch * model_flops_per_sequence(model, config.seq, config.doc_length) / config.sp
    return StepCost(n * layer.total_s, lm_head, gather, reduce, exposed, flops, hw.peak_tflops * 1e12)
