"""The operator's commands for real: servers on free ports, compare/export/report on two micro runs.

    pytest tests/ops -q
"""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import socket
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from components.servers import free_port
from components.store import Store
from tests.conftest import REPO

from .conftest import coevo


# -- servers ------------------------------------------------------------------------------------

def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status


def test_server_up_status_refuse_busy_down(tmp_path):
    w = str(tmp_path / "wd")
    pp, mp = free_port(), free_port()
    try:
        up = coevo("server", "up", "--workdir", w, "--prefect-port", str(pp), "--mlflow-port", str(mp))
        assert f"http://127.0.0.1:{pp}" in up.stdout and f"http://127.0.0.1:{mp}" in up.stdout
        assert f"PREFECT_API_URL=http://127.0.0.1:{pp}/api" in up.stdout

        st = coevo("server", "status", "--workdir", w)
        assert re.search(r"prefect\s.*running.*200 OK", st.stdout), st.stdout
        assert re.search(r"mlflow\s.*running.*200 OK", st.stdout), st.stdout
        # The UIs and APIs answer, not just the health routes.
        assert _get(f"http://127.0.0.1:{pp}/") == 200
        assert _get(f"http://127.0.0.1:{pp}/api/health") == 200
        assert _get(f"http://127.0.0.1:{mp}/") == 200
        assert _get(f"http://127.0.0.1:{mp}/health") == 200
        for name in ("prefect", "mlflow"):
            assert (Path(w) / "servers" / f"{name}.pid").is_file()
            assert (Path(w) / "servers" / f"{name}.log").stat().st_size > 0

        again = coevo("server", "up", "--workdir", w, "--prefect-port", str(free_port()),
                      "--mlflow-port", str(free_port()), check=False)
        assert again.returncode == 2
        assert "already running" in again.stderr and f"http://127.0.0.1:{pp}" in again.stderr
    finally:
        down = coevo("server", "down", "--workdir", w, check=False)
    assert "stopped prefect" in down.stdout and "stopped mlflow" in down.stdout, down.stdout + down.stderr
    st = coevo("server", "status", "--workdir", w)
    assert "running" not in st.stdout and st.stdout.count("stopped") == 2
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{pp}/api/health")
    assert not (Path(w) / "servers" / "prefect.pid").exists()


def test_server_up_on_a_busy_port_names_the_port(tmp_path):
    w = str(tmp_path / "wd")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = coevo("server", "up", "--workdir", w, "--prefect-port", str(free_port()), "--mlflow-port", str(port),
                  check=False)
    assert p.returncode == 2
    msg = " ".join(p.stderr.split())
    assert f"port {port} on 127.0.0.1 is busy" in msg and "--mlflow-port" in msg, p.stderr
    assert "Traceback" not in p.stderr
    # Nothing was started: the check runs before either server.
    assert not (Path(w) / "servers" / "prefect.pid").exists()


# -- infra --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["prefect.yaml", "k8s-stage-job.yaml", "docker-compose.yaml"])
def test_infra_files_load(name):
    text = (REPO / "infra" / name).read_text()
    assert text.startswith("# "), "every shipped file opens with the command that uses it"
    doc = yaml.safe_load(text)
    if name == "prefect.yaml":
        from flows.deployments import build_deployments

        entry = {d["entrypoint"].split(":")[1] for d in doc["deployments"]}
        assert {"self_evolution", "evolution_round", "run_stage", "evaluate_model"} <= entry
        deps = build_deployments(REPO / "infra" / name, log=lambda m: None)
        by_flow = {d.flow_name: d for d in deps}
        assert set(by_flow) >= {"self_evolution", "evolution_round", "run_stage", "evaluate_model"}
        # The UI's parameter form is the flow's typed signature.
        from prefect.utilities.callables import parameter_schema

        from flows.evolution import self_evolution

        props = parameter_schema(self_evolution).model_dump()["properties"]
        assert props["config_path"]["type"] == "string"
        assert props["overrides"]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}
        assert [s.active for s in by_flow["self_evolution"].schedules] == [False]
    elif name == "k8s-stage-job.yaml":
        manifest = doc["job_configuration"]["job_manifest"]
        assert manifest["kind"] == "Job"
        # The pod runs the flow run (`flows/stage_job.py`), which runs the stage job: the worker fills it in.
        assert doc["job_configuration"]["command"] == "{{ command }}"
        # Every placeholder the template uses is a declared variable.
        used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text))
        declared = set(doc["variables"]["properties"])
        assert used <= declared, used - declared
        limits = manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" in limits
    else:
        assert {"postgres", "prefect-server", "mlflow", "minio"} <= set(doc["services"])
        assert "postgresql+asyncpg://" in doc["services"]["prefect-server"]["environment"][
            "PREFECT_API_DATABASE_CONNECTION_URL"]


# -- compare, export, report on real micro runs ---------------------------------------------------


@pytest.mark.slow
def test_compare_prints_both_experiments_matching_the_store(micro_workdir, tmp_path):
    w = str(micro_workdir.path)
    plot = tmp_path / "cmp.png"
    p = coevo("compare", "micro", "micro-b", "--workdir", w, "--out", str(plot), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert rows and set(rows[0]) == {"level", "round", "micro", "micro-b", "delta"}
    got = {(r["round"]): (float(r["micro"]), float(r["micro-b"])) for r in rows if r["level"] == "all"}
    _, summary = Store(micro_workdir.path / "store").query(
        "SELECT experiment_id, round, greedy_acc FROM v_round_summary ORDER BY 1, 2")
    want: dict[str, list] = {}
    for exp, rnd, acc in summary:
        want.setdefault(str(rnd), [None, None])[0 if exp == "micro" else 1] = acc
    assert set(got) == set(want) == {"0", "1", "2"}
    for rnd, (a, b) in got.items():
        assert a == pytest.approx(want[rnd][0], abs=1e-9) and b == pytest.approx(want[rnd][1], abs=1e-9), rnd
    assert any(r["level"] not in ("all",) for r in rows), "per-level rows are listed too"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The table a person reads shows the same numbers, to 4 places.
    table = coevo("compare", "micro", "micro-b", "--workdir", w, "--out", str(plot)).stdout
    assert "micro-b" in table
    for rnd, (a, b) in got.items():
        line = next(ln for ln in table.splitlines() if re.match(rf"^\W*all\W+{rnd}\W", ln))
        assert f"{a:.4f}" in line and f"{b:.4f}" in line, line


@pytest.mark.slow
def test_compare_unknown_experiment_lists_known(micro_workdir):
    p = coevo("compare", "micro", "nope", "--workdir", str(micro_workdir.path), check=False)
    assert p.returncode == 2 and "unknown experiment 'nope'" in p.stderr and "micro-b" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_compare_as_of_reads_the_store_at_a_snapshot(micro_workdir, tmp_path):
    """micro as it stood after round 1's evaluate, against micro now: rounds 0 and 1 agree to the digit,
    round 2 did not exist yet. A point that does not exist, or a metric the store lacks, is named."""
    w, plot = str(micro_workdir.path), str(tmp_path / "cmp.png")
    p = coevo("compare", "micro", "micro", "--workdir", w, "--out", plot, "--format", "csv",
              "--a-as-of", "micro/r1/evaluate")
    rows = [r for r in csv.DictReader(io.StringIO(p.stdout)) if r["level"] == "all"]
    then, now = "micro as of micro/r1/evaluate", "micro"
    assert [(r["round"], r[then] != "", r["delta"]) for r in rows] == [("0", True, "0.0"), ("1", True, "0.0"),
                                                                       ("2", False, "")], rows
    _, summary = Store(micro_workdir.path / "store").query(
        "SELECT round, greedy_acc FROM v_round_summary WHERE experiment_id = 'micro' ORDER BY 1")
    assert [float(r[now]) for r in rows] == pytest.approx([acc for _, acc in summary], abs=1e-9)

    for args, said in ((["--b-as-of", "micro/r7"], "micro/r7"),
                       (["--a-as-of", "micro/r1", "--metric", "train_policy/train_loss"], "evaluate/<name>")):
        p = coevo("compare", "micro", "micro-b", "--workdir", w, "--out", plot, *args, check=False)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_export_parquet_and_hf(micro_workdir, tmp_path):
    import pyarrow.parquet as pq
    from datasets import load_from_disk

    w = str(micro_workdir.path)
    store = Store(micro_workdir.path / "store")
    n_traj = store.query("SELECT count(*) FROM trajectories WHERE experiment_id = 'micro'")[1][0][0]

    out = tmp_path / "pq"
    coevo("export", "micro", "--to", "parquet", "--workdir", w, "--out", str(out))
    t = pq.read_table(out / "trajectories.parquet")
    assert t.num_rows == n_traj and set(t.column("experiment_id").to_pylist()) == {"micro"}
    # rft rolls nothing out: its step labels are the domain's oracle labels, stored for evaluation only.
    n_labels = store.query("SELECT count(*) FROM step_labels JOIN trajectories USING (trajectory_id) "
                           "WHERE experiment_id = 'micro' AND source = 'oracle'")[1][0][0]
    labels = pq.read_table(out / "step_labels.parquet")
    assert n_labels > 0 and labels.num_rows == n_labels and set(labels.column("source").to_pylist()) == {"oracle"}
    meta = json.loads((out / "export.json").read_text())
    assert meta["rows"]["trajectories"] == n_traj and meta["experiment"] == "micro"

    hf = tmp_path / "hf"
    coevo("export", "micro", "--to", "hf", "--workdir", w, "--out", str(hf))
    ds = load_from_disk(str(hf))
    assert ds["trajectories"].num_rows == n_traj
    assert ds["evaluations"].num_rows == store.query(
        "SELECT count(*) FROM evaluations WHERE experiment_id = 'micro'")[1][0][0]
    assert "completion" in ds["trajectories"].column_names
    assert ds["step_labels"].num_rows == n_labels and "source" in ds["step_labels"].column_names


@pytest.mark.slow
def test_export_unknown_experiment_is_a_clear_error(micro_workdir, tmp_path):
    p = coevo("export", "nope", "--to", "parquet", "--workdir", str(micro_workdir.path),
              "--out", str(tmp_path / "x"), check=False)
    assert p.returncode == 2
    msg = " ".join(p.stderr.split())
    assert "unknown experiment 'nope'" in msg and "micro, micro-b" in msg and "Traceback" not in p.stderr
    bad = coevo("export", "micro", "--to", "csv", "--workdir", str(micro_workdir.path), check=False)
    assert bad.returncode == 2 and "parquet, hf" in bad.stderr


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a["src"])
        elif tag == "table":
            self._table = a.get("id") or f"t{len(self.tables)}"
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.mark.slow
def test_report_is_self_contained_and_lists_every_round(micro_workdir, tmp_path):
    out = tmp_path / "micro.html"
    coevo("report", "micro", "--workdir", str(micro_workdir.path), "--out", str(out))
    text = out.read_text()
    parser = _Collect()
    parser.feed(text)
    assert len(parser.imgs) >= 3
    for src in parser.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in text and "https://" not in text, "no external resources"
    rounds = parser.tables["rounds"]
    assert rounds[0][0] == "round" and [r[0] for r in rounds[1:]] == ["0", "1", "2"]
    accs = Store(micro_workdir.path / "store").query(
        "SELECT round, greedy_acc FROM v_round_summary WHERE experiment_id='micro' ORDER BY 1")[1]
    col = rounds[0].index("greedy_acc")
    assert [float(r[col]) for r in rounds[1:]] == [pytest.approx(a, abs=5e-5) for _, a in accs]
    assert len(parser.tables["lineage"]) - 1 == 3, "one lineage row per trained policy"
    assert "best #1" in text and "worst #1" in text
    assert "experiment: micro" in text  # the config


@pytest.mark.slow
def test_report_unknown_experiment(micro_workdir, tmp_path):
    p = coevo("report", "nope", "--workdir", str(micro_workdir.path), "--out", str(tmp_path / "r.html"), check=False)
    assert p.returncode == 2 and "unknown experiment 'nope'" in p.stderr


def test_operator_commands_are_on_the_coevo_cli():
    """`flows/cli.py` calls `register(app)`, so `coevo server ...` and friends exist."""
    from flows.cli import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert {"server", "serve", "compare", "export", "report"} <= names, (
        "add `from flows.ops_cli import register; register(app)` at the end of flows/cli.py")


# -- the run forms ------------------------------------------------------------------------------

def test_forms_offer_what_this_machine_has(micro_workdir, prefect_server, tmp_path):
    """`coevo serve`'s choices, read off the micro workdir: the checkout's and a user's configs (one that
    does not load is left out, saying why), the store's experiments, the registry's models; each becomes
    an enum of the deployment's schema, and a default the choices exclude is dropped."""
    from flows.deployments import FormChoices, build_deployments

    mine = tmp_path / "mine"
    mine.mkdir()
    good = yaml.safe_load((REPO / "configs" / "micro.yaml").read_text()) | {"experiment": "mine", "rounds": 1}
    (mine / "mine.yaml").write_text(yaml.safe_dump(good))
    (mine / "broken.yaml").write_text("experiment: broken\nrounds: -1\n")
    said: list[str] = []
    choices = FormChoices.discover(micro_workdir.path, [mine], said.append)

    assert {"configs/micro.yaml", "configs/gsm8k.yaml", str((mine / "mine.yaml").resolve())} <= set(choices.configs)
    assert not any("broken" in c for c in choices.configs)
    assert any("broken.yaml is not offered" in s and "rounds" in s for s in said), said
    assert "recipe rft, rounds 1" in choices.configs[str((mine / "mine.yaml").resolve())]
    assert choices.experiments == ["micro", "micro-b"]
    assert {"models:/micro-policy@current", "models:/micro-policy/1"} <= set(choices.models), choices.models

    deps = {d.flow_name: d for d in build_deployments(REPO / "infra" / "prefect.yaml", lambda m: None, choices)}
    props = {n: d._parameter_openapi_schema.properties for n, d in deps.items()}
    assert props["self_evolution"]["config_path"]["enum"] == list(choices.configs)
    assert "- `configs/micro.yaml`: experiment micro, recipe rft" in props["self_evolution"]["config_path"]["description"]
    assert props["run_stage"]["experiment"]["enum"] == ["micro", "micro-b"]
    # Both are rft experiments: the stages offered are rft's, not coevo's reward-model training.
    assert set(props["run_stage"]["stage"]["enum"]) == {"bootstrap", "generate", "verify", "score", "filter",
                                                        "train_policy", "evaluate"}
    assert deps["run_stage"].parameters["workdir"] == str(micro_workdir.path)
    registered = props["evaluate_model"]["registered"]["anyOf"][0]
    assert registered["enum"] == choices.models and registered["type"] == "string"

    # An example default that this machine's choices exclude is dropped, not offered as a broken default.
    only = FormChoices(configs={"configs/micro.yaml": "micro"}, experiments=["micro"])
    deps = {d.flow_name: d for d in build_deployments(REPO / "infra" / "prefect.yaml", lambda m: None, only)}
    assert "config_path" not in deps["self_evolution"].parameters  # prefect.yaml's default is configs/arith.yaml
