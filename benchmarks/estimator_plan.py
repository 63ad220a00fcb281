"""Time ``loong plan`` (Llama-3.1-8B, 128K tokens, 64 H100s): the command end to end, and its parts.

    python benchmarks/estimator_plan.py [--runs 5]

Prints the median and range of: the whole command as a fresh process (what a user waits
for), importing ``loong_compile`` alone in a fresh process (the package's own import, which
the command pays before any of its code runs), and ``plan()`` in a warm process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMAND = ["plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "64", "--gpu", "h100"]


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _summary(name: str, seconds: list[float]) -> str:
    return (f"{name:<44} median {statistics.median(seconds):6.2f} s   "
            f"min {min(seconds):6.2f} s   max {max(seconds):6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    whole = [_wall([sys.executable, "-m", "loong_compile.cli", *COMMAND]) for _ in range(runs)]
    package = [_wall([sys.executable, "-c", "import loong_compile"]) for _ in range(runs)]
    from loong_compile.estimate import load_hardware, load_model, plan

    in_process = []
    for _ in range(runs):
        start = time.perf_counter()
        plan(load_model("llama3.1-8b"), 131072, 64, load_hardware("h100"))
        in_process.append(time.perf_counter() - start)
    print("loong " + " ".join(COMMAND))
    print(_summary("whole command (fresh process)", whole))
    print(_summary("import loong_compile (fresh process)", package))
    print(_summary("plan() in a warm process", in_process))


if __name__ == "__main__":
    main()
