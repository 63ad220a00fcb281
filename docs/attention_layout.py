"""Draw the 2D-Attention token layout and Double-Ring schedule as ASCII (used in docs/attention.md).

    python docs/attention_layout.py [--seq 16] [--hp 2] [--cp 2] [--inner-ring 1]
        [--placement head_first]

Everything is read from loong_compile (data.local_token_indices, mesh.rank_layout),
so the picture is the layout the code uses.
"""

from __future__ import annotations

import argparse

from loong_compile.parallel.tokens import local_token_indices
from loong_compile.parallel.mesh import rank_layout
from loong_compile.ops.attention.ring import ring_schedule


def layout_picture(seq: int, hp: int, cp: int, placement: str) -> str:
    layout = rank_layout(1, cp, hp, placement)[0]
    owner = [None] * seq
    lines = [f"S={seq} hp={hp} cp={cp} {placement}: global rank (cp_rank, hp_rank) -> tokens"]
    for c in range(cp):
        for h in range(hp):
            rank = int(layout[c, h])
            tokens = local_token_indices(seq, cp, hp, c, h).tolist()
            for t in tokens:
                owner[t] = rank
            lines.append(f"  rank {rank} (cp {c}, hp {h}): {tokens}")
    width = len(str(seq - 1))
    lines.append("  token: " + " ".join(f"{t:>{width}}" for t in range(seq)))
    lines.append("  rank:  " + " ".join(f"{r:>{width}}" for r in owner))
    return "\n".join(lines)


def schedule_picture(cp: int, inner_ring: int) -> str:
    """Whose KV block each CP rank holds at every (outer step, micro-step)."""
    steps = [(o, s) for o, s, _ in ring_schedule(0, cp, inner_ring)]
    lines = [f"cp={cp} w={inner_ring}: KV block (owner CP rank) held at outer step o, micro-step s",
             "  cp rank | " + " ".join(f"o{o}s{s}" for o, s in steps)]
    for r in range(cp):
        held = [owner for _, _, owner in ring_schedule(r, cp, inner_ring)]
        lines.append(f"  {r:7d} | " + " ".join(f"{b:4d}" for b in held))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--inner-ring", type=int, default=1)
    parser.add_argument("--placement", default="head_first")
    args = parser.parse_args()
    print(layout_picture(args.seq, args.hp, args.cp, args.placement))
    print()
    print(schedule_picture(args.cp, args.inner_ring))


if __name__ == "__main__":
    main()
