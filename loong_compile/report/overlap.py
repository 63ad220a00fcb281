"""Overlap as Inductor generated it: for every asynchronous start in a compiled graph's
wrapper code (a host offload, a reload, a functional collective), the compute kernels the
code runs between the start and its wait.

The FX graph says where a pass *placed* a wait; Inductor's scheduler may move it
(``reorder_for_peak_memory`` pulls a wait up to its copy when nothing forbids it).  What
runs is the wrapper's ``call`` function, so that is what this module reads: one statement
a line, buffers named ``bufN``, a fallback op's result aliased once (``buf5 = buf4``).

``overlap_of(code)`` returns one ``AsyncSpan`` per start; ``summary(spans)`` the figures
the backend writes into the report (``overlap`` record, per graph kind) and
``benchmarks/overlap.py`` prints.  A start whose wait is missing from the code (a
collective waited in another graph) is listed with ``wait_line = None``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# Asynchronous starts: the op's qualified name -> the kind reported.
STARTS = {
    "loong.offload": "offload",
    "loong.reload": "reload",
    "_c10d_functional.all_to_all_single": "all_to_all",
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
}
WAITS = ("loong.wait_tensor", "_c10d_functional.wait_tensor")
# Calls that run no kernel: allocation, checks, views, stream bookkeeping.
NOT_KERNELS = re.compile(
    r"^(empty_strided\w*|assert_\w+|reinterpret_tensor|torch\._C\._\w+|"
    r"torch\.cuda\.\w+|stream\w*\.\w+|get_raw_stream|\w+\.record_stream|args\.clear)$")
_CALL = re.compile(r"^(?:(\w+(?:\s*,\s*\w+)*)\s*=\s*)?([\w.]+)\((.*)$")
_ALIAS = re.compile(r"^(\w+)\s*=\s*(\w+)$")
_OP = re.compile(r"^torch\.ops\.([\w]+\.[\w]+)\.\w+$")
_FIRST_ARG = re.compile(r"^\s*(?:reinterpret_tensor\()?(\w+)")
_LAYER_ARG = re.compile(r",\s*(-?\d+)\)\s*$")


@dataclasses.dataclass
class AsyncSpan:
    """One asynchronous start and its wait in a graph's generated code."""

    kind: str                 # offload, reload, all_to_all, ...
    start_line: int           # statement index of the start in ``call``
    wait_line: int | None     # of its wait; None when the code has none
    kernels_between: int      # compute kernels launched between the two
    source: str               # the start's first argument (what is copied or sent)
    layer: int | None = None  # the swapped layer a loong.wait_tensor names (its last argument)


def call_body(code: str) -> list[str]:
    """The statements of the wrapper's ``call`` function (stripped, comments dropped)."""
    lines, inside, indent = [], False, 0
    for raw in code.splitlines():
        stripped = raw.strip()
        if not inside:
            if re.match(r"def call\((self, )?args\)", stripped):
                inside, indent = True, len(raw) - len(raw.lstrip())
            continue
        if stripped and len(raw) - len(raw.lstrip()) <= indent:
            break
        if stripped and not stripped.startswith("#"):
            lines.append(stripped)
    return lines


def _is_kernel(callee: str) -> bool:
    if NOT_KERNELS.match(callee):
        return False
    op = _OP.match(callee)
    if op is not None:
        return op.group(1) not in STARTS and op.group(1) not in WAITS
    return True


def overlap_of(code: str) -> list[AsyncSpan]:
    """Every async start of the generated ``code`` with its wait and the kernels between."""
    body = call_body(code)
    alias: dict[str, str] = {}
    open_starts: dict[str, AsyncSpan] = {}
    spans: list[AsyncSpan] = []
    kernels = 0                       # kernels launched so far
    launched_at: dict[int, int] = {}  # span id -> kernels launched before its start
    for index, statement in enumerate(body):
        plain = _ALIAS.match(statement)
        if plain is not None:
            alias[plain.group(1)] = alias.get(plain.group(2), plain.group(2))
            continue
        call = _CALL.match(statement)
        if call is None:
            continue
        result, callee, rest = call.groups()
        op = _OP.match(callee)
        name = op.group(1) if op else ""
        first = _FIRST_ARG.match(rest)
        first = alias.get(first.group(1), first.group(1)) if first else ""
        if name in STARTS and result:
            span = AsyncSpan(STARTS[name], index, None, 0, first)
            open_starts[result.split(",")[0].strip()] = span
            launched_at[id(span)] = kernels
            spans.append(span)
        elif name in WAITS:
            span = open_starts.pop(first, None)
            if span is not None:
                span.wait_line = index
                span.kernels_between = kernels - launched_at[id(span)]
                layer = _LAYER_ARG.search(rest) if name == "loong.wait_tensor" else None
                span.layer = int(layer.group(1)) if layer and int(layer.group(1)) >= 0 else None
        elif _is_kernel(callee):
            kernels += 1
    return spans


def late_prefetches(spans: list[AsyncSpan]) -> list[AsyncSpan]:
    """The reloads that start after the backward of their layer has begun: after the layer
    first reads what was swapped out (the first wait of any of its reloads)."""
    first_use: dict[int, int] = {}
    for span in spans:
        if span.kind == "reload" and span.layer is not None and span.wait_line is not None:
            first_use[span.layer] = min(first_use.get(span.layer, span.wait_line), span.wait_line)
    return [s for s in spans if s.kind == "reload" and s.layer in first_use
            and s.start_line > first_use[s.layer]]


def summary(spans: list[AsyncSpan]) -> dict[str, Any]:
    """Per kind: how many starts, the fewest / total kernels between start and wait, and how
    many starts have none (the figures ``docs/benchmarks.md`` records); for reloads, how many
    start after their layer's first use of swapped data (``late_prefetches``)."""
    kinds: dict[str, dict[str, Any]] = {}
    for span in spans:
        row = kinds.setdefault(span.kind, {"starts": 0, "unwaited": 0, "exposed": 0,
                                           "min_kernels_between": None, "kernels_between": []})
        row["starts"] += 1
        if span.wait_line is None:
            row["unwaited"] += 1
            continue
        row["exposed"] += span.kernels_between == 0
        row["kernels_between"].append(span.kernels_between)
        low = row["min_kernels_between"]
        row["min_kernels_between"] = span.kernels_between if low is None else min(low, span.kernels_between)
    if "reload" in kinds:
        kinds["reload"]["late_prefetches"] = len(late_prefetches(spans))
    return kinds
