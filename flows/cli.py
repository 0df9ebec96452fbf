"""The `coevo` command line.

    coevo run --config configs/arith.yaml [--set rounds=2 --set train_policy.steps=100]
    coevo status arith-default
    coevo query "SELECT round, count(*) FROM trajectories GROUP BY 1"
    coevo rerun arith-default --round 2 --stage score [--downstream]
    coevo resume arith-default
    coevo build-model workdir/standin --domain arith [--arch qwen2|llama] [--size small|mini|micro|tiny]
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.cli_common import WorkdirOpt, console, err, fail, open_store, print_table
from flows.ops_cli import register as register_ops

app = typer.Typer(add_completion=False, no_args_is_help=True, help="coevo: self-improvement rounds for LMs.")

# Set for the whole process before Prefect or MLflow is imported: no telemetry, no HF Hub calls.
# A variable the user exported wins (HF_HUB_OFFLINE=0 lets `coevo evaluate` download a model).
ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "MLFLOW_ENABLE_TELEMETRY": "false",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",  # else tokenizers warns at every fork of a process that used it
    # A command without a Prefect server starts a temporary one, which first migrates a fresh PREFECT_HOME's
    # database: 21.7 s measured on 2 cores, past Prefect's 20 s default, and the command failed.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def set_env_defaults() -> None:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


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
        fail(str(e), 2)
    from flows.evolution import check_startable

    try:  # a model or data file missing here fails now, naming the field, not in the first stage's job
        check_startable(cfg)
    except ConfigError as e:
        fail(str(e), 2)
    from components.storage import StorageError, check

    try:  # shared storage that refuses the environment's credentials fails here, before any stage
        check(cfg.storage_dir)
    except StorageError as e:
        fail(str(e), 2)
    _run_flow("self_evolution", progress_bars=True, config_path=str(config), overrides=overrides)
    _print_summary(Path(cfg.workdir), cfg.experiment)


@app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(help="Trajectories: .jsonl, .json or .parquet, one a row (or wide: --models).")],
    config: Annotated[Path, typer.Option("--config", "-c", help="The experiment YAML whose domain holds the problems.")],
    experiment: Annotated[str, typer.Option(help="The experiment the trajectories are stored under.")],
    prompt_field: Annotated[str, typer.Option(help="The problem text's field.")] = "question",
    completion_field: Annotated[str, typer.Option(help="The solution's field (simple layout).")] = "completion",
    correct_field: Annotated[Optional[str], typer.Option(help="A given label's field, bool or 0/1.")] = None,
    step_labels_field: Annotated[Optional[str], typer.Option(help="Given step labels' field.")] = None,
    models: Annotated[Optional[str], typer.Option(help="Wide layout: comma-separated keys of {solution, is_correct} "
                                                       "sub-objects, one trajectory each.")] = None,
    purpose: Annotated[str, typer.Option(help="'train', or 'eval' for trajectories on held-out problems.")] = "train",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override, e.g. --set workdir=/data/coevo.")] = None,
) -> None:
    """Load existing trajectories into the store through the `import_trajectories` flow: each one's problem
    found in the domain, re-verified, stored with its file, row and model; prints the verifier's agreement
    with the given labels."""
    import json

    from components.config import ConfigError, load_config

    if not file.is_file():
        fail(f"{file}: no such file", 2)
    entry = {"path": str(file.resolve()), "prompt_field": prompt_field, "completion_field": completion_field,
             "correct_field": correct_field, "step_labels_field": step_labels_field, "purpose": purpose,
             "models": [m.strip() for m in models.split(",") if m.strip()] if models else None}
    overrides = [*(set_ or []), f"experiment={experiment}", "recipe=import", "rounds=0", f"imports={json.dumps([entry])}"]
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        fail(str(e), 2)
    _run_flow("import_trajectories", config_path=str(config), overrides=overrides)
    from components.store import Store

    run = Store.for_config(cfg).committed_run(cfg.experiment, 0, "import")
    print(f"imported into {cfg.experiment} ({cfg.store_path}): " + ", ".join(
        f"{k}={v:g}" for k, v in json.loads(run["metrics_json"] or "{}").items()))


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def _run_flow(flow_name: str, /, *, progress_bars: bool = False, **params):
    from prefect.exceptions import ParameterTypeError

    from components.locking import ExperimentLockedError
    from components.storage import StorageError
    from components.store import StoreError
    from flows import evolution
    from flows.prefect_server import use_own_server

    try:  # the bars end before an error is printed
        use_own_server()  # Prefect's temporary server, on a port no other coevo process drew
        with _progress_bars() if progress_bars else nullcontext():
            return getattr(evolution, flow_name)(**params)
    except (ExperimentLockedError, StoreError, StorageError, ValueError, FileNotFoundError, ParameterTypeError) as e:
        fail(str(e), 2)  # ParameterTypeError: a value outside a flow parameter's type, as the form refuses it
    except Exception as e:  # the flow already logged the traceback
        fail(f"{flow_name} failed: {type(e).__name__}: {e}", 1)


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
    cols = ("round", "curriculum_levels", "generated", "selected", "greedy_acc", "greedy_acc_by_level")
    rows = [tuple(round(r[c], 3) if c == "greedy_acc" and r[c] is not None else r[c] for c in cols)
            for r in open_store(workdir).round_summary(experiment)]
    print_table(cols, rows, title=f"{experiment}: rounds")


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
        fail(str(e), 2)
    if _looks_local(model) and not Path(model).exists():
        fail(f"model path not found: {model}", 2)
    metrics = _run_flow("evaluate_model", model=model, config_path=str(config), overrides=overrides, name=name)
    print_table(["metric", "value"], [(k, round(v, 4)) for k, v in sorted(metrics.items())], title=model)


@app.command("config-schema")
def config_schema() -> None:
    """Print the JSON schema of an experiment config: every section, field, type, default and description."""
    import json

    from components.config import ExperimentConfig

    print(json.dumps(ExperimentConfig.model_json_schema(), indent=2))


@app.command("build-model")
def build_model(
    out_dir: Annotated[Path, typer.Argument(help="New (or empty) folder for the model and tokenizer.")],
    domain: Annotated[str, typer.Option(help="Domain whose prompts and solutions train the tokenizer.")] = "arith",
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Take the domain, with its options (data "
                                                   "files), from this experiment YAML instead.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override in that YAML, e.g. --set "
                                                                    "domain.options.test_size=10.")] = None,
    arch: Annotated[str, typer.Option(help="qwen2 or llama.")] = "qwen2",
    size: Annotated[str, typer.Option(help="small (~3M parameters), mini (~1.3M), micro (~0.5M, micro.yaml's "
                                                "size) or tiny (~0.1M, for tests).")] = "small",
    seed: Annotated[int, typer.Option(help="Seed of the random init.")] = 0,
    per_level: Annotated[int, typer.Option(min=1, help="Problems per level in the tokenizer's text.")] = 500,
    positions: Annotated[Optional[int], typer.Option(min=16, help="Context length in tokens, where the size's "
                                                             "default is too short (an agent's episodes).")] = None,
    copy_steps: Annotated[int, typer.Option(min=0, help="Steps of training on random text to copy numbers from the "
                                                        "context, as a pretrained model does (0: a random init).")] = 0,
) -> None:
    """Build a stand-in for a hub model: a BPE tokenizer trained on the domain's text and a random Qwen2/Llama."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        fail(f"{out_dir} exists and is not an empty folder: give a new path", 2)
    from dataclasses import replace

    from components.domains import get_domain
    from components.models.standin import SIZES, build_standin, domain_texts, param_count

    if size not in SIZES:
        fail(f"unknown --size {size!r}: choose one of {', '.join(SIZES)}", 2)
    try:
        cfg = replace(SIZES[size], arch=arch, **({"max_position_embeddings": positions} if positions else {}))
        if config is not None:
            from components.config import load_config

            d = load_config(config, list(set_ or [])).domain
            dom = get_domain(d.name, **d.options)
        else:
            dom = get_domain(domain)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e), 2)
    out = build_standin(out_dir, domain_texts(dom, n_per_level=per_level, seed=seed), cfg, seed=seed,
                        copy_steps=copy_steps, log=lambda line: console.print(line, markup=False))
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]  # len(tokenizer), specials included
    console.print(f"{cfg.arch} stand-in in {out}: {param_count(out):,} parameters, vocabulary {vocab}")


@app.command()
def resume(
    experiment: str,
    workdir: WorkdirOpt = Path("workdir"),
    rounds: Annotated[Optional[int], typer.Option(
        "--rounds", min=0, help="Continue to this many rounds (more than it has): its committed rounds are kept.")] = None,
    more_rounds: Annotated[Optional[int], typer.Option(
        "--more-rounds", min=1, help="Continue to this many rounds past its stored ones (what the nightly "
                                     "schedule does).")] = None,
) -> None:
    """Continue an experiment from its first stage without a committed attempt, or past its last round."""
    from flows.evolution import CONFIG_SNAPSHOT

    snapshot = workdir / experiment / CONFIG_SNAPSHOT
    if not snapshot.is_file():
        fail(f"unknown experiment {experiment!r}: no {snapshot}", 2)
    if rounds is not None and more_rounds is not None:
        fail("give --rounds or --more-rounds, not both", 2)
    _run_flow("self_evolution", progress_bars=True, config_path=str(snapshot), rounds=rounds,
              more_rounds=more_rounds)
    _print_summary(workdir, experiment)


@app.command()
def rerun(
    experiment: str,
    round: Annotated[int, typer.Option("--round", "-r")],
    stage: Annotated[str, typer.Option("--stage", "-s")],
    downstream: Annotated[bool, typer.Option(
        help="Also recompute now what the rerun makes stale: the round's later stages and every later round.")] = False,
    workdir: WorkdirOpt = Path("workdir"),
) -> None:
    """Rerun one stage of one round as a new attempt (the `run_stage` flow). What was computed from the old
    attempt (the round's later stages, every later round) turns stale; `coevo resume` or --downstream recomputes it."""
    _run_flow("run_stage", progress_bars=True, experiment=experiment, round=round, stage=stage,
              downstream=downstream, workdir=str(workdir))
    status(experiment, workdir)


@app.command()
def query(
    sql: str,
    workdir: WorkdirOpt = Path("workdir"),
    format: Annotated[str, typer.Option("--format", "-f", help="table|csv|json|parquet")] = "table",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to this file.")] = None,
    as_of: Annotated[Optional[str], typer.Option(
        "--as-of", help="Read the store as it stood at <experiment>/r<round>\\[/<stage>\\[/a<attempt>]]: after that "
                        "attempt's commit (the stage's live attempt; the round's last live stage).")] = None,
    catalog: Annotated[Optional[str], typer.Option(
        "--catalog", help="A shared store's catalog, postgres:host=… dbname=… (default: COEVO_CATALOG, else the "
                          "workdir's store); its data path's credentials come from the environment.")] = None,
) -> None:
    """Run one read-only statement against the store: SELECT, WITH, DESCRIBE, SHOW or EXPLAIN (views:
    v_round_summary, v_trajectory_scores, v_lineage, ...). Nothing outside the store is reachable. It reads a
    snapshot: a run committing meanwhile neither waits for it nor shows half a stage."""
    from components.store import StoreError

    store = open_store(workdir, catalog)
    try:
        if format == "parquet":
            import pyarrow.parquet as pq

            if out is None:
                fail("--format parquet needs --out FILE", 2)
            pq.write_table(store.query_arrow(sql, as_of=as_of), out)
            console.print(f"wrote {out}")
            return
        cols, rows = store.query(sql, as_of=as_of)
    except StoreError as e:
        fail(str(e), 2)
    if format == "table" and out is None:
        print_table(cols, rows)
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
            fail(f"--format must be table, csv, json or parquet, not {format!r}", 2)
    finally:
        if out:
            fh.close()


@app.command()
def status(experiment: str, workdir: WorkdirOpt = Path("workdir")) -> None:
    """Rounds and stages of an experiment with their attempt states."""
    from components.store import StoreError

    try:
        runs = open_store(workdir).stage_runs(experiment)
    except StoreError as e:
        fail(str(e), 2)
    if not runs:
        fail(f"unknown experiment {experiment!r} in {workdir}", 2)
    style = {"committed": "green", "failed": "red", "running": "yellow", "superseded": "dim"}
    lines = []
    for r in runs:
        st = r["status"] + (" (stale)" if r["stale"] and r["status"] == "committed" else "")
        color = "magenta" if r["stale"] and r["status"] == "committed" else style.get(r["status"], "")
        rows = ", ".join(f"{k}={v}" for k, v in json.loads(r["rows_json"] or "{}").items())
        dur = f"{r['duration_s']:.1f}" if r["duration_s"] is not None else ""
        lines.append((r["round"], r["stage"], r["attempt"], f"[{color}]{st}[/]" if color else st, dur,
                      rows, (r["error"] or "").splitlines()[0][:60] if r["error"] else ""))
    print_table(("round", "stage", "attempt", "status", "duration_s", "rows", "error"), lines,
                title=f"{experiment}: stage runs", count=False)


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
        fail(f"unknown experiment {experiment!r}: no {snapshot}", 2)
    cfg = load_config(snapshot)
    try:
        pairs = reproduce_stage(cfg, open_store(workdir), round, stage, code_version=code_version(),
                                log=lambda line: err.print(line, style="dim", markup=False, highlight=False))
    except (StoreError, StageJobError) as e:
        fail(str(e), 2)
    print_table(("output", "committed", "scratch", "same"),
                [(k, a[:16], b[:16], "[green]yes[/]" if a == b else "[red]NO[/]") for k, (a, b) in pairs.items()],
                title=f"{experiment} round {round} {stage}: committed vs scratch", count=False)
    if any(a != b for a, b in pairs.values()):
        fail("outputs differ: this stage is not reproducible here", 1)
    console.print("[green]byte-identical content[/]")


register_ops(app)  # server, serve, compare, export, report


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a scheduler's stop, `kill`) ends the command as Ctrl-C would, through its `finally` blocks and
    exit hooks, so the temporary Prefect server it started stops with it: under the default action a
    terminated `coevo run` left that server running. A second SIGTERM ends it at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def main() -> None:
    set_env_defaults()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if os.environ.get("PREFECT_HOME"):  # Prefect's SQLite database cannot be created in a missing folder
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    app()


if __name__ == "__main__":
    main()
