"""The operator's commands of the `coevo` CLI: local servers, serving deployments, compare, export, report.

    coevo server up [--prefect-port 4200 --mlflow-port 5000]   # then: coevo server status | down
    coevo serve                                               # serve infra/prefect.yaml's deployments
    coevo compare micro micro-b                               # per-round accuracy from MLflow, plus a plot
    coevo export micro --to parquet|hf [--out DIR]
    coevo report micro [--out micro-report.html]

`register(app)` adds them to the main app in `flows/cli.py`. Imports are lazy so `coevo --help` stays
fast and Prefect settings are read only after `serve` has set the API URL.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.cli_common import WorkdirOpt, console, err, fail, open_store, print_table

HostOpt = Annotated[str, typer.Option("--host", help="Interface the servers listen on.")]

server_app = typer.Typer(no_args_is_help=True, help="Local Prefect and MLflow servers for a workdir.")


# -- servers ------------------------------------------------------------------------------------

@server_app.command("up")
def server_up(
    workdir: WorkdirOpt = Path("workdir"),
    host: HostOpt = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option("--prefect-port", help="Prefect UI and API port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option("--mlflow-port", help="MLflow UI and API port.")] = 5000,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each server to answer.")] = 120.0,
) -> None:
    """Start a Prefect server and an MLflow server over this workdir's stores, in the background."""
    from components import servers

    try:
        started = servers.up(workdir, host=host, prefect_port=prefect_port, mlflow_port=mlflow_port,
                             timeout_s=timeout)
    except servers.ServerError as e:
        fail(str(e), 2)
    p, m = started["prefect"], started["mlflow"]
    console.print(f"[green]prefect[/] {p.url}  (pid {p.pid}, log {p.log})", highlight=False)
    console.print(f"[green]mlflow[/]  {m.url}  (pid {m.pid}, log {m.log})", highlight=False)
    console.print("Point runs at them with:", style="dim")
    console.print(f"  export PREFECT_API_URL={p.api_url}\n  export MLFLOW_TRACKING_URI={m.url}", highlight=False)


@server_app.command("down")
def server_down(workdir: WorkdirOpt = Path("workdir")) -> None:
    """Stop the servers `coevo server up` started for this workdir."""
    from components import servers

    try:
        stopped = servers.down(workdir)
    except servers.ServerError as e:
        fail(str(e), 2)
    if not stopped:
        console.print(f"no server running for {Path(workdir).resolve()}")
    for s in stopped:
        console.print(f"stopped {s.name} (pid {s.pid}, {s.url})", highlight=False)


@server_app.command("status")
def server_status(workdir: WorkdirOpt = Path("workdir")) -> None:
    """Which servers run for this workdir, their URLs, and whether they answer."""
    from components import servers

    rows = []
    for s in servers.status(workdir):
        state = "[green]running[/]" if s.running else "[dim]stopped[/]"
        health = "" if not s.running else ("[green]200 OK[/]" if s.http_status == 200 else f"[red]{s.http_status}[/]")
        rows.append((s.name, state, s.pid or "", s.url or "", health, s.log or ""))
    print_table(("server", "state", "pid", "url", "health", "log"), rows,
                title=f"servers of {Path(workdir).resolve()}", width=160, count=False)


# -- deployments --------------------------------------------------------------------------------

def serve(
    workdir: WorkdirOpt = Path("workdir"),
    prefect_yaml: Annotated[Path, typer.Option("--prefect-yaml", help="Deployment definitions.")] = Path(
        "infra/prefect.yaml"),
    limit: Annotated[Optional[int], typer.Option(help="At most this many flow runs at once.")] = None,
    gpu_limit: Annotated[int, typer.Option(help="Concurrency limit of the `gpu` task tag (0: none).")] = 1,
    configs: Annotated[Optional[list[Path]], typer.Option(
        "--configs", help="A folder of your own experiment YAMLs, offered in the run forms beside the checkout's "
                          "configs/ (repeatable).")] = None,
) -> None:
    """Serve the deployments of infra/prefect.yaml so that a run started in the UI executes here.

    Uses $PREFECT_API_URL, else the server `coevo server up` started for --workdir. The forms offer the
    configs found, the store's experiments, the work pools and the registry's models as they are now:
    serve again to offer new ones.
    """
    if not os.environ.get("PREFECT_API_URL"):
        from components import servers

        info = servers.read_info(workdir, "prefect")
        if info is None or not servers.status(workdir)[0].running:
            fail(f"no Prefect server: set PREFECT_API_URL, or start one with `coevo server up --workdir {workdir}`", 2)
        os.environ["PREFECT_API_URL"] = info.api_url
        mlflow = servers.read_info(workdir, "mlflow")
        if mlflow is not None and not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ["MLFLOW_TRACKING_URI"] = mlflow.url
    if "prefect" in sys.modules:
        # Settings are read at import; a late env change must go through the settings context.
        from prefect.settings import PREFECT_API_URL, temporary_settings

        ctx = temporary_settings(updates={PREFECT_API_URL: os.environ["PREFECT_API_URL"]})
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    from flows.deployments import DeploymentError, serve_deployments

    with ctx:
        try:
            serve_deployments(prefect_yaml, limit=limit, gpu_limit=gpu_limit,
                              log=lambda m: console.print(m, highlight=False), workdir=workdir,
                              config_dirs=list(configs or []))
        except DeploymentError as e:
            fail(str(e), 2)


# -- analysis -----------------------------------------------------------------------------------

def compare(
    exp_a: str,
    exp_b: str,
    workdir: WorkdirOpt = Path("workdir"),
    tracking_uri: Annotated[Optional[str], typer.Option(
        "--tracking-uri", envvar="MLFLOW_TRACKING_URI", help="MLflow URI; default: the workdir's mlflow.db.")] = None,
    metric: Annotated[str, typer.Option(help="Round metric, as logged: stage/metric.")] = "evaluate/greedy_acc",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Plot PNG path.")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="table|csv|json")] = "table",
    a_as_of: Annotated[Optional[str], typer.Option(
        "--a-as-of", help="Read the first experiment from the store as it stood after this attempt's commit, "
                          "<experiment>/r<round>\\[/<stage>\\[/a<attempt>]] (e.g. before a rerun).")] = None,
    b_as_of: Annotated[Optional[str], typer.Option("--b-as-of", help="The same for the second.")] = None,
) -> None:
    """Compare two experiments round by round: a table and a plot. From the MLflow API; with --a-as-of or
    --b-as-of, both sides from the store's evaluations, each at its snapshot (or now)."""
    from components.compare import CompareError, Comparison, compare_experiments, plot_comparison, store_rounds
    from components.servers import mlflow_store_uri

    try:
        if a_as_of is None and b_as_of is None:
            result = compare_experiments(tracking_uri or mlflow_store_uri(workdir), exp_a, exp_b, metric=metric)
        else:
            store = open_store(workdir)
            result = Comparison(metric, store_rounds(store, exp_a, metric, a_as_of),
                                store_rounds(store, exp_b, metric, b_as_of))
    except CompareError as e:
        fail(str(e), 2)
    out = out or workdir / "compare" / f"{exp_a}_vs_{exp_b}.png"
    plot_comparison(result, out)
    cols, rows = result.columns(), result.rows()
    if format == "csv":
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows([["" if v is None else v for v in r] for r in rows])
    elif format == "json":
        json.dump([dict(zip(cols, r)) for r in rows], sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif format == "table":
        print_table(cols, [["" if v is None else f"{v:.4f}" if isinstance(v, float) else v for v in r] for r in rows],
                    title=f"{metric}: {exp_a} vs {exp_b}", right=[c for c in cols if c != "level"],
                    width=40 + 16 * len(cols), count=False)
    else:
        fail(f"--format must be table, csv or json, not {format!r}", 2)
    err.print(f"plot: {out}", highlight=False)


def export(
    experiment: str,
    to: Annotated[str, typer.Option("--to", help="parquet: a file per table; hf: a datasets.DatasetDict on disk.")],
    workdir: WorkdirOpt = Path("workdir"),
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output folder.")] = None,
) -> None:
    """Export one experiment's rows from every store table, to share or load elsewhere."""
    from components.export import ExportError, export_experiment
    from components.store import StoreError

    out = out or workdir / "exports" / f"{experiment}-{to}"
    if to == "hf":
        import datasets

        datasets.disable_progress_bars()
    try:
        counts = export_experiment(open_store(workdir), experiment, to, out)
    except (ExportError, StoreError) as e:
        fail(str(e), 2)
    print_table(("table", "rows"), counts.items(), title=f"{experiment} ({to})", right=["rows"], count=False)
    console.print(f"wrote {out}", highlight=False)


def report(
    experiment: str,
    workdir: WorkdirOpt = Path("workdir"),
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="HTML file.")] = None,
    samples: Annotated[int, typer.Option(help="Best and worst trajectories shown per round.")] = 3,
) -> None:
    """Write a self-contained HTML report: config, per-round table, plots, samples, lineage."""
    from components.report import ReportError, write_report
    from components.store import StoreError

    out = out or workdir / experiment / "report.html"
    try:
        write_report(open_store(workdir), experiment, out, samples=samples)
    except (ReportError, StoreError) as e:
        fail(str(e), 2)
    console.print(f"wrote {out}", highlight=False)


# -- wiring -------------------------------------------------------------------------------------

_COMMANDS = {"serve": serve, "compare": compare, "export": export, "report": report}


def register(app: typer.Typer) -> None:
    """Add the operator commands to `app`; calling it twice adds nothing."""
    names = {c.name or (c.callback.__name__ if c.callback else None) for c in app.registered_commands}
    for name, fn in _COMMANDS.items():
        if name not in names:
            app.command(name)(fn)
    if "server" not in {g.name for g in app.registered_groups}:
        app.add_typer(server_app, name="server")
