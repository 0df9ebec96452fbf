"""Plots a person would rather look at than read: accuracy per level across rounds, the rounds' budgets, and
accuracy against compute."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

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
    return _save(fig, path)


def round_summary(summary: list[dict[str, Any]], path: Path, title: str) -> Path:
    """The parent run's summary, one panel each: held-out accuracy (greedy and maj@k), generated
    tokens (sampling, plus Monte Carlo rollouts where the recipe spends them), and trajectories selected
    for training, per round. Rows are `v_round_summary` rows; its `prm_step_f1`, where present, adds
    the PRM's step-level F1 against the oracle to the first panel."""
    rows = sorted(summary, key=lambda r: r["round"])
    rounds = [int(r["round"]) for r in rows]

    def col(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else float(r[key]) for r in rows]

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), dpi=110)
    ax = axes[0]
    ax.plot(rounds, [100 * v for v in col("greedy_acc")], marker="o", color="black", label="greedy pass@1")
    ax.plot(rounds, [100 * v for v in col("maj_acc")], marker="s", linestyle="--", label="maj@k")
    if any(r.get("prm_step_f1") is not None for r in rows):
        ax.plot(rounds, [100 * v for v in col("prm_step_f1")], marker="^", label="PRM step F1 (vs oracle)")
    ax.set_ylabel("held-out, all levels (%)")
    ax.set_ylim(-2, 102)
    ax.legend(fontsize=8)
    sampled = [v / 1000 for v in col("generated_tokens")]
    axes[1].bar(rounds, sampled, color="tab:blue", label="sampling")
    bottom = sampled
    for key, color, label in (("search_tokens", "tab:purple", "search beyond the kept samples (step search, MCTS)"),
                              ("mc_tokens", "tab:orange", "Monte Carlo rollouts")):
        if any(r.get(key) for r in rows):
            part = [(r.get(key) or 0) / 1000 for r in rows]
            axes[1].bar(rounds, part, bottom=bottom, color=color, label=label)
            bottom = [a + b for a, b in zip(bottom, part)]
    if bottom is not sampled:
        axes[1].legend(fontsize=8)
    axes[1].set_ylabel("generated tokens (thousands)")
    axes[2].bar(rounds, col("selected"), color="tab:green")
    axes[2].set_ylabel("trajectories selected for training")
    for a in axes:
        a.set_xlabel("round")
        a.set_xticks(rounds)
        a.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)


METHOD_STYLE = {"greedy": ("black", "o", "greedy"), "maj": ("tab:blue", "s", "maj@N"),
                "prm_bon": ("tab:orange", "^", "PRM best-of-N"), "beam": ("tab:green", "D", "PRM beam search"),
                "mcts": ("tab:red", "v", "MCTS (PRM-valued)")}


def compute_curve(curves: dict[int, list[dict[str, Any]]], path: Path, title: str) -> Path:
    """Held-out accuracy against generated tokens per problem, one line per method: the newest round solid,
    the first round with a curve dashed. `curves[round]` are `components.search.curves.curve_points` rows."""
    rounds = sorted(curves)
    shown = [rounds[-1]] if len(rounds) == 1 else [rounds[0], rounds[-1]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for r in shown:
        last = r == rounds[-1]
        by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in curves[r]:
            by_method[p["method"]].append(p)
        for method, pts in by_method.items():
            color, marker, label = METHOD_STYLE.get(method, ("gray", "x", method))
            pts.sort(key=lambda p: p["tokens"])
            ax.plot([p["tokens"] for p in pts], [100 * p["accuracy"] for p in pts], marker=marker, color=color,
                    linestyle="-" if last else "--", alpha=1.0 if last else 0.45,
                    label=f"{label}, round {r}")
    level = curves[rounds[-1]][0]["level"]
    ys = [100 * p["accuracy"] for r in shown for p in curves[r]]
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("generated tokens per problem (log scale)")
    ax.set_ylabel(f"held-out accuracy, level {level} (%)")
    ax.set_ylim(max(min(ys) - 5, -2), min(max(ys) + 5, 102))
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
