"""Plots a person would rather look at than read: accuracy per level across rounds."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def accuracy_per_round(evaluations: list[dict[str, Any]], path: Path, title: str, metric: str = "greedy_acc") -> Path:
    """One line per level: held-out `metric` against round."""
    series: dict[int, dict[int, float]] = defaultdict(dict)
    for e in evaluations:
        if e["metric"] == metric:
            series[int(e["level"])][int(e["round"])] = float(e["value"])
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for level in sorted(series):
        pts = sorted(series[level].items())
        label = "all levels" if level == -1 else f"level {level}"
        style = dict(color="black", linewidth=2.5) if level == -1 else {}
        ax.plot([r for r, _ in pts], [100 * v for _, v in pts], marker="o", label=label, **style)
    ax.set_xlabel("round (0 = bootstrap)")
    ax.set_ylabel(f"held-out {metric} (%)")
    ax.set_ylim(-2, 102)
    rounds = sorted({r for s in series.values() for r in s})
    ax.set_xticks(rounds)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
