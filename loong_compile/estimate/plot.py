"""Charts for ``loong estimate --plot`` and ``loong plan --plot`` (matplotlib, imported on use)."""

from __future__ import annotations

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.memory import MemoryBreakdown
from loong_compile.estimate.search import Ranking
from loong_compile.parallel.rules import PLACEMENTS


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise LoongConfigError("--plot needs matplotlib, which is not installed", None,
                               "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _capacity_lines(ax, capacity_gib: float | None, limit_gib: float | None, vertical: bool) -> None:
    line = ax.axvline if vertical else ax.axhline
    if capacity_gib is not None:
        line(capacity_gib, color="tab:red", linestyle="-", label=f"capacity {capacity_gib:g} GiB")
        line(limit_gib, color="tab:orange", linestyle="--", label=f"usable {limit_gib:.1f} GiB")


def plot_memory(breakdown: MemoryBreakdown, title: str, path: str) -> None:
    """One stacked horizontal bar: the terms, then the overheads."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    for name, gib in [*breakdown.terms.items(), *breakdown.overheads.items()]:
        if gib > 0:
            ax.barh([0], [gib], left=left, label=f"{name} ({gib:.2f})")
            left += gib
    _capacity_lines(ax, breakdown.capacity_gib, breakdown.limit_gib, vertical=True)
    ax.set_yticks([])
    ax.set_xlabel("GiB per GPU")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def plot_plan(result: Ranking, path: str, top: int) -> None:
    """Left: memory of the ``top`` ranked configurations.  Right: predicted attention time per
    layer and sequence (a DP replica's time / dp) vs d_hp, best for each d_hp and placement."""
    plt = _pyplot()
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(13, 4.5))
    shown = result.ranked[:top]
    labels = [f"dp{c.config.dp} cp{c.config.cp} hp{c.config.hp} {c.placement[0]}f w{c.config.inner_ring}"
              f" {c.activations}" for c in shown]
    ax_mem.bar(range(len(shown)), [c.memory.estimate_gib for c in shown], color="tab:blue")
    ax_mem.set_xticks(range(len(shown)), labels, rotation=60, ha="right", fontsize=7)
    ax_mem.set_ylabel("estimated GiB per GPU")
    if shown:
        _capacity_lines(ax_mem, shown[0].memory.capacity_gib, shown[0].memory.limit_gib, vertical=False)
        ax_mem.legend(fontsize=7)
    ax_mem.set_title("memory of the ranked configurations", fontsize=9)
    for placement in PLACEMENTS:
        best: dict[int, float] = {}
        for c in result.ranked:
            if c.placement == placement:     # hp = 1 or cp = 1 grids are listed as head_first
                ms = c.cost.attention.total_s * 1e3 / c.config.dp
                best[c.config.hp] = min(best.get(c.config.hp, ms), ms)
        if best:
            hps = sorted(best)
            ax_time.plot(hps, [best[x] for x in hps], marker="o", label=placement)
    ax_time.set_xscale("log", base=2)
    ax_time.set_xlabel("d_hp")
    ax_time.set_ylabel("predicted attention ms per layer and sequence")
    ax_time.set_title("attention time vs d_hp (best per d_hp)", fontsize=9)
    ax_time.legend(fontsize=7)
    fig.suptitle(f"{result.model.name}, {result.seq} tokens, {result.gpus} x {result.hardware.name}")
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
