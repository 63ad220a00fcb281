"""The test suite's time, from pytest's JUnit XML: the slowest items and modules, their share.

    python -m pytest -q --junitxml=suite.xml
    python benchmarks/suite_time.py suite.xml [--top 20]

Each item's time is its setup, call and teardown (pytest's default ``junit_duration_report``),
so a module fixture's spawn is charged to the module's first item.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def item_times(path: str) -> dict[str, float]:
    """``module::test[id]`` -> seconds, for every item in the report."""
    times = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        times[f"{module}::{case.get('name')}"] = float(case.get("time", 0.0))
    return times


def table(rows: list[tuple[str, float]], total: float, title: str) -> str:
    lines = [f"| {title} | s | share |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {t:.1f} | {100 * t / total:.1f} % |" for name, t in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    times = item_times(args.xml)
    total = sum(times.values())
    modules: dict[str, float] = collections.Counter()
    for name, t in times.items():
        modules[name.split("::")[0]] += t
    print(f"{len(times)} items, {total:.0f} s in items\n")
    print(table(sorted(modules.items(), key=lambda kv: -kv[1])[:args.top], total, "module"))
    print()
    print(table(sorted(times.items(), key=lambda kv: -kv[1])[:args.top], total, "item"))


if __name__ == "__main__":
    main()
