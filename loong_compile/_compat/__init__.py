"""Every use of a private torch API and every torch version difference lives here.

Supported: torch 2.11 to 2.15 (docs/compat.md).  A difference between those
versions is a named ``Capability`` in ``CAPABILITIES`` (what it is, the versions
that have it, what loong_compile does without it), detected by probing torch,
never by comparing version numbers elsewhere.  A missing capability is reported:
``warn_degraded`` warns once per process naming the feature that is off, and the
compile report lists it.  Inductor's memory-pool planning, the largest private
surface, lives in ``inductor_pools`` and ``pool_planner``.

This package holds shims only, one module per torch subsystem:

==================  ===================================================================
``__init__``        the capability table (``has``, ``degraded``, ``warn_degraded``)
``distributed``     process groups by name and in ring order, functional collectives, the store
``dynamo``          the backend registry, the module being compiled, graph-input sources and kinds
``aot``             AOTAutograd, fake tensors, symbolic sizes, the autograd engine
``kernels``         the aten flash-attention kernels that return the log-sum-exp, op tags,
                    autograd inside an op body
``inductor``        ``compile_fx``, the hook classes Inductor hashes, scheduler nodes, its code
``inductor_pools``  what Inductor's wrapper shows a memory planner, as plain data
``pool_planner``    Inductor's memory planner with our offsets
``trace``           structured trace logging (tlparse)
==================  ===================================================================
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable

import torch

TORCH_VERSION = torch.__version__


# --- capabilities: what differs between the supported torch versions ----------

@dataclasses.dataclass(frozen=True)
class Capability:
    """One torch feature loong_compile uses that not every supported version has."""

    name: str
    what: str             # the torch feature
    versions: str         # the supported versions that have it (a PEP 440 specifier)
    without: str          # what loong_compile does where it is missing (the user sees this)
    probe: Callable[[], bool] = dataclasses.field(repr=False, compare=False)
    degrades: bool = True  # whether a user loses something without it (then it is reported)

    @functools.cached_property
    def available(self) -> bool:
        return bool(self.probe())

    def expected(self, version: str = TORCH_VERSION) -> bool:
        """Whether ``version`` should have it, by the documented range."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(Version(version).base_version) in SpecifierSet(self.versions)


def _has_attr(module: str, *names: str) -> Callable[[], bool]:
    def probe() -> bool:
        import importlib

        try:
            obj = importlib.import_module(module)
        except ImportError:
            return False
        return all(hasattr(obj, n) for n in names)
    return probe


def _inductor_pool_planning_probe() -> bool:
    from torch._inductor import config
    from torch._inductor.codegen import memory_planning, wrapper

    return (hasattr(config, "_post_fusion_custom_pass") and hasattr(config, "memory_pool")
            and hasattr(wrapper.PythonWrapperCodegen, "run_wrapper_ir_passes")
            and hasattr(memory_planning, "MemoryPlanner"))


CAPABILITIES: dict[str, Capability] = {c.name: c for c in [
    Capability(
        "inference_aware_post_grad_pass",
        "torch._inductor.custom_graph_pass.CustomInferenceAwareGraphPass: Inductor tells the "
        "post-grad custom pass whether the graph is an inference graph",
        ">=2.12",
        "the post_grad stage learns the graph's kind from AOTAutograd's graph name "
        "(inference graphs are named so); the stage still runs",
        _has_attr("torch._inductor.custom_graph_pass", "CustomInferenceAwareGraphPass")),
    Capability(
        "inductor_pool_planning",
        "Inductor's wrapper-level memory planner (codegen.memory_planning.MemoryPlanner), "
        "PythonWrapperCodegen.run_wrapper_ir_passes and config._post_fusion_custom_pass",
        ">=2.11",
        "memory_plan=True is off: Inductor allocates as usual; a warning names it and the "
        "compile report lists the inductor stage as skipped",
        _inductor_pool_planning_probe),
    Capability(
        "scheduler_pass_base",
        "torch._inductor.custom_graph_pass.CustomSchedulerPass: the base class of "
        "_post_fusion_custom_pass hooks",
        ">=2.12",
        "nothing a user sees: the memory-plan hook is a plain callable with the same uuid() "
        "(torch 2.11 calls _post_fusion_custom_pass the same way)",
        _has_attr("torch._inductor.custom_graph_pass", "CustomSchedulerPass"),
        degrades=False),
    Capability(
        "unsorted_process_groups",
        "torch.distributed.new_group(ranks, sort_ranks=False): a group keeps the given rank "
        "order, so a ring's neighbours are its list neighbours",
        ">=2.12",
        "groups are built in sorted rank order; a mesh whose rings are not in ascending rank "
        "order (some context_first / inner-ring layouts) is refused with LoongMeshError",
        lambda: "sort_ranks" in inspect.signature(torch.distributed.new_group).parameters,
        degrades=False),
    Capability(
        "dynamo_traces_is_exporting",
        "Dynamo traces torch.compiler.is_exporting() as False under torch.compile "
        "(pytorch#176499); transformers then lets SDPA's is_causal replace its causal mask",
        ">=2.13",
        "transformers builds a causal mask over each rank's tokens under torch.compile; the "
        "attention pass runs it only if passes/attention/mask_proof.py proves it, which is untested on "
        "this torch: use torch >= 2.13 for Hugging Face models at hp*cp > 1; models that call "
        "SDPA with is_causal=True are unaffected",
        lambda: _is_exporting_traced_false(), degrades=False),
    Capability(
        "symbolic_optimization_hint",
        "torch.fx.experimental.symbolic_shapes.optimization_hint: a symbolic size's example "
        "value without adding a guard",
        ">=2.12",
        "nothing a user sees: size_hint reads the same example value (symbolic_shapes.size_hint)",
        _has_attr("torch.fx.experimental.symbolic_shapes", "optimization_hint"),
        degrades=False),
]}


def _is_exporting_traced_false() -> bool:
    def probe(x):
        return x + (1 if torch.compiler.is_exporting() else 0)

    return bool(torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(1)) == 0)


def has(name: str) -> bool:
    """Whether the installed torch has capability ``name`` (a key of ``CAPABILITIES``)."""
    return CAPABILITIES[name].available


def degraded() -> list[Capability]:
    """The capabilities the installed torch lacks that take something from the user."""
    return [c for c in CAPABILITIES.values() if c.degrades and not c.available]


@functools.cache
def warn_degraded(name: str) -> str:
    """Warn (once per process) that capability ``name`` is missing; return the message."""
    c = CAPABILITIES[name]
    message = (f"loong_compile: torch {TORCH_VERSION} lacks {c.name} ({c.what}; torch "
               f"{c.versions} has it): {c.without}. See docs/compat.md.")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message
