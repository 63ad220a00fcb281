"""LoongConfig: the backend's options, from ``options=`` and ``LOONG_*`` variables.

Environment variables give defaults (``LOONG_HP=2``); explicit ``options``
override them.  Every key is validated here, once, and so is the one rule
between keys (the inner ring divides cp, ``loong_compile.parallel.rules``), so passes
and ops can trust the values they read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from loong_compile.errors import LoongConfigError
from loong_compile.parallel.rules import (
    ACTIVATION_POLICIES, PLACEMENTS, ActivationPolicy, Placement, inner_ring_violation,
)

LOWERINGS = ("inductor", "aot_eager", "eager")
ENV_PREFIX = "LOONG_"


@dataclasses.dataclass(frozen=True)
class LoongConfig:
    """Options of ``torch.compile(model, backend="loong", options=...)``.

    hp, cp: head-parallel and context-parallel degrees (sp = hp * cp ranks share a sequence).
    placement: ``head_first`` keeps an HP group on consecutive ranks, ``context_first`` a CP group
        (``layout.PLACEMENT_DOCS``).
    inner_ring: ranks per inner ring of the Double-Ring (must divide cp).
    activations: ``none`` (Inductor's partition), ``sc++`` (save layer inputs and attention
        outputs, recompute the rest), ``memo`` (offload + token-slice recompute)
        (``layout.ACTIVATION_POLICY_DOCS``).
    alpha: fraction of "other" activations' tokens offloaded under ``memo``; ``"auto"`` solves MEMO's LP.
    host_bandwidth: host<->device copy bandwidth in bytes/s (MEMO's B); ``"auto"`` measures it.
    host_memory: host bytes this rank may fill with offloaded activations (MEMO's M_CPU);
        ``"auto"``: available host memory x 0.8, divided among the node's local ranks.
    layer_time: forward seconds of one transformer layer (MEMO's T_layer); ``"auto"``: the
        layer's FLOPs from the graph over a measured matmul rate.
    resident_layers: under ``memo``, the last this-many transformer layers keep their saved
        values on device, neither offloaded nor recomputed (MEMO's eq. 3 counts n - 2).
    memory_plan: give Inductor's buffers static offsets from the bi-level MIP.
    solver_time_limit: seconds the memory planner may spend on one compiled graph (greedy,
        search and MIP solves of all its pools together; the best plan found by then is used).
    dump_dir: write graphs and reports here (per rank, per graph, per stage).
    disable_passes: names of passes to skip.
    lowering: ``inductor``; ``aot_eager`` / ``eager`` for debugging.
    inductor_options: Inductor's config for this compile only, as ``torch.compile(options=)``
        gives it to ``backend="inductor"`` (``{"max_autotune": True}``, ``{"cpp.simdlen": 1}``);
        names from ``torch._inductor.list_options()``.  The hooks the backend sets itself
        (``backend.py::_inductor_patches``) are refused.
    allow_graphs_without_attention: let a multi-rank graph with no attention call run on each
        rank's tokens alone.  Off by default: the token analysis cannot see inside opaque ops, so a
        graph whose attention the backend did not recognise would otherwise run locally, wrong.
    token_local_ops: names of custom ops (``"namespace::name"``) that compute every token on its
        own (e.g. a fused RMSNorm); any other custom op on token data is refused under hp*cp > 1.
    rank_check_timeout: seconds a rank waits for the others to confirm they compiled the same
        graph before its first collective (then it raises instead of hanging).
    lm_head_chunk: tokens per chunk of the LM head and its loss when the loss is in the graph
        (``passes/loss/lm_head.py``); ``"auto"``: as many as keep one chunk's float32 logits
        within 128 MiB, a multiple of 64 (``estimate/lm_head.py::chunk_tokens``, which
        ``loong estimate`` and ``loong plan`` use too).
    """

    hp: int = 1
    cp: int = 1
    placement: Placement = "head_first"
    inner_ring: int = 1
    activations: ActivationPolicy = "none"
    alpha: float | str = "auto"
    host_bandwidth: float | str = "auto"
    host_memory: float | str = "auto"
    layer_time: float | str = "auto"
    resident_layers: int = 2
    memory_plan: bool = False
    solver_time_limit: float = 10.0
    dump_dir: str | None = None
    disable_passes: tuple[str, ...] = ()
    lowering: str = "inductor"
    inductor_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    allow_graphs_without_attention: bool = False
    token_local_ops: tuple[str, ...] = ()
    rank_check_timeout: float = 300.0
    lm_head_chunk: int | str = "auto"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name))
        # the one rule between fields (sizes that need a world, a batch or a model are checked
        # where those are known: parallel/mesh.py, parallel/tokens.py, ops/attention.py)
        violation = inner_ring_violation(self.cp, self.inner_ring)
        if violation:
            raise LoongConfigError(*violation)

    @property
    def sp(self) -> int:
        return self.hp * self.cp

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | LoongConfig | None = None,
                     environ: Mapping[str, str] | None = None) -> LoongConfig:
        """Build from ``LOONG_*`` variables overridden by ``options`` (a dict or a LoongConfig)."""
        if isinstance(options, LoongConfig):
            return options
        if options is not None and not isinstance(options, Mapping):
            raise LoongConfigError(
                f"options={options!r} has type {type(options).__name__}",
                "options must be a dict or a LoongConfig",
                'pass e.g. options={"hp": 2, "cp": 2}')
        values = _from_environ(os.environ if environ is None else environ)
        for key, value in (options or {}).items():
            values[_known_key(key, "option")] = _coerce(key, value)
        return cls(**values)


_FIELDS = {f.name: f for f in dataclasses.fields(LoongConfig)}


def _known_key(key: str, source: str) -> str:
    if key not in _FIELDS:
        valid = ", ".join(_FIELDS)
        raise LoongConfigError(f"unknown {source} {key!r}", f"valid keys are {valid}",
                               f"remove {key!r} or correct its spelling")
    return key


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = _known_key(name[len(ENV_PREFIX):].lower(), f"environment variable {name}; option")
        values[key] = _coerce(key, raw, from_env=True)
    return values


def _coerce(key: str, value: Any, from_env: bool = False) -> Any:
    """Turn environment strings and lists into the field's type; leave other values to _check."""
    if key in ("disable_passes", "token_local_ops"):
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if isinstance(value, (list, tuple, set, frozenset)):
            return tuple(value)
        return value
    if not from_env:
        return value
    if key in ("hp", "cp", "inner_ring"):
        return _parse(key, value, int, "an integer >= 1")
    if key == "lm_head_chunk":
        return value if value == "auto" else _parse(key, value, int, '"auto" or an integer >= 1')
    if key == "resident_layers":
        return _parse(key, value, int, "an integer >= 0")
    if key in _MEASURED:
        return value if value == "auto" else _parse(key, value, float, f'"auto" or {_MEASURED[key]}')
    if key in ("solver_time_limit", "rank_check_timeout"):
        return _parse(key, value, float, "a number of seconds > 0")
    if key == "alpha":
        return value if value == "auto" else _parse(key, value, float, '"auto" or a float in [0, 1]')
    if key in ("memory_plan", "allow_graphs_without_attention"):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise LoongConfigError(f"{ENV_PREFIX}{key.upper()}={value!r}", "expected a boolean",
                               "use 1/0, true/false, yes/no or on/off")
    if key == "dump_dir":
        return value or None
    if key == "inductor_options":
        try:
            return json.loads(value)
        except ValueError:
            raise LoongConfigError(f"{ENV_PREFIX}{key.upper()}={value!r}", "expected a JSON object",
                                   f"set e.g. {ENV_PREFIX}{key.upper()}='{{\"max_autotune\": true}}'") from None
    return value


def _parse(key: str, raw: str, kind: type, expected: str) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise LoongConfigError(f"{ENV_PREFIX}{key.upper()}={raw!r}", f"{key} must be {expected}",
                               f"set {ENV_PREFIX}{key.upper()} to {expected}") from None


# Quantities MEMO's LP needs: "auto" (measured at compile time) or a number, with its rule.
_MEASURED = {"host_bandwidth": "a number of bytes/s > 0", "host_memory": "a number of bytes >= 0",
             "layer_time": "a number of seconds > 0"}


def _check(key: str, value: Any) -> None:
    def bad(rule: str, fix: str) -> LoongConfigError:
        return LoongConfigError(f"{key}={value!r}", rule, fix)

    if key in ("hp", "cp", "inner_ring"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"{key} must be an integer >= 1", f"pass {key}=1 or a larger integer")
    elif key in ("placement", "activations", "lowering"):
        choices = {"placement": PLACEMENTS, "activations": ACTIVATION_POLICIES,
                   "lowering": LOWERINGS}[key]
        if value not in choices:
            raise bad(f"{key} must be one of {', '.join(choices)}",
                      f"pass {key}={choices[0]!r} or another listed value")
    elif key == "alpha":
        if value == "auto":
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise bad('alpha must be "auto" or a number in [0, 1]',
                      'pass alpha="auto" to solve MEMO\'s LP, or a fraction such as 0.5')
    elif key in _MEASURED:
        if value == "auto":
            return
        low_ok = key == "host_memory"
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                or (value == 0 and not low_ok) or value != value or value == float("inf")):
            raise bad(f'{key} must be "auto" or {_MEASURED[key]}',
                      f'pass {key}="auto" to measure it, or a finite number')
    elif key == "lm_head_chunk":
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad('lm_head_chunk must be "auto" or a number of tokens >= 1',
                      'pass lm_head_chunk="auto" or e.g. lm_head_chunk=1024')
    elif key == "resident_layers":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("resident_layers must be an integer >= 0",
                      "pass resident_layers=2 (MEMO's default) or another count of layers")
    elif key == "inductor_options":
        if not isinstance(value, Mapping):
            raise bad("inductor_options must be a dict of Inductor config names to values",
                      'pass e.g. inductor_options={"max_autotune": True}')
        # torch only here: the estimator and the CLI import this module without it
        from loong_compile._compat.inductor import inductor_option_names

        unknown = sorted(set(value) - inductor_option_names())
        if unknown:
            raise bad(f"{', '.join(map(repr, unknown))} is not an Inductor config name "
                      "(torch._inductor.list_options())", "remove it or correct its spelling")
    elif key in ("memory_plan", "allow_graphs_without_attention"):
        if not isinstance(value, bool):
            raise bad(f"{key} must be True or False", f"pass {key}=True or {key}=False")
    elif key in ("solver_time_limit", "rank_check_timeout"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise bad(f"{key} must be a positive number of seconds", f"pass e.g. {key}=10")
    elif key == "dump_dir":
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise bad("dump_dir must be a path or None", 'pass e.g. dump_dir="out/"')
    elif key == "disable_passes":
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise bad("disable_passes must be a list of pass names",
                      'pass e.g. disable_passes=["attention_2d"]')
    elif key == "token_local_ops":
        if not isinstance(value, tuple) or not all(isinstance(v, str) and "::" in v for v in value):
            raise bad('token_local_ops must be a list of op names "namespace::name"',
                      'pass e.g. token_local_ops=["liger::rms_norm"]')
