"""The `coevo` command line.

    coevo run --config configs/arith.yaml [--set rounds=2 --set train_policy.steps=100]
    coevo status arith-default
    coevo query "SELECT round, count(*) FROM trajectories GROUP BY 1"
    coevo rerun arith-default --round 2 --stage score [--downstream]
    coevo resume arith-default
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="coevo: self-improvement rounds for LMs.")
console = Console()
err = Console(stderr=True)

WorkdirOpt = Annotated[Path, typer.Option("--workdir", "-w", envvar="COEVO_WORKDIR", help="Experiment workdir.")]


def _fail(msg: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, markup=True)
    raise typer.Exit(code)


def _store(workdir: Path):
    from components.store import Store

    return Store(workdir / "coevo.duckdb")


@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="Experiment YAML.")] = Path("configs/arith.yaml"),
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override, e.g. --set rounds=2.")] = None,
) -> None:
    """Run (or continue) all rounds of an experiment through the `self_evolution` flow."""
    from components.config import ConfigError, load_config

    overrides = list(set_ or [])
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        _fail(str(e), 2)
    if cfg.policy.model and _looks_local(cfg.policy.model) and not Path(cfg.policy.model).exists():
        _fail(f"policy.model: model path not found: {cfg.policy.model}", 2)
    _run_flow("self_evolution", progress_bars=True, config_path=str(config), overrides=overrides)
    _print_summary(Path(cfg.workdir), cfg.experiment)


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def _run_flow(flow_name: str, /, *, progress_bars: bool = False, **params):
    from components.locking import ExperimentLockedError
    from components.store import StoreError
    from flows import evolution

    try:  # the bars end before an error is printed
        with _progress_bars() if progress_bars else nullcontext():
            return getattr(evolution, flow_name)(**params)
    except (ExperimentLockedError, StoreError, ValueError, FileNotFoundError) as e:
        _fail(str(e), 2)
    except Exception as e:  # the flow already logged the traceback
        _fail(f"{flow_name} failed: {type(e).__name__}: {e}", 1)


@contextmanager
def _progress_bars() -> Iterator[None]:
    """A bar per running stage while stdout is a terminal.

    The bars live on the console of Prefect's console log handler: a log line printed there scrolls
    above the bars, where one written past them to the terminal would tear them.
    """
    if not console.is_terminal:
        yield
        return
    import logging

    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    from components.progress import RichProgressSink, installed

    ensure_logging_setup()
    on = next((h.console for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)), err)
    with RichProgressSink(on) as sink, installed(sink):
        yield


def _print_summary(workdir: Path, experiment: str) -> None:
    cols, rows = _store(workdir).query(
        "SELECT round, curriculum_levels, generated, selected, round(greedy_acc, 3) AS greedy_acc, "
        "greedy_acc_by_level FROM v_round_summary WHERE experiment_id=? ORDER BY round", [experiment])
    _print_table(cols, rows, title=f"{experiment}: rounds")


@app.command()
def evaluate(
    model: Annotated[str, typer.Argument(help="HF model name or local path (a round's `.../model` folder).")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Experiment YAML: domain and evaluate settings.")]
    = Path("configs/arith.yaml"),
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override, e.g. --set evaluate.maj_k=8.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Name for the MLflow run (default: the path's last part).")]
    = None,
) -> None:
    """Held-out accuracy of any model on a config's domain (the `evaluate_model` flow)."""
    from components.config import ConfigError, load_config

    overrides = list(set_ or [])
    try:
        load_config(config, overrides)
    except ConfigError as e:
        _fail(str(e), 2)
    if _looks_local(model) and not Path(model).exists():
        _fail(f"model path not found: {model}", 2)
    metrics = _run_flow("evaluate_model", model=model, config_path=str(config), overrides=overrides, name=name)
    _print_table(["metric", "value"], [(k, round(v, 4)) for k, v in sorted(metrics.items())], title=model)


@app.command("config-schema")
def config_schema() -> None:
    """Print the JSON schema of an experiment config: every section, field, type, default and description."""
    import json

    from components.config import ExperimentConfig

    print(json.dumps(ExperimentConfig.model_json_schema(), indent=2))


@app.command()
def resume(
    experiment: str,
    workdir: WorkdirOpt = Path("workdir"),
    rounds: Annotated[Optional[int], typer.Option(
        "--rounds", min=0, help="Continue to this many rounds (more than it has): its committed rounds are kept.")] = None,
) -> None:
    """Continue an experiment from its first stage without a committed attempt, or past its last round."""
    from flows.evolution import CONFIG_SNAPSHOT

    snapshot = workdir / experiment / CONFIG_SNAPSHOT
    if not snapshot.is_file():
        _fail(f"unknown experiment {experiment!r}: no {snapshot}", 2)
    overrides = [] if rounds is None else [f"rounds={rounds}"]
    _run_flow("self_evolution", progress_bars=True, config_path=str(snapshot), overrides=overrides)
    _print_summary(workdir, experiment)


@app.command()
def rerun(
    experiment: str,
    round: Annotated[int, typer.Option("--round", "-r")],
    stage: Annotated[str, typer.Option("--stage", "-s")],
    downstream: Annotated[bool, typer.Option(help="Also recompute the later stages of the round.")] = False,
    workdir: WorkdirOpt = Path("workdir"),
) -> None:
    """Rerun one stage of one round as a new attempt (the `run_stage` flow)."""
    _run_flow("run_stage", progress_bars=True, experiment=experiment, round=round, stage=stage,
              downstream=downstream, workdir=str(workdir))
    status(experiment, workdir)


@app.command()
def query(
    sql: str,
    workdir: WorkdirOpt = Path("workdir"),
    format: Annotated[str, typer.Option("--format", "-f", help="table|csv|json|parquet")] = "table",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to this file.")] = None,
) -> None:
    """Run read-only SQL against the store (views: v_round_summary, v_trajectory_scores, v_lineage, ...)."""
    from components.store import StoreError

    store = _store(workdir)
    try:
        if format == "parquet":
            import pyarrow.parquet as pq

            if out is None:
                _fail("--format parquet needs --out FILE", 2)
            pq.write_table(store.query_arrow(sql), out)
            console.print(f"wrote {out}")
            return
        cols, rows = store.query(sql)
    except StoreError as e:
        _fail(str(e), 2)
    if format == "table" and out is None:
        _print_table(cols, rows)
        return
    fh = open(out, "w", newline="") if out else sys.stdout
    try:
        if format == "csv" or format == "table":
            w = csv.writer(fh)
            w.writerow(cols)
            w.writerows(rows)
        elif format == "json":
            json.dump([dict(zip(cols, r)) for r in rows], fh, default=str, indent=1)
            fh.write("\n")
        else:
            _fail(f"--format must be table, csv, json or parquet, not {format!r}", 2)
    finally:
        if out:
            fh.close()


@app.command()
def status(experiment: str, workdir: WorkdirOpt = Path("workdir")) -> None:
    """Rounds and stages of an experiment with their attempt states."""
    from components.store import StoreError

    try:
        runs = _store(workdir).stage_runs(experiment)
    except StoreError as e:
        _fail(str(e), 2)
    if not runs:
        _fail(f"unknown experiment {experiment!r} in {workdir}", 2)
    table = Table(title=f"{experiment}: stage runs")
    for c in ("round", "stage", "attempt", "status", "duration_s", "rows", "error"):
        table.add_column(c)
    style = {"committed": "green", "failed": "red", "running": "yellow", "superseded": "dim"}
    for r in runs:
        st = r["status"] + (" (stale)" if r["stale"] and r["status"] == "committed" else "")
        color = "magenta" if r["stale"] and r["status"] == "committed" else style.get(r["status"], "")
        rows = ", ".join(f"{k}={v}" for k, v in json.loads(r["rows_json"] or "{}").items())
        dur = f"{r['duration_s']:.1f}" if r["duration_s"] is not None else ""
        table.add_row(str(r["round"]), r["stage"], str(r["attempt"]), f"[{color}]{st}[/]" if color else st, dur,
                      rows, (r["error"] or "").splitlines()[0][:60] if r["error"] else "")
    console.print(table)


@app.command("verify-reproducible")
def verify_reproducible(
    experiment: str,
    round: Annotated[int, typer.Option("--round", "-r")] = 1,
    stage: Annotated[str, typer.Option("--stage", "-s")] = "generate",
    workdir: WorkdirOpt = Path("workdir"),
) -> None:
    """Rerun a committed stage into a scratch attempt and compare content hashes (exit 1 if they differ)."""
    from components.config import load_config
    from components.jobs.launch import StageJobError, reproduce_stage
    from components.store import StoreError
    from components.tracking import code_version
    from flows.evolution import CONFIG_SNAPSHOT

    snapshot = workdir / experiment / CONFIG_SNAPSHOT
    if not snapshot.is_file():
        _fail(f"unknown experiment {experiment!r}: no {snapshot}", 2)
    cfg = load_config(snapshot)
    try:
        pairs = reproduce_stage(cfg, _store(workdir), round, stage, code_version=code_version(),
                                log=lambda line: err.print(line, style="dim", markup=False, highlight=False))
    except (StoreError, StageJobError) as e:
        _fail(str(e), 2)
    table = Table(title=f"{experiment} round {round} {stage}: committed vs scratch")
    for c in ("output", "committed", "scratch", "same"):
        table.add_column(c)
    for k, (a, b) in pairs.items():
        table.add_row(k, a[:16], b[:16], "[green]yes[/]" if a == b else "[red]NO[/]")
    console.print(table)
    if any(a != b for a, b in pairs.values()):
        _fail("outputs differ: this stage is not reproducible here", 1)
    console.print("[green]byte-identical content[/]")


def _print_table(cols: list[str], rows: list[tuple], title: str | None = None) -> None:
    table = Table(title=title)
    for c in cols:
        table.add_column(str(c))
    for r in rows:
        table.add_row(*("NULL" if v is None else str(v) for v in r))
    console.print(table)
    console.print(f"({len(rows)} rows)", style="dim")


def _register_ops() -> None:
    from flows.ops_cli import register

    register(app)


_register_ops()


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("PREFECT_HOME"):  # Prefect's SQLite database cannot be created in a missing folder
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    app()


if __name__ == "__main__":
    main()
