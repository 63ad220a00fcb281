"""The test suite's time, from pytest's JUnit XML: the slowest items and modules, their share.

    python -m pytest -q --junitxml=suite.xml
    python benchmarks/suite_time.py suite.xml [--top 20]

With ``RUN_DISTRIBUTED_LOG=ranks.log`` set for the run, ``--ranks-log ranks.log`` adds how many
pools of kept ranks started, by world size and by module (loong_compile.testing: a start pays
process start, imports and Inductor's first compile again).

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


def pool_starts(path: str) -> tuple[collections.Counter, collections.Counter]:
    """(starts by world size, starts by test module) from a ``RUN_DISTRIBUTED_LOG`` file."""
    by_world: collections.Counter = collections.Counter()
    by_module: collections.Counter = collections.Counter()
    with open(path) as log:
        for line in log:
            _, event, world, test = line.split(" ", 3)
            if event == "start":
                by_world[int(world)] += 1
                by_module[test.split("::")[0]] += 1
    return by_world, by_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--ranks-log", help="a RUN_DISTRIBUTED_LOG file of the same run")
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
    if args.ranks_log:
        by_world, by_module = pool_starts(args.ranks_log)
        print(f"\npools started: {sum(by_world.values())}, by world size "
              + ", ".join(f"{w}: {n}" for w, n in sorted(by_world.items())))
        print("by module: " + ", ".join(f"`{m}` {n}" for m, n in by_module.most_common()))


if __name__ == "__main__":
    main()
