"""``longest_sequence.py --side-by-side``: issue 52's table, the longest sequence under one memory
cap for ``backend="loong"`` against plain Inductor, Inductor with transformers' gradient
checkpointing and DeepSpeed's ALST (``alst.py``), on one process and on 4 ranks.

    pip install deepspeed
    python benchmarks/longest_sequence.py --side-by-side --model tiny-1b \
        --config num_attention_heads=4 num_key_value_heads=1 head_dim=32 \
        --cap-mib 64 --start 512 --limit 65536 --tile-tokens 512 --head-groups 2

Each (variant, hp, cp) of ``SIDE_BY_SIDE`` runs ``longest_sequence.py`` in a process of its own
(``torchrun`` for 4 ranks), so that ALST's patches of transformers stay in its process and each
peak is the variant's own; every rank's peak must stay under the cap.  On 4 ranks ``loong`` runs
2D-Attention at hp=2 x cp=2 and ALST Ulysses over the 4; ``--head-groups`` is ``loong``'s option
(attention a group of heads at a time) for the 4-rank rows: on one process it would replace
transformers' SDPA, which ``loong`` leaves as it is there, with 2D-Attention's op (``sc++`` +
tiles then peaked higher: 5,632 tokens against 8,704, 2026-12-02).  Plain Inductor splits no sequence:
on many ranks each holds all of it, so its longest there is its one-process figure (not re-run).
Ranks compile with one Inductor compile thread, as the test suite's do (4 ranks share 2 cores).
A run killed while Inductor writes a kernel leaves an empty ``.so`` in its cache, which every
later load of that kernel fails on ("file too short"): remove that file.

What stays in the process counts: on CPU the host is the device, so a policy that offloads to
the host frees nothing here, and ALST's offload of its checkpointed inputs is left out with it;
the variants compared keep everything in the process (``loong``'s sc++ and full with tiles,
ALST with checkpointing, TiledMLP and its tiled loss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).with_name("longest_sequence.py"))
# (variant, hp, cp); ALST's Ulysses spans hp x cp ranks
SIDE_BY_SIDE = [("inductor", 1, 1), ("inductor+ckpt", 1, 1), ("alst", 1, 1),
                ("loong-sc++ +tiles", 1, 1), ("loong-full+tiles", 1, 1), ("alst", 2, 2),
                ("loong-full+tiles", 2, 2)]


def side_by_side(argv: list[str], args) -> list[dict]:
    """Every row of ``SIDE_BY_SIDE``, then the table: each row's longest against ``loong``'s
    best at the same ranks."""
    rows = [_run(argv, variant, hp, cp) for variant, hp, cp in SIDE_BY_SIDE]
    alone = [r for r in rows if r["ranks"] == 1 and r["variant"].startswith("inductor")]
    for ranks in sorted({r["ranks"] for r in rows}):
        at = [r for r in rows if r["ranks"] == ranks]
        loong = max((r for r in at if r["variant"].startswith("loong")), key=lambda r: r["longest"])
        print(f"{ranks} rank(s): loong's best is {loong['variant']}, {loong['longest']:,} tokens"
              + (" (the --limit)" if loong["longest"] + args.start > args.limit else ""))
        for row in at + (alone if ranks > 1 else []):
            ratio = loong["longest"] / row["longest"] if row["longest"] else float("inf")
            print(f"  {row['variant']:>18} ({row['layout']}) {row['longest']:>9,} tokens, peak "
                  f"{row.get('peak_gib', 0) * 1024:6.1f} MiB, first loss "
                  f"{row['loss_at_start']}: loong's best / it {ratio:.2f}x")
    return rows


def _run(argv: list[str], variant: str, hp: int, cp: int) -> dict:
    own = [a for a in argv if a != "--side-by-side"]
    if hp * cp == 1 and "--head-groups" in own:   # on many ranks only (the module's docstring)
        at = own.index("--head-groups")
        own = own[:at] + own[at + 2:]
    command = [sys.executable, SCRIPT, *own, "--variants", variant, "--no-rerun",
               "--hp", str(hp), "--cp", str(cp)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    if hp * cp > 1:
        # torchrun reads --start as its own --start-method: the script's --first
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(hp * cp), *("--first" if a == "--start" else a for a in command[1:])]
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env=env)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row
