"""``make gpu-check``: the CUDA paths on the first GPU it meets (kernels, Double-Ring,
side-stream offload, device memory per policy, the memory plan on Inductor's CUDA code).

``python -m loong_compile.gpu_check [--out DIR] [--only NAME ...]`` writes
``gpu_check.json`` and ``gpu_check.md``; exits 1 if a check failed, 0 otherwise
(without CUDA every check is skipped, with the reason)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loong_compile.gpu_check.checks import CHECKS
from loong_compile.gpu_check.report import environment, run_check, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--only", nargs="*", choices=[name for name, _ in CHECKS])
    args = parser.parse_args(argv)
    results = []
    for name, check in CHECKS:
        if args.only and name not in args.only:
            continue
        result = run_check(name, check)
        print(f"{name}: {result.status} ({result.seconds:.1f} s) {result.detail}", flush=True)
        results.append(result)
    json_path, md_path = write_report(results, environment(), args.out)
    print(f"wrote {json_path} and {md_path}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
