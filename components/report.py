"""A one-file HTML report of an experiment: config, per-round table, plots, sample trajectories, lineage.

    coevo report micro --workdir workdir --out micro-report.html

    from components.report import write_report
    write_report(Store("workdir/store"), "micro", Path("micro-report.html"))

Everything comes from the store, and the plots are embedded as base64 PNG, so the file can be
mailed or attached to a ticket and still open with every figure.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml

from components.store import Store

ROUND_COLUMNS = ("round", "curriculum_levels", "generated", "generated_tokens", "train_pass_rate", "selected",
                 "greedy_acc", "maj_acc", "greedy_acc_by_level")


class ReportError(ValueError):
    """The experiment is not in the store."""


# -- data -----------------------------------------------------------------------------------------

def _rows(store: Store, sql: str, experiment: str) -> list[dict[str, Any]]:
    return store.rows(sql, [experiment])


def gather(store: Store, experiment: str, samples: int = 3) -> dict[str, Any]:
    exp = store.rows("SELECT * FROM experiments WHERE experiment_id = ?", [experiment])
    if not exp:
        known = [r[0] for r in store.query("SELECT experiment_id FROM experiments ORDER BY 1")[1]]
        raise ReportError(f"unknown experiment {experiment!r} in {store.path}; known: {', '.join(known) or 'none'}")
    # The best and worst trajectories of each round by reward: the PRM's min step score where a PRM
    # scored them, else the outcome score; ties go to correctness, then to the shorter one.
    ranked = """
        WITH s AS (
            SELECT v.*, coalesce(v.min_step_score, v.outcome_score) AS reward,
                   CASE WHEN v.min_step_score IS NOT NULL THEN 'prm min-step' ELSE 'outcome' END AS scored_by
            FROM v_trajectory_scores v WHERE v.experiment_id = ? AND v.round > 0
        ), r AS (
            SELECT s.*, row_number() OVER (PARTITION BY round ORDER BY reward DESC NULLS LAST,
                        correct DESC NULLS LAST, num_tokens, trajectory_id) AS best_rank,
                        row_number() OVER (PARTITION BY round ORDER BY reward ASC NULLS LAST,
                        correct ASC NULLS LAST, num_tokens DESC, trajectory_id) AS worst_rank
            FROM s
        )
        SELECT r.round, r.level, r.reward, r.scored_by, r.correct, r.best_rank, r.worst_rank, r.trajectory_id,
               t.prompt, t.completion, t.answer, p.answer AS reference
        FROM r JOIN trajectories t USING (trajectory_id) LEFT JOIN problems p ON p.problem_id = t.problem_id
        WHERE (r.best_rank <= ? OR r.worst_rank <= ?) AND t.purpose = 'train'
        ORDER BY r.round, r.best_rank"""
    return {
        "experiment": exp[0],
        "rounds": _rows(store, "SELECT * FROM v_round_summary WHERE experiment_id = ? ORDER BY round", experiment),
        "evaluations": _rows(store, "SELECT * FROM evaluations WHERE experiment_id = ? ORDER BY round, level, metric",
                             experiment),
        "timings": _rows(store, "SELECT round, stage, attempt, status, duration_s FROM stage_runs "
                                "WHERE experiment_id = ? AND status = 'committed' ORDER BY round, started_at",
                         experiment),
        "samples": store.rows(ranked, [experiment, samples, samples]),
        "models": _rows(store, "SELECT model_id, role, round, parent_model_id, train_examples, registered_name, "
                               "registered_version, sha256 FROM models WHERE experiment_id = ? ORDER BY role, round",
                        experiment),
        "lineage": _rows(store, """
            SELECT trained_model_id, role, trained_round, count(*) AS trajectories,
                   list(DISTINCT source_round ORDER BY source_round) AS from_rounds,
                   list(DISTINCT generated_by_model_id ORDER BY generated_by_model_id) AS generated_by,
                   count(DISTINCT problem_id) AS problems
            FROM v_lineage WHERE experiment_id = ? GROUP BY ALL ORDER BY trained_round""", experiment),
    }


# -- plots ----------------------------------------------------------------------------------------

def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def plot_accuracy(data: dict[str, Any]) -> bytes:
    from components.plots import accuracy_per_round

    with tempfile.TemporaryDirectory() as d:
        p = accuracy_per_round(data["evaluations"], Path(d) / "acc.png",
                               title=f"{data['experiment']['experiment_id']}: held-out greedy accuracy")
        return p.read_bytes()


def plot_compute_curve(data: dict[str, Any]) -> bytes | None:
    """Accuracy against compute (evaluate.search), or None where no round drew one."""
    from components.plots import compute_curve
    from components.search.curves import curve_points

    curves = curve_points(data["evaluations"])
    if not curves:
        return None
    with tempfile.TemporaryDirectory() as d:
        return compute_curve(curves, Path(d) / "curve.png",
                             title=f"{data['experiment']['experiment_id']}: accuracy against compute").read_bytes()


def plot_data(data: dict[str, Any]) -> bytes:
    """Generated and selected trajectories per round (bars) and the train pass rate (line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rounds"] if r["round"] > 0]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    xs = [r["round"] for r in rows]
    ax.bar([x - 0.2 for x in xs], [r["generated"] for r in rows], width=0.4, label="generated")
    ax.bar([x + 0.2 for x in xs], [r["selected"] for r in rows], width=0.4, label="selected")
    ax.set_xlabel("round")
    ax.set_ylabel("trajectories")
    ax.set_xticks(xs)
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * (r["train_pass_rate"] or 0) for r in rows], color="black", marker="o", label="pass rate")
    ax2.set_ylabel("train pass rate (%)")
    ax2.set_ylim(0, 100)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("data per round")
    fig.tight_layout()
    return _png(fig)


def plot_timings(data: dict[str, Any]) -> bytes:
    """Seconds per stage, stacked per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = sorted({t["round"] for t in data["timings"]})
    stages = list(dict.fromkeys(t["stage"] for t in data["timings"]))
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    bottom = [0.0] * len(rounds)
    for stage in stages:
        h = [sum(t["duration_s"] or 0 for t in data["timings"] if t["round"] == r and t["stage"] == stage)
             for r in rounds]
        ax.bar(rounds, h, bottom=bottom, label=stage)
        bottom = [b + x for b, x in zip(bottom, h)]
    ax.set_xlabel("round (0 = bootstrap)")
    ax.set_ylabel("seconds")
    ax.set_xticks(rounds)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    ax.set_title("stage timings")
    fig.tight_layout()
    return _png(fig)


# -- html -----------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f2f2f2; } td.l, th.l { text-align: left; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.85em; white-space: pre-wrap; }
.ok { color: #1a7f37; } .bad { color: #c62828; } img { max-width: 100%; } .muted { color: #777; }
"""


def _fmt(v: Any) -> str:
    if v is None:
        return "<span class=muted>–</span>"
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, dict):
        return html.escape(", ".join(f"L{k}: {x}" for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return html.escape(", ".join("–" if x is None else str(x) for x in v))
    return html.escape(str(v))


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...] | list[str] | None = None, id: str = "") -> str:
    if not rows:
        return "<p class=muted>(none)</p>"
    cols = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table id='{id}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(png: bytes, alt: str) -> str:
    return f"<p><img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'></p>"


def _samples_html(samples: list[dict[str, Any]], n: int) -> str:
    parts = []
    for r in sorted({s["round"] for s in samples}):
        parts.append(f"<h3>round {r}</h3>")
        for kind, key in (("best", "best_rank"), ("worst", "worst_rank")):
            picked = sorted((s for s in samples if s["round"] == r and s[key] <= n), key=lambda s: s[key])
            for s in picked:
                mark = "<span class=ok>correct</span>" if s["correct"] else "<span class=bad>wrong</span>"
                parts.append(
                    f"<p><b>{kind} #{s[key]}</b> · level {s['level']} · {html.escape(s['scored_by'])} "
                    f"{_fmt(s['reward'])} · {mark} · answer {_fmt(s['answer'])} (reference {_fmt(s['reference'])})</p>"
                    f"<pre>{html.escape(s['prompt'])}{html.escape(s['completion'])}</pre>")
    return "".join(parts) or "<p class=muted>(no trajectories)</p>"


def render(data: dict[str, Any], samples: int = 3) -> str:
    e = data["experiment"]
    name = e["experiment_id"]
    config = yaml.safe_dump(json.loads(e["config_json"]), sort_keys=False)
    rounds = [{k: r.get(k) for k in ROUND_COLUMNS} for r in data["rounds"]]
    for r in rounds:
        if isinstance(r["curriculum_levels"], str):
            r["curriculum_levels"] = json.loads(r["curriculum_levels"])
    plots = [_img(plot_accuracy(data), "accuracy per round")]
    if any(r["round"] > 0 for r in data["rounds"]):
        plots.append(_img(plot_data(data), "data per round"))
    if data["timings"]:
        plots.append(_img(plot_timings(data), "stage timings"))
    curve = plot_compute_curve(data)
    if curve:
        plots.append(_img(curve, "accuracy against compute"))
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>coevo report: {html.escape(name)}</title>
<style>{CSS}</style></head><body>
<h1>coevo report: {html.escape(name)}</h1>
<p>recipe <b>{html.escape(e['recipe'])}</b> · seed {e['seed']} · config hash <code>{html.escape(e['config_hash'])}</code>
 · code {html.escape(str(e['code_version']))} · created {html.escape(str(e['created_at']))} · report {now}</p>
<h2>Rounds</h2>
{_table(rounds, ROUND_COLUMNS, id="rounds")}
<h2>Plots</h2>
{''.join(plots)}
<h2>Sample trajectories (best and worst {samples} per round)</h2>
{_samples_html(data['samples'], samples)}
<h2>Lineage</h2>
<p>Which selected trajectories trained each policy, from which rounds, generated by which model.</p>
{_table(data['lineage'], id="lineage")}
<h3>Models</h3>
{_table(data['models'], id="models")}
<h2>Stage timings (s)</h2>
{_table(data['timings'], id="timings")}
<h2>Config</h2>
<pre>{html.escape(config)}</pre>
</body></html>
"""


def write_report(store: Store, experiment: str, out: str | Path, samples: int = 3) -> Path:
    out = Path(out)
    text = render(gather(store, experiment, samples), samples)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
