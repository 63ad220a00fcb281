"""The trust matrix: real Hugging Face models x the habits users have, exact or refused.

Each case trains one step of a tiny model under ``backend="loong"`` on 2 or 4 gloo ranks and
compares the loss and gradients (summed over the ranks, as the examples' training loop does)
with one process on the full sequence in float64 (float32 for the mixtures of experts: see
``trust_cases.precision``) — or records the ``LoongError`` it raised.  The cases are
trust_cases.py's, their runs on the ranks trust_run.py's, the reference and the verdicts
trust_reference.py's; this module prints them: ``python tests/trust_matrix.py`` prints the
table that docs/usage.md shows.
"""

from __future__ import annotations

import sys

from hf_models import ARCHITECTURES, ATTENTION_VARIANTS, SCAN_ARCHITECTURES
from trust_cases import Case, all_cases
from trust_reference import INDUCTOR_TOLERANCE, judge
from trust_run import run_matrix

TABLE_COLUMNS = 11  # models per table in docs/usage.md (two tables: the first eleven, the rest)


def markdown(cases: list[Case], results: dict) -> str:
    """The tables of docs/usage.md: one row per (attention, window, habit), one column per model,
    ``TABLE_COLUMNS`` models a table; then each refused row's message (its first model's, and
    each token-mixing architecture's own)."""
    import re

    rows: dict[tuple, dict[str, tuple[str, str]]] = {}
    for case in cases:
        rows.setdefault((case.attn, case.window, case.habit), {})[case.arch] = judge(case, results[case])
    archs = list(ARCHITECTURES) + list(ATTENTION_VARIANTS) + list(SCAN_ARCHITECTURES)
    lines, messages = [], []
    for start in range(0, len(archs), TABLE_COLUMNS):
        group = archs[start:start + TABLE_COLUMNS]
        lines += ["| attention, window, habit | " + " | ".join(group) + " |",
                  "|---|" + "---|" * len(group)]
        for key, verdicts in rows.items():
            if any(a in verdicts for a in group):
                cells = [verdicts[a][0] if a in verdicts else "" for a in group]
                lines.append(f"| {_label(*key)} | " + " | ".join(cells) + " |")
        lines.append("")
    for key, verdicts in rows.items():
        refused = [(a, d) for a, (v, d) in verdicts.items() if v == "refused"]
        own = ATTENTION_VARIANTS   # each refused with its own message
        first = [(None, d) for a, d in refused if a not in own][:1]
        for arch, detail in first + [(a, d) for a, d in refused if a in own]:
            text = re.sub(r'File "[^"]*/([^/"]+)"', r"\1", detail)
            messages.append(f"- **{f'{arch}, ' if arch else ''}{_label(*key)}**: `{text}`")
    return "\n".join(lines + ["What a user sees for each refused row (first model's message, and "
                              "each attention variant's):", ""] + messages)


def _label(attn: str, window: int | None, habit: str) -> str:
    return f"{attn}{f', window {window}' if window else ''}, {habit.replace('_', ' ')}"


def _main(argv: list[str]) -> None:
    """``python tests/trust_matrix.py [names...] [--markdown]``: the matrix's cases whose name
    contains a given word, on 2 ranks (cp=2, aot_eager).  ``--habit H``: case H of every
    architecture named (all of ARCHITECTURES by default) instead.  ``--inductor``: at
    hp=2 x cp=2 on 4 ranks under Inductor, judged within INDUCTOR_TOLERANCE; ``--options
    JSON``: more backend options (an activation policy)."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--habit")
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--options", type=json.loads, default={})
    args = parser.parse_args(argv)
    if args.habit:
        cases = [Case(arch, habit=args.habit) for arch in args.names or ARCHITECTURES]
    else:
        cases = [c for c in all_cases() if not args.names or any(w in c.name for w in args.names)]
    hp, cp, options = 1, 2, dict(args.options)
    if args.inductor:
        hp, options = 2, {"lowering": "inductor", "rank_check_timeout": 60, **options}
    from loong_compile.testing import keep_ranks

    with keep_ranks():
        results = run_matrix(cases, hp * cp, hp, cp, options or None)
    if args.markdown:
        print(markdown(cases, results))
        return
    for case in cases:
        verdict, detail = judge(case, results[case], INDUCTOR_TOLERANCE if args.inductor else 0)
        print(f"{case.name:40s} {verdict:8s} {detail}", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
