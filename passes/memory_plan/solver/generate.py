"""Synthetic DSA instances for tests and benchmarks.

``tiled_instance``: a rectangle (time x address) cut at random into buffers,
so a perfect packing exists: the optimal arena equals the lower bound, which
greedy rarely finds.  ``layered_instance``: the buffer pattern of a stack of
identical transformer layers (one tiled pattern per layer, a residual-stream
buffer escaping from each layer into the next, a head and a tail outside
the layers), with ``Buffer.layer`` set, for the bi-level planner.
"""

from __future__ import annotations

import random

from loong_compile.passes.memory_plan.solver.problem import Buffer


def tiled_instance(seed: int, n: int, height: int = 1 << 16, steps: int = 1000,
                   alignment: int = 1) -> list[Buffer]:
    """``n`` buffers tiling ``steps x height`` exactly (sizes multiples of ``alignment``)."""
    rng = random.Random(seed)
    rects = [(0, steps, 0, height // alignment)]
    while len(rects) < n:
        # Cut a large piece (chosen with probability growing with its area).
        k = max(range(len(rects)), key=lambda i: (rects[i][1] - rects[i][0])
                * (rects[i][3] - rects[i][2]) * rng.random())
        t0, t1, a0, a1 = rects[k]
        if rng.random() < 0.5 and t1 - t0 > 1:
            cut = rng.randint(t0 + 1, t1 - 1)
            rects[k:k + 1] = [(t0, cut, a0, a1), (cut, t1, a0, a1)]
        elif a1 - a0 > 1:
            cut = rng.randint(a0 + 1, a1 - 1)
            rects[k:k + 1] = [(t0, t1, a0, cut), (t0, t1, cut, a1)]
    return [Buffer((a1 - a0) * alignment, t0, t1, name=f"t{k}")
            for k, (t0, t1, a0, a1) in enumerate(rects)]


def layered_instance(n_layers: int, per_layer: int = 30, seed: int = 0, span: int = 40,
                     height: int = 1 << 20, alignment: int = 64) -> list[Buffer]:
    """Buffers of ``n_layers`` identical layers plus what lives outside them.

    Layer ``k`` occupies steps ``[k * span, (k + 1) * span) + span`` (after a head
    of ``span`` steps); its temporaries are one tiled pattern; its output (a
    residual stream of ``height / 8`` bytes) is read by the next layer, so it
    escapes the layer's span.
    """
    pattern = tiled_instance(seed, per_layer, height=height, steps=span - 1, alignment=alignment)
    stream = height // 8
    buffers = [Buffer(height // 2, 0, span, name="head"), Buffer(stream, span - 1, span + 1,
                                                                 name="embedding out")]
    for k in range(n_layers):
        base = span * (k + 1)
        buffers += [Buffer(b.size, base + b.start, base + b.end, name=f"layers.{k}.{b.name}",
                           layer=f"layers.{k}") for b in pattern]
        # Written by the layer's last kernel, read by the next layer's first.
        buffers.append(Buffer(stream, base + span - 1, base + span + 1,
                              name=f"layers.{k}.out", layer=f"layers.{k}"))
    tail = span * (n_layers + 1)
    buffers.append(Buffer(height // 2, tail, tail + span, name="tail"))
    return buffers
