"""Reports and dumps: what every pass matched, changed and decided, per compiled graph.

``GraphReport`` collects one compiled graph's stages; ``Report`` is what
``loong_compile.explain`` returns (one entry per graph Dynamo compiled).  With
``dump_dir`` set, each stage's graph code and the report are written to
``<dump_dir>/rank<r>/graph<g>/``; graphs are also emitted as structured-trace
artifacts, so ``TORCH_TRACE`` + tlparse show them beside Inductor's own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch.fx

from loong_compile._compat.trace import trace_artifact


@dataclasses.dataclass
class PassRecord:
    name: str
    stage: str
    graph_kind: str
    seconds: float
    summary: dict[str, Any]


@dataclasses.dataclass
class GraphReport:
    """Everything the backend decided for one Dynamo graph."""

    graph_id: int
    rank: int
    config: dict[str, Any]
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    dump_dir: str | None = None

    def summary(self, pass_name: str, graph_kind: str | None = None) -> dict[str, Any]:
        """The summary of ``pass_name`` (for ``graph_kind`` if it ran on several graphs)."""
        for record in self.passes:
            if record.name == pass_name and graph_kind in (None, record.graph_kind):
                return record.summary
        raise KeyError(f"pass {pass_name!r} did not run on graph {self.graph_id}"
                       + (f" ({graph_kind})" if graph_kind else ""))

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(self)

    def to_markdown(self) -> str:
        lines = [f"# loong_compile report: graph {self.graph_id}, rank {self.rank}", "",
                 "## Config", ""]
        lines += [f"- `{k}`: `{v}`" for k, v in self.config.items()]
        lines += ["", "## Passes", ""]
        if not self.passes:
            lines.append("No pass ran.")
        for r in self.passes:
            lines += [f"### `{r.name}` ({r.stage}, {r.graph_kind}, {r.seconds * 1e3:.1f} ms)", ""]
            for key, value in r.summary.items():
                lines.append(f"- **{key}**: {_markdown_value(value)}")
            lines.append("")
        if self.skipped:
            lines += ["## Skipped", ""]
            lines += [f"- `{s['name']}` ({s['stage']}): {s['reason']}" for s in self.skipped]
        if self.stage_seconds:
            lines += ["", "## Time per stage", ""]
            lines += [f"- {k}: {v:.3f} s" for k, v in self.stage_seconds.items()]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass
class Report:
    """The reports of every graph one ``explain`` call compiled."""

    graphs: list[GraphReport]

    def summary(self, pass_name: str, graph_kind: str | None = None) -> dict[str, Any]:
        """The first summary ``pass_name`` produced, across graphs."""
        for g in self.graphs:
            try:
                return g.summary(pass_name, graph_kind)
            except KeyError:
                continue
        raise KeyError(f"pass {pass_name!r} did not run on any graph")

    def to_dict(self) -> dict[str, Any]:
        return {"graphs": [g.to_dict() for g in self.graphs]}

    def to_markdown(self) -> str:
        return "\n".join(g.to_markdown() for g in self.graphs)


class Dumper:
    """Writes one graph's stages and report under ``<dump_dir>/rank<r>/graph<g>/``."""

    def __init__(self, report: GraphReport, dump_dir: str | None):
        self.report = report
        self.dir = Path(dump_dir, f"rank{report.rank}", f"graph{report.graph_id}") if dump_dir else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            report.dump_dir = str(self.dir)
        self._count = 0

    def graph(self, stage: str, graph_kind: str, when: str, graph: Any) -> None:
        """Record a stage's graph (``when``: "before"/"after" its passes, or "" when none ran):
        a file in dump_dir and a structured-trace artifact."""
        parts = [stage] + ([graph_kind] if graph_kind != stage else []) + ([when] if when else [])
        name = "_".join(parts)
        code = functools.cache(lambda: _readable(graph))
        trace_artifact(f"loong_{name}", code)
        if self.dir is not None:
            self._count += 1
            (self.dir / f"{self._count:02d}_{name}.py").write_text(code())

    def write_report(self) -> None:
        text = functools.cache(lambda: json.dumps(self.report.to_dict(), indent=1))
        trace_artifact("loong_report", text, encoding="json")
        if self.dir is not None:
            (self.dir / "report.json").write_text(text())
            (self.dir / "report.md").write_text(self.report.to_markdown())


def _readable(graph: Any) -> str:
    if isinstance(graph, torch.fx.GraphModule):
        return graph.print_readable(print_output=False, include_stride=True, include_device=True)
    if isinstance(graph, torch.fx.Graph):
        return str(graph.python_code(root_module="self", verbose=True).src)
    return str(graph)  # stages whose "graph" is not fx (inductor: a PoolRequest)


def _jsonable(value: Any) -> Any:
    # not dataclasses.asdict: it deep-copies every value, and the summary of a dynamic-shape
    # graph holds symbolic sizes (SymInt), which do not copy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)


def _markdown_value(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], dict):
        return "\n" + "\n".join(f"  - {json.dumps(_jsonable(v))}" for v in value)
    return f"`{json.dumps(_jsonable(value))}`"
