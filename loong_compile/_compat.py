"""Every use of a private torch API lives here, so a torch upgrade touches one file.

Sections are grouped by the part of loong_compile that needs them.  Each
function documents which torch versions it was checked against.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass, CustomPartitionerFn

TORCH_VERSION = torch.__version__

# --- distributed: process groups by name (ops/, mesh.py) ---------------------

def resolve_process_group(group_name: str):
    """The ProcessGroup registered under ``group_name`` (``ProcessGroup.group_name``).

    Custom-op schemas can only carry primitives, so the 2D-Attention ops take
    group names as strings and resolve them here at run time, the same way
    torch's functional collectives do.  Checked against torch 2.13.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# PyTorch's flash-attention kernels (ops/kernels.py): the only aten ops that
# return the log-sum-exp that ring attention merges on.  Checked: torch 2.13
# (the CPU kernel takes float64/float32/bfloat16 and fewer KV heads than Q heads).

def sdpa_flash_cpu(q, k, v, is_causal: bool, scale: float):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention_for_cpu`` (no dropout)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale)


def sdpa_flash_cpu_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """``(dq, dk, dv)`` of the CPU flash kernel, given the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)


def sdpa_flash_cuda(q, k, v, is_causal: bool, scale: float):
    """``(out, lse)`` of ``aten._scaled_dot_product_flash_attention`` (CUDA, fp16/bf16)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


def sdpa_flash_cuda_backward(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """``(dq, dk, dv)`` of the CUDA flash kernel.  Without dropout the philox state is
    unused; ``None`` sequence offsets mean dense (not nested) inputs."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, is_causal, seed, offset,
        scale=scale)


# --- dynamo backend registry (backend.py) ------------------------------------

def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Register ``name`` unless Dynamo has it already (an earlier import, a reload).

    Checked against torch 2.13, where ``register_backend`` raises "duplicate name".
    """
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


# --- rank check (rank_check.py) ----------------------------------------------

def default_store():
    """The key-value store of the default process group (torch 2.13: ``_get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def store_wait(store, keys: list[str], timeout_s: float) -> None:
    """Wait until every key is set; raise (a store error) after ``timeout_s`` seconds."""
    from datetime import timedelta

    store.wait(keys, timedelta(seconds=timeout_s))


# --- AOTAutograd / partitioner (backend.py, passes/activations.py) ----------

def aot_autograd(**kwargs):
    """AOTAutograd as a Dynamo backend (``lowering="aot_eager"``)."""
    from torch._dynamo.backends.common import aot_autograd as _aot_autograd

    return _aot_autograd(**kwargs)


def eager_backward_compile():
    """A context in which AOTAutograd compiles the backward at once, not at its first call."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def fake_mode_of(values):
    """The FakeTensorMode the tensors in ``values`` (nested lists/tuples) belong to, or None.

    The activation passes (passes/activations.py, recompute.py, offload.py) add nodes to
    the partitioned graphs and compute their ``meta["val"]`` under the graphs' own fake
    mode.  Checked against torch 2.13 (``torch._guards.detect_fake_mode``).
    """
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def compile_fx(gm, example_inputs, config_patches):
    """Inductor's entry point, with config patches scoped to this compile."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, config_patches=config_patches)


class _KeyedHook:
    """A hook object Inductor can hash: it pickles as its cache key alone.

    Checked against torch 2.13: Inductor pickles its whole config for the FX
    graph cache key, ``custom_partitioner_fn`` included (it is missing from
    ``_cache_config_ignore_prefix``), so the hook must not drag the compile's
    state (graphs, closures) into that pickle.
    """

    def __init__(self, fn, cache_key: str):
        self.fn, self.cache_key = fn, cache_key

    def __getstate__(self):
        return {"cache_key": self.cache_key}

    def uuid(self):
        return self.cache_key


class LoongPartitioner(_KeyedHook, CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: calls ``fn(joint, inputs, num_fwd_outputs=..., **kw)``."""

    def __call__(self, gm, joint_inputs, **kwargs):
        return self.fn(gm, joint_inputs, **kwargs)


class LoongPostGrad(_KeyedHook, CustomInferenceAwareGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: calls ``fn(graph, is_inference)``."""

    def __call__(self, graph, is_inference):
        self.fn(graph, is_inference)


# --- structured trace logging (inspect.py) -----------------------------------

def trace_artifact(name: str, payload: str, encoding: str = "string") -> None:
    """Emit ``payload`` as a structured-trace artifact (``TORCH_TRACE`` / tlparse)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=lambda: payload)


# --- Inductor memory planning (passes/memory_plan.py) ------------------------
