"""Two experiments side by side, round by round, read back from MLflow, or from the store at a snapshot.

    coevo compare micro micro-b [--metric evaluate/greedy_acc] [--out plot.png]
    coevo compare micro micro --a-as-of micro/r1/train_policy/a1    # micro before a rerun, and now

    from components.compare import compare_experiments, plot_comparison
    result = compare_experiments("sqlite:///workdir/mlflow.db", "micro", "micro-b")
    plot_comparison(result, Path("micro_vs_micro-b.png"))

Each round is a nested MLflow run tagged `coevo.round`; its stage metrics carry the same names in
every round (`evaluate/greedy_acc`, and `evaluate/greedy_acc_L<level>` per level), which is what
makes rounds of two experiments comparable at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.tracking import TAG_EXPERIMENT, TAG_ROUND

ALL = "all"  # the level label of the metric over all levels


class CompareError(ValueError):
    """An experiment or metric is not in the MLflow store; the message lists what is."""


@dataclass
class ExperimentRounds:
    experiment: str
    # level ("all" or "1", "2", ...) -> round -> value
    values: dict[str, dict[int, float]] = field(default_factory=dict)
    run_ids: dict[int, str] = field(default_factory=dict)


@dataclass
class Comparison:
    metric: str
    a: ExperimentRounds
    b: ExperimentRounds

    def levels(self) -> list[str]:
        lv = set(self.a.values) | set(self.b.values)
        return [ALL] * (ALL in lv) + sorted((x for x in lv if x != ALL), key=int)

    def rounds(self) -> list[int]:
        return sorted({r for e in (self.a, self.b) for s in e.values.values() for r in s})

    def columns(self) -> list[str]:
        return ["level", "round", self.a.experiment, self.b.experiment, "delta"]

    def rows(self) -> list[list[Any]]:
        """One row per (level, round); `delta` is b - a where both have the round."""
        out = []
        for level in self.levels():
            for r in self.rounds():
                va = self.a.values.get(level, {}).get(r)
                vb = self.b.values.get(level, {}).get(r)
                delta = vb - va if va is not None and vb is not None else None
                out.append([level, r, va, vb, delta])
        return out


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def mlflow_experiments(client) -> list[str]:
    """The coevo experiments that have runs in MLflow (the store's own list is `Store.experiments`)."""
    ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    runs = client.search_runs(ids, filter_string=f"tags.`{TAG_ROUND}` = 'all'", max_results=1000)
    return sorted({r.data.tags[TAG_EXPERIMENT] for r in runs})


def experiment_rounds(client, experiment: str, metric: str) -> ExperimentRounds:
    """The metric (and its per-level variants `<metric>_L<k>`) from each round run of the experiment."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", experiment):
        raise CompareError(f"{experiment!r} is not an experiment name (letters, digits, '_', '.', '-')")
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, filter_string=f"tags.`{TAG_EXPERIMENT}` = '{experiment}'", max_results=5000) if ids else []
    rounds = [r for r in runs if r.data.tags.get(TAG_ROUND, "all") != "all"]
    if not runs:
        known = mlflow_experiments(client)
        raise CompareError(f"unknown experiment {experiment!r} in MLflow; known: {', '.join(known) or 'none'}")
    out = ExperimentRounds(experiment)
    per_level = re.compile(re.escape(metric) + r"_L(\d+)$")
    for run in rounds:
        r = int(run.data.tags[TAG_ROUND])
        out.run_ids[r] = run.info.run_id
        for key, value in run.data.metrics.items():
            if key == metric:
                out.values.setdefault(ALL, {})[r] = float(value)
            elif m := per_level.match(key):
                out.values.setdefault(m.group(1), {})[r] = float(value)
    if not out.values:
        names = sorted({k for run in rounds for k in run.data.metrics})
        raise CompareError(f"experiment {experiment!r} has no metric {metric!r} in any round; it has: "
                           f"{', '.join(names) or 'no metrics'}")
    return out


def compare_experiments(tracking_uri: str, exp_a: str, exp_b: str, metric: str = "evaluate/greedy_acc") -> Comparison:
    client = _client(tracking_uri)
    return Comparison(metric, experiment_rounds(client, exp_a, metric), experiment_rounds(client, exp_b, metric))


def store_rounds(store: Any, experiment: str, metric: str, as_of: str | None = None) -> ExperimentRounds:
    """The same rounds read from the store's `evaluations`, as they stood after the `as_of` attempt's commit
    (`Store.snapshot`) or now. The store holds what `evaluate` computed, so the metric is `evaluate/<name>`."""
    from components.store import StoreError

    stage, _, name = metric.partition("/")
    if stage != "evaluate" or not name:
        raise CompareError(f"metric {metric!r}: the store holds the evaluate stage's metrics, evaluate/<name> "
                           "(e.g. evaluate/greedy_acc); others are read from MLflow, without a snapshot")
    label = experiment if as_of is None else f"{experiment} as of {as_of}"
    try:
        _, rows = store.query("SELECT round, level, value FROM evaluations WHERE experiment_id = ? AND metric = ?",
                              [experiment, name], as_of=as_of)
        if not rows:
            known = [r[0] for r in store.query("SELECT experiment_id FROM experiments ORDER BY 1", as_of=as_of)[1]]
            if experiment not in known:
                raise CompareError(f"unknown experiment {experiment!r} in the store{'' if as_of is None else ' at ' + as_of}"
                                   f"; known: {', '.join(known) or 'none'}")
            names = [r[0] for r in store.query("SELECT DISTINCT metric FROM evaluations WHERE experiment_id = ? "
                                               "ORDER BY 1", [experiment], as_of=as_of)[1]]
            raise CompareError(f"experiment {experiment!r} has no metric {metric!r}; it has: "
                               f"{', '.join('evaluate/' + n for n in names) or 'no evaluations'}")
    except StoreError as e:
        raise CompareError(str(e)) from None
    out = ExperimentRounds(label)
    for r, level, value in rows:
        out.values.setdefault(ALL if level == -1 else str(level), {})[int(r)] = float(value)
    return out


def plot_comparison(c: Comparison, path: Path) -> Path:
    """Overall metric per round as thick lines, per-level metric thin and dashed, one colour per experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    markers = "osD^v<>ph*"
    for exp, color in ((c.a, "tab:blue"), (c.b, "tab:orange")):
        for i, level in enumerate(c.levels()):
            pts = sorted(exp.values.get(level, {}).items())
            if not pts:
                continue
            overall = level == ALL
            ax.plot([r for r, _ in pts], [100 * v for _, v in pts], color=color,
                    linewidth=2.5 if overall else 1.0, linestyle="-" if overall else "--",
                    marker=markers[i % len(markers)], markersize=5 if overall else 3,
                    label=f"{exp.experiment} {'all levels' if overall else 'L' + level}")
    ax.set_xlabel("round (0 = bootstrap)")
    ax.set_ylabel(f"{c.metric} (%)")
    ax.set_xticks(c.rounds())
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.set_title(f"{c.a.experiment} vs {c.b.experiment}")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
