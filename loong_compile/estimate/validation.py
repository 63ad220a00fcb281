"""Predicted against published: the cost model and the planner on the seed papers' end-to-end
figures (LoongTrain Table 3; MEMO Tables 3 and 7, from ``shared/papers/``).

``python -m loong_compile.estimate.validation`` prints the markdown tables of
docs/estimator.md (section "Validation").  Published values are transcribed below as printed.
"""

from __future__ import annotations

import dataclasses
import sys

from loong_compile.estimate.cost import layer_cost
from loong_compile.estimate.hardware import load_hardware
from loong_compile.estimate.memory import ParallelConfig
from loong_compile.estimate.models import ModelSpec
from loong_compile.estimate.presets import load_model
from loong_compile.estimate.search import Ranking, plan
from loong_compile.estimate.step import step_cost
from loong_compile.parallel.rules import PLACEMENTS, divisors

# LoongTrain Table 3: MFU on 64 A100s, d_sp = 64, one sequence per step.  Columns per sequence
# length (128K, 256K, 512K, 1M): with SC++ (HF, CF), without SC++ (HF, CF); rows (d_cp, d_hp).
LOONGTRAIN_TABLE_3 = {
    "7b-mha": """
64 1 0.092 0.092 0.070 0.070 0.159 0.159 0.122 0.122 0.290 0.290 0.221 0.221 0.452 0.452 0.357 0.357
32 2 0.099 0.158 0.077 0.126 0.173 0.278 0.133 0.219 0.316 0.434 0.243 0.353 0.475 0.486 0.394 0.406
16 4 0.176 0.245 0.141 0.205 0.314 0.378 0.248 0.317 0.470 0.472 0.384 0.388 0.520 0.509 0.418 0.413
8 8 0.283 0.321 0.236 0.282 0.434 0.420 0.361 0.357 0.502 0.478 0.409 0.394 0.527 0.521 0.424 0.420
4 16 0.328 0.327 0.289 0.283 0.436 0.423 0.369 0.359 0.487 0.476 0.399 0.394 0.519 0.520 0.418 0.412
2 32 0.320 0.329 0.284 0.293 0.421 0.421 0.353 0.357 0.474 0.478 0.388 0.394 0.517 0.517 0.415 0.406""",
    "7b-gqa": """
64 1 0.255 0.255 0.196 0.196 0.379 0.379 0.308 0.308 0.470 0.470 0.378 0.378 0.508 0.508 0.406 0.406
32 2 0.283 0.317 0.233 0.269 0.419 0.429 0.345 0.354 0.492 0.485 0.398 0.392 0.521 0.516 0.418 0.416
16 4 0.354 0.338 0.309 0.294 0.466 0.437 0.385 0.373 0.505 0.494 0.410 0.404 0.531 0.526 0.425 0.426
8 8 0.377 0.354 0.327 0.310 0.480 0.452 0.392 0.380 0.516 0.502 0.419 0.412 0.543 0.536 0.435 0.432
4 16 0.354 0.341 0.310 0.308 0.457 0.437 0.377 0.373 0.500 0.493 0.409 0.405 0.532 0.529 0.428 0.419
2 32 0.323 0.333 0.285 0.295 0.424 0.422 0.349 0.360 0.476 0.481 0.389 0.394 0.518 0.518 0.415 0.406""",
}
LOONGTRAIN_SEQS = (131072, 262144, 524288, 1048576)
LOONGTRAIN_COLUMNS = (("sc++", "head_first"), ("sc++", "context_first"), ("full", "head_first"),
                      ("full", "context_first"))

# MEMO Table 2's GPT models (MHA, h_ffn = 4h, vocab 50257) as gated-FFN specs of the same
# parameter count: 3 h f = 2 h (4h)  ->  f = 8h/3 (rounded; FLOPs agree to 1e-4).
MEMO_MODELS = {
    "7B": ModelSpec("memo-7b", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=10923, vocab=50257),
    "13B": ModelSpec("memo-13b", hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13653, vocab=50257),
    "30B": ModelSpec("memo-30b", hidden=7168, layers=48, heads=56, kv_heads=56, ffn=19115, vocab=50257),
    "65B": ModelSpec("memo-65b", hidden=8192, layers=80, heads=64, kv_heads=64, ffn=21845, vocab=50257),
}
MEMO_SEQS_K = (64, 128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408)
# MEMO Table 3 (MEMO rows, MFU %) and Table 7 (TP, CP, DP, PP, alpha per sequence length);
# None: out of (host) memory.
MEMO_TABLE_3 = {
    (8, "7B"): (52.34, 50.96, 53.62, 53.04, 51.84, 52.59, 51.89, 52.71, 52.30, None, None, None),
    (16, "13B"): (52.65, 50.93, 51.22, 51.91, 52.40, 52.13, 51.71, 51.76, 52.06, 51.74, 51.78, 52.10),
    (32, "30B"): (52.12, 49.66, 50.00, 50.69, 51.06, 51.72, 51.18, 51.50, 51.24, 51.73, 51.59, None),
    (64, "65B"): (47.80, 48.61, 49.87, 48.85, 49.71, 50.05, 51.16, 51.05, 51.27, 51.20, 51.42, 51.45),
}
MEMO_TABLE_7 = {   # rows TP, CP, DP, PP, alpha
    (8, "7B"): ("2 4 4 4 4 4 4 4 8", "2 2 2 2 2 2 2 2 1", "2 1 1 1 1 1 1 1 1", "1 1 1 1 1 1 1 1 1",
                "0.0 0.0 1.0 0.5 0.125 0.125 0.0 0.0 0.0"),
    (16, "13B"): ("2 4 4 4 4 4 4 4 4 4 4 4", "2 2 2 2 4 4 4 4 4 4 4 4", "4 2 2 1 1 1 1 1 1 1 1 1",
                  "1 1 1 2 1 1 1 1 1 1 1 1", "0.0 0.0 0.0 0.0 0.5 0.125 0.125 0.0 0.0 0.0 0.0 0.0"),
    (32, "30B"): ("4 8 8 8 8 8 8 8 8 8 8", "1 1 2 2 2 4 4 4 4 4 4", "8 4 2 2 2 1 1 1 1 1 1",
                  "1 1 1 1 1 1 1 1 1 1 1", "0.0 0.0 0.0 0.0 0.0 0.25 0.125 0.125 0.125 0.125 0.0"),
    (64, "65B"): ("8 4 8 8 8 8 8 8 8 8 8 8", "1 4 4 8 8 8 8 8 8 8 8 8", "8 4 2 1 1 1 1 1 1 1 1 1",
                  "1 1 1 1 1 1 1 1 1 1 1 1", "0.0 0.0 0.0 0.25 0.25 0.25 0.25 0.125 0.125 0.0 0.0 0.0"),
}
MEMO_ALPHAS = (0.0, 0.125, 0.25, 0.5, 1.0)   # the alphas MEMO's Table 7 uses


@dataclasses.dataclass(frozen=True)
class Cell:
    """One published figure and its prediction."""

    label: str
    published: float
    predicted: float
    note: str = ""

    @property
    def error(self) -> float:
        """Relative error of the prediction."""
        return (self.predicted - self.published) / self.published


def loongtrain_cells(hardware: str = "a100") -> list[Cell]:
    """Every cell of LoongTrain Table 3, predicted at the best inner ring (as the planner picks)."""
    hw = load_hardware(hardware)
    cells = []
    for name, text in LOONGTRAIN_TABLE_3.items():
        model = load_model(name)
        for line in text.strip().splitlines():
            cp, hp, *values = line.split()
            cp, hp = int(cp), int(hp)
            for i, value in enumerate(values):
                seq = LOONGTRAIN_SEQS[i // 4]
                policy, placement = LOONGTRAIN_COLUMNS[i % 4]
                cells.append(Cell(f"{name} {seq // 1024}K cp={cp} hp={hp} {policy} {placement}",
                                  float(value), loongtrain_mfu(model, seq, cp, hp, policy, placement, hw)))
    return cells


def loongtrain_mfu(model: ModelSpec, seq: int, cp: int, hp: int, policy: str, placement: str, hw) -> float:
    """Predicted MFU of one Table 3 cell: ZeRO-1 (LoongTrain's hybrid ZeRO shards the optimizer
    over d_dp x d_sp), the best inner ring."""
    best = 0.0
    for w in divisors(cp):
        config = ParallelConfig(seq=seq, cp=cp, hp=hp, inner_ring=w)
        step = step_cost(model, config, layer_cost(model, config, placement, hw, policy), 1, hw)
        best = max(best, step.mfu)
    return best


def loongtrain_best_agrees(cells: list[Cell]) -> list[tuple[str, str, str]]:
    """Per (model, sequence length, policy): the published best (d_cp, d_hp, placement) and the
    predicted best."""
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        model, seq, cp, hp, policy, placement = cell.label.split()
        groups.setdefault(f"{model} {seq} {policy}", []).append(cell)
    out = []
    for key, group in groups.items():
        published = max(group, key=lambda x: x.published).label.split()[2:4] + \
            [max(group, key=lambda x: x.published).label.split()[5]]
        predicted = max(group, key=lambda x: x.predicted).label.split()[2:4] + \
            [max(group, key=lambda x: x.predicted).label.split()[5]]
        out.append((key, " ".join(published), " ".join(predicted)))
    return out


def memo_plan(gpus: int, size: str, seq: int) -> Ranking:
    """The planner on MEMO's testbed (A800s) for one Table 3 workload."""
    return plan(MEMO_MODELS[size], seq, gpus, load_hardware("a800"), alphas=MEMO_ALPHAS,
                placements=PLACEMENTS)


def memo_cells(workloads=None) -> list[Cell]:
    """MEMO Table 3's MFU per workload against the planner's best prediction; the note gives
    MEMO's configuration (Table 7) and the planner's."""
    cells = []
    for (gpus, size), mfus in MEMO_TABLE_3.items():
        rows = [row.split() for row in MEMO_TABLE_7[(gpus, size)]]
        for i, (seq_k, mfu) in enumerate(zip(MEMO_SEQS_K, mfus)):
            if mfu is None or (workloads is not None and (gpus, size, seq_k) not in workloads):
                continue
            tp, cp, dp, pp, alpha = (row[i] for row in rows)
            best = memo_plan(gpus, size, seq_k * 1024).best
            ours = ("nothing fits" if best is None else
                    f"hp={best.config.hp} cp={best.config.cp} dp={best.config.dp} {best.activations}"
                    + (f" a={best.alpha:g}" if best.activations == "memo" else "") + f" {best.model_states}")
            cells.append(Cell(f"{size} on {gpus} GPUs, {seq_k}K", mfu / 100, best.mfu if best else 0.0,
                              f"MEMO: TP={tp} CP={cp} DP={dp} PP={pp} a={alpha}; planner: {ours}"))
    return cells


def published_reference(model: ModelSpec, seq: int, gpus: int) -> tuple[float, str] | None:
    """A published end-to-end MFU of a workload of the same shape (layers, hidden, heads, KV
    heads), sequence length and GPU count, and where it is from; None if the papers have none."""
    shape = (model.layers, model.hidden, model.heads, model.kv_heads)
    for (n, size), mfus in MEMO_TABLE_3.items():
        memo = MEMO_MODELS[size]
        if n == gpus and shape == (memo.layers, memo.hidden, memo.heads, memo.kv_heads) \
                and seq % 1024 == 0 and seq // 1024 in MEMO_SEQS_K:
            i = MEMO_SEQS_K.index(seq // 1024)
            if mfus[i] is not None:
                tp, cp, dp, pp, alpha = (row.split()[i] for row in MEMO_TABLE_7[(n, size)])
                return mfus[i] / 100, (f"MEMO Table 3: {mfus[i]:.2f} % MFU for its {size} GPT ({memo.layers} layers, "
                                       f"h {memo.hidden}, {memo.heads} heads) at {seq // 1024}K on {n} A800s "
                                       f"(Table 7: TP={tp} CP={cp} DP={dp} PP={pp} alpha={alpha})")
    for name, text in LOONGTRAIN_TABLE_3.items():
        spec = load_model(name)
        if gpus == 64 and shape == (spec.layers, spec.hidden, spec.heads, spec.kv_heads) and seq in LOONGTRAIN_SEQS:
            column = LOONGTRAIN_SEQS.index(seq) * 4
            best, where = max((float(row.split()[2 + column + j]), f"cp={row.split()[0]} hp={row.split()[1]} "
                               f"{'/'.join(LOONGTRAIN_COLUMNS[j])}")
                              for row in text.strip().splitlines() for j in range(4))
            return best, (f"LoongTrain Table 3: best {best:.1%} MFU for {name} at {seq // 1024}K on 64 A100s "
                          f"({where})")
    return None


def _loongtrain_markdown(cells: list[Cell]) -> str:
    """One row per (model, d_cp, d_hp, policy, placement); per sequence length 'published /
    predicted (error)'."""
    rows: dict[str, list[Cell]] = {}
    for c in cells:
        model, seq, cp, hp, policy, placement = c.label.split()
        rows.setdefault(f"{model} | {cp[3:]} | {hp[3:]} | {policy} | {placement}", []).append(c)
    lines = ["| model | d_cp | d_hp | policy | placement | " + " | ".join(f"{s // 1024}K" for s in LOONGTRAIN_SEQS)
             + " |", "|---|---|---|---|---|" + "---|" * len(LOONGTRAIN_SEQS)]
    for key, row in rows.items():
        lines.append(f"| {key} | " + " | ".join(f"{c.published:.3f} / {c.predicted:.3f} ({c.error:+.0%})"
                                                 for c in row) + " |")
    return "\n".join(lines) + "\n" + _summary(cells)


def _summary(cells: list[Cell]) -> str:
    worst = max(cells, key=lambda c: abs(c.error))
    mean = sum(abs(c.error) for c in cells) / len(cells)
    return (f"\nLargest error: {worst.error:+.1%} ({worst.label}); mean |error| {mean:.1%} over "
            f"{len(cells)} cells.")


def main() -> int:
    cells = loongtrain_cells()
    print("### LoongTrain Table 3 (64 A100s): published / predicted MFU (error)\n")
    print(_loongtrain_markdown(cells))
    for model in LOONGTRAIN_TABLE_3:
        print(f"{model}:" + _summary([c for c in cells if c.label.startswith(model)]))
    print("\n| model, S, policy | published best (cp, hp, placement) | predicted best |\n|---|---|---|")
    agreements = loongtrain_best_agrees(cells)
    for key, published, predicted in agreements:
        print(f"| {key} | {published} | {predicted} |")
    same = sum(p == q for _, p, q in agreements)
    print(f"\nPredicted best = published best in {same} of {len(agreements)} groups.")
    print("\n### MEMO Tables 3 and 7 (A800s): the planner's best against MEMO's\n")
    memo = memo_cells()
    lines = ["| workload | published MFU | predicted MFU | error | MEMO's configuration (Table 7) | planner's best |",
             "|---|---|---|---|---|---|"]
    for c in memo:
        theirs, ours = c.note.split("; planner: ")
        lines.append(f"| {c.label} | {c.published:.3f} | {c.predicted:.3f} | {c.error:+.1%} | "
                     f"{theirs.removeprefix('MEMO: ')} | {ours} |")
    print("\n".join(lines) + "\n" + _summary(memo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
