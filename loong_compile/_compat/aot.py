"""AOTAutograd, fake-tensor, symbolic-size and autograd-engine shims (backend, explain, the
activation and mask passes, ops/exposure.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.fx

from loong_compile._compat import has


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

    The activation passes (passes/activations/classify.py, recompute.py, offload.py) add nodes to
    the partitioned graphs and compute their ``meta["val"]`` under the graphs' own fake
    mode.  Checked against torch 2.13 (``torch._guards.detect_fake_mode``).
    """
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def real_tensors():
    """A context in which tensors are real even inside the partitioner (which runs under
    AOTAutograd's FakeTensorMode): for MEMO's measurements (copy bandwidth, matmul rate)
    and the all-reduce that makes ranks agree on them.  Checked against torch 2.13."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def size_hint(value) -> int:
    """The example value of an int or SymInt, read without adding a guard (a dimension
    marked dynamic stays dynamic)."""
    from torch.fx.experimental import symbolic_shapes

    if has("symbolic_optimization_hint"):
        return symbolic_shapes.optimization_hint(value)
    return symbolic_shapes.size_hint(value)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a compiled backward
    graph runs inside it).  Checked against torch 2.11-2.15."""
    return torch._C._current_graph_task_id() != -1


def aot_graph_kind(is_inference: bool) -> tuple[str, str]:
    """AOTAutograd's name for the graph being compiled (``0_forward``) and its kind
    (``forward``, ``backward`` or ``inference``)."""
    context = torch._guards.TracingContext.try_get()
    names = getattr(context, "aot_graph_name", None) if context is not None else None
    name = "_".join(names) if names else ("inference" if is_inference else "graph")
    inference = is_inference or "inference" in name
    kind = "inference" if inference else ("backward" if "backward" in name else "forward")
    return name, kind


@contextlib.contextmanager
def rng_state_only_for(is_random: Callable[[torch.fx.Node], bool]) -> Iterator[None]:
    """Within: the min-cut partition saves and replays the RNG state only for the recomputed
    nodes ``is_random`` says draw numbers.  PyTorch's attention ops carry the
    ``nondeterministic_seeded`` tag for their dropout; recomputed (policy ``full``), each would
    be wrapped in ``run_and_save_rng_state`` and hidden from the passes after the partition,
    which look for the attention ops, although without dropout it draws nothing.  Checked
    against torch 2.11-2.15 (``partitioners.has_recomputable_rng_ops``, looked up at each call)."""
    from torch._functorch import partitioners

    original = partitioners.has_recomputable_rng_ops

    def has_recomputable_rng_ops(module: torch.fx.GraphModule) -> bool:
        return any(partitioners.must_recompute(n) and is_random(n) for n in module.graph.nodes)

    partitioners.has_recomputable_rng_ops = has_recomputable_rng_ops
    try:
        yield
    finally:
        partitioners.has_recomputable_rng_ops = original
