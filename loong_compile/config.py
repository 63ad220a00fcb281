"""LoongConfig: the backend's options, from ``options=`` and ``LOONG_*`` variables.

Environment variables give defaults (``LOONG_HP=2``); explicit ``options``
override them.  Every key is validated here, once, and so is the one rule
between keys (the inner ring divides cp, ``loong_compile.parallel.rules``), so passes
and ops can trust the values they read.  A field's annotation is its one declaration of type:
it decides how a ``LOONG_*`` string is read and which values pass; ``_RULES`` adds what a
type cannot say (a range, the words of a refusal).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from loong_compile.errors import LoongConfigError
from loong_compile.parallel.rules import ActivationPolicy, Placement, inner_ring_violation

Lowering = Literal["inductor", "aot_eager", "eager"]
ENV_PREFIX = "LOONG_"


@dataclasses.dataclass(frozen=True)
class LoongConfig:
    """Options of ``torch.compile(model, backend="loong", options=...)``.

    hp, cp: head-parallel and context-parallel degrees (sp = hp * cp ranks share a sequence).
    placement: ``head_first`` keeps an HP group on consecutive ranks, ``context_first`` a CP group
        (``parallel/rules.py::PLACEMENT_DOCS``).
    inner_ring: ranks per inner ring of the Double-Ring (must divide cp).
    head_groups: groups of heads each attention runs one after the other on a rank (the head
        all-to-all, the ring and the all-to-all back: ``ops/attention/head_groups.py``), so that
        one group's attention working set is live at a time; it divides the query heads a rank
        holds (``heads / hp``), and divides its KV heads or is a multiple of them.  1: no groups.
    activations: ``none`` (Inductor's partition), ``sc++`` (save layer inputs and attention
        outputs, recompute the rest), ``memo`` (offload + token-slice recompute), ``full`` (save
        layer inputs, recompute the rest, attention too), ``full_offload`` (``full`` with the
        inputs on the host) (``parallel/rules.py::ACTIVATION_POLICY_DOCS``).
    alpha: fraction of "other" activations' tokens offloaded under ``memo``; ``"auto"`` solves MEMO's LP.
    host_bandwidth: host<->device copy bandwidth in bytes/s (MEMO's B); ``"auto"`` measures it.
    host_memory: host bytes this rank may fill with offloaded activations (MEMO's M_CPU);
        ``"auto"``: available host memory x 0.8, divided among the node's local ranks.
    layer_time: forward seconds of one transformer layer (MEMO's T_layer); ``"auto"``: the
        layer's FLOPs from the graph over a measured matmul rate.
    resident_layers: under ``memo`` and ``full_offload``, the last this-many transformer layers
        keep their saved values on device, neither offloaded nor recomputed (MEMO's eq. 3 counts
        n - 2).  A block compiled on its own is every block's graph: none stays resident.
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
        (``passes/tiling/lm_head.py``); ``"auto"``: as many as keep one chunk's float32 logits
        within 128 MiB, a multiple of 64 (``estimate/lm_head.py::chunk_tokens``, which
        ``loong estimate`` and ``loong plan`` use too).
    tile_tokens: tokens per tile of a token-local region wider inside than at its edges (an
        MLP: ``passes/tiling/regions.py``); ``"auto"``: the largest tile whose intermediates fit
        1 GiB, a multiple of 64 (``estimate/tiling.py::region_tile``), no tiling when all the
        tokens fit; 0: no tiling.
    """

    hp: int = 1
    cp: int = 1
    placement: Placement = "head_first"
    inner_ring: int = 1
    head_groups: int = 1
    activations: ActivationPolicy = "none"
    alpha: float | Literal["auto"] = "auto"
    host_bandwidth: float | Literal["auto"] = "auto"
    host_memory: float | Literal["auto"] = "auto"
    layer_time: float | Literal["auto"] = "auto"
    resident_layers: int = 2
    memory_plan: bool = False
    solver_time_limit: float = 10.0
    dump_dir: str | os.PathLike | None = None
    disable_passes: tuple[str, ...] = ()
    lowering: Lowering = "inductor"
    inductor_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    allow_graphs_without_attention: bool = False
    token_local_ops: tuple[str, ...] = ()
    rank_check_timeout: float = 300.0
    lm_head_chunk: int | Literal["auto"] = "auto"
    tile_tokens: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        for key, hint in _TYPES.items():
            _check(key, getattr(self, key), hint)
        # the one rule between fields (sizes that need a world, a batch or a model are checked
        # where those are known: parallel/mesh.py, parallel/tokens.py, ops/attention/attention_2d.py)
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
            key = _known_key(key, "option")
            values[key] = _coerce(key, value)
        return cls(**values)


# each field's annotation, the one place its type is declared
_TYPES: dict[str, Any] = typing.get_type_hints(LoongConfig)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """What a field's type cannot say: the numbers it allows and the words of its refusal,
    ``"{key} must be {must}"`` and ``fix`` (where ``{key}`` is the field's name).  Without
    words, a Literal's choices or a bool's values say them."""

    must: str = ""
    fix: str = ""
    low: float = -math.inf
    low_open: bool = False   # low itself refused too
    high: float = math.inf
    finite: bool = False     # nan and inf refused
    env_must: str = ""       # how a LOONG_* variable's refusal words ``must``, where it differs
    valid: Callable[[Any], bool] = lambda value: True   # a condition beyond the type and range


_COUNT = _Rule("an integer >= 1", "pass {key}=1 or a larger integer", low=1)
_SECONDS = _Rule("a positive number of seconds", "pass e.g. {key}=10", low=0, low_open=True,
                 env_must="a number of seconds > 0")


def _measured(must: str, low_open: bool = True) -> _Rule:
    """A quantity MEMO's LP needs: "auto" (measured at compile time) or a finite number."""
    return _Rule(f'"auto" or {must}', 'pass {key}="auto" to measure it, or a finite number',
                 low=0, low_open=low_open, finite=True)


_RULES = {
    "hp": _COUNT, "cp": _COUNT, "inner_ring": _COUNT, "head_groups": _COUNT,
    "alpha": _Rule('"auto" or a number in [0, 1]',
                   'pass alpha="auto" to solve MEMO\'s LP, or a fraction such as 0.5',
                   low=0, high=1, finite=True, env_must='"auto" or a float in [0, 1]'),
    "host_bandwidth": _measured("a number of bytes/s > 0"),
    "host_memory": _measured("a number of bytes >= 0", low_open=False),
    "layer_time": _measured("a number of seconds > 0"),
    "resident_layers": _Rule("an integer >= 0",
                             "pass resident_layers=2 (MEMO's default) or another count of layers",
                             low=0),
    "solver_time_limit": _SECONDS,
    "dump_dir": _Rule("a path or None", 'pass e.g. dump_dir="out/"'),
    "disable_passes": _Rule("a list of pass names", 'pass e.g. disable_passes=["attention_2d"]'),
    "inductor_options": _Rule("a dict of Inductor config names to values",
                              'pass e.g. inductor_options={"max_autotune": True}'),
    "token_local_ops": _Rule('a list of op names "namespace::name"',
                             'pass e.g. token_local_ops=["liger::rms_norm"]',
                             valid=lambda ops: all("::" in op for op in ops)),
    "rank_check_timeout": _SECONDS,
    "lm_head_chunk": _Rule('"auto" or a number of tokens >= 1',
                           'pass lm_head_chunk="auto" or e.g. lm_head_chunk=1024', low=1,
                           env_must='"auto" or an integer >= 1'),
    "tile_tokens": _Rule('"auto", 0 (no tiling) or a number of tokens >= 1',
                         'pass tile_tokens="auto", tile_tokens=0 or e.g. tile_tokens=4096', low=0,
                         env_must='"auto" or an integer >= 0'),
}
# a refusal needs words: only a Literal's or a bool's type can give them
assert all(key in _RULES or hint is bool or typing.get_origin(hint) is Literal
           for key, hint in _TYPES.items()), "a LoongConfig field without a rule in _RULES"


def _known_key(key: str, source: str) -> str:
    if key not in _TYPES:
        valid = ", ".join(_TYPES)
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


def _members(hint: Any) -> tuple:
    """The types a union annotation joins (the annotation alone otherwise)."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _coerce(key: str, value: Any, from_env: bool = False) -> Any:
    """Turn environment strings and lists into the field's type; leave other values to _check."""
    hint = _TYPES[key]
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if isinstance(value, (list, tuple, set, frozenset)):
            return tuple(value)
        return value
    return _read_env(key, value, hint) if from_env else value


def _read_env(key: str, raw: str, hint: Any) -> Any:
    """A ``LOONG_*`` variable's string as the field's type: a Literal's own words as they are,
    then a bool, a number, a JSON object or an optional path."""
    members, name = _members(hint), f"{ENV_PREFIX}{key.upper()}"
    if any(typing.get_origin(m) is Literal and raw in typing.get_args(m) for m in members):
        return raw
    if bool in members:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise LoongConfigError(f"{name}={raw!r}", "expected a boolean",
                               "use 1/0, true/false, yes/no or on/off")
    for kind in (int, float):
        if kind in members:
            rule = _RULES[key]
            expected = rule.env_must or rule.must
            try:
                return kind(raw)
            except ValueError:
                raise LoongConfigError(f"{name}={raw!r}", f"{key} must be {expected}",
                                       f"set {name} to {expected}") from None
    if typing.get_origin(hint) is Mapping:
        try:
            return json.loads(raw)
        except ValueError:
            raise LoongConfigError(f"{name}={raw!r}", "expected a JSON object",
                                   f"set e.g. {name}='{{\"max_autotune\": true}}'") from None
    if type(None) in members:
        return raw or None
    return raw


def _of_type(value: Any, hint: Any) -> bool:
    """Whether value has the annotation's type (a bool is no number here)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_of_type(value, member) for member in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_of_type(item, args[0]) for item in value)
    if isinstance(value, bool) and hint is not bool:
        return False
    return isinstance(value, (int, float) if hint is float else origin or hint)


def _in_range(value: Any, rule: _Rule) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if rule.finite and not math.isfinite(value):
        return False
    return not (value < rule.low or value > rule.high or (rule.low_open and value == rule.low))


def _check(key: str, value: Any, hint: Any) -> None:
    rule = _RULES.get(key, _Rule())
    if not (_of_type(value, hint) and _in_range(value, rule) and rule.valid(value)):
        if rule.must:
            must, fix = rule.must, rule.fix.replace("{key}", key)
        elif hint is bool:
            must, fix = "True or False", f"pass {key}=True or {key}=False"
        else:
            choices = typing.get_args(hint)
            must, fix = f"one of {', '.join(choices)}", f"pass {key}={choices[0]!r} or another listed value"
        raise LoongConfigError(f"{key}={value!r}", f"{key} must be {must}", fix)
    if key == "inductor_options":
        # torch only here: the estimator and the CLI import this module without it
        from loong_compile._compat.inductor import inductor_option_names

        unknown = sorted(set(value) - inductor_option_names())
        if unknown:
            raise LoongConfigError(
                f"{key}={value!r}", f"{', '.join(map(repr, unknown))} is not an Inductor config "
                "name (torch._inductor.list_options())", "remove it or correct its spelling")
