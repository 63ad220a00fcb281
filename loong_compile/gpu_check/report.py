"""gpu-check's results: one ``CheckResult`` per check, run so that nothing escapes, and
the JSON and markdown summaries written from them."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STATUSES = ("pass", "fail", "skipped")


class Skip(Exception):
    """Raised by a check that cannot run here; the message is the reason."""


@dataclasses.dataclass
class CheckResult:
    name: str
    status: str                    # one of STATUSES
    detail: str                    # the reason of a skip or failure, or what passed
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def run_check(name: str, check: Callable[[dict[str, Any]], str]) -> CheckResult:
    """Run ``check(figures)``: it fills ``figures``, returns what passed, raises ``Skip``
    or fails with ``AssertionError`` (or any error: reported with its traceback's last line)."""
    figures: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        status, detail = "pass", check(figures)
    except Skip as skip:
        status, detail = "skipped", str(skip)
    except Exception as error:  # noqa: BLE001 - every failure is a result, the run goes on
        where = traceback.extract_tb(error.__traceback__)[-1]
        status = "fail"
        detail = f"{type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})"
    return CheckResult(name, status, detail, figures, round(time.perf_counter() - start, 3))


def environment() -> dict[str, Any]:
    """The machine and versions the results belong to."""
    from loong_compile import _compat

    cuda = torch.cuda.is_available()
    try:
        import flash_attn
        flash = flash_attn.__version__
    except ImportError:
        flash = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "flash_attn": flash,
        "python": platform.python_version(),
        "degraded_capabilities": [c.name for c in _compat.degraded()],
    }


def markdown(results: list[CheckResult], env: dict[str, Any]) -> str:
    """The summary that goes into docs/benchmarks.md."""
    lines = [f"### gpu-check, {env['date']}", "",
             f"GPU: {env['gpu'] or 'none'}; torch {env['torch']}; CUDA {env['cuda'] or '-'}; "
             f"flash-attn {env['flash_attn'] or 'not installed'}; degraded capabilities: "
             f"{', '.join(env['degraded_capabilities']) or 'none'}", "",
             "| check | status | seconds | detail |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |")
    for r in results:
        if r.figures:
            lines += ["", f"**{r.name}**", "", "```json", json.dumps(r.figures, indent=1), "```"]
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items())]
    return "\n".join(lines) + "\n"


def write_report(results: list[CheckResult], env: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``gpu_check.json`` and ``gpu_check.md`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    json_path.write_text(json.dumps({"environment": env,
                                     "checks": [dataclasses.asdict(r) for r in results]},
                                    indent=1, default=str))
    md_path.write_text(markdown(results, env))
    return json_path, md_path
