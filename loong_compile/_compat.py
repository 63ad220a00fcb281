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


# --- dynamo backend registry (backend.py) ------------------------------------

def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Register ``name`` unless Dynamo knows it already (from our entry point or an earlier import).

    Checked against torch 2.13: an installed entry point is loaded lazily by
    ``lookup_backend``, which itself registers the name, so registering it from
    the package's import as well would raise "duplicate name".
    """
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if name in registry._COMPILER_FNS:
        return
    if any(ep.name == name for ep in entry_points(group="torch_dynamo_backends")):
        return  # Dynamo finds and loads it itself
    registry.register_backend(compiler_fn=compiler_fn, name=name)


# --- AOTAutograd / partitioner (backend.py, passes/activations.py) ----------

def aot_autograd(**kwargs):
    """AOTAutograd as a Dynamo backend (``lowering="aot_eager"``)."""
    from torch._dynamo.backends.common import aot_autograd as _aot_autograd

    return _aot_autograd(**kwargs)


def eager_backward_compile():
    """A context in which AOTAutograd compiles the backward at once, not at its first call."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


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
