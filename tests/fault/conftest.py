"""Fault injection on real processes: `coevo run` subprocesses, `kill -9`, `coevo resume`, compared by content.

One session fixture, `fault_runs`, starts three micro experiments at once (they overlap well on two
cores: most of a stage is one single-threaded job process):

- `ref`: the uninterrupted reference run. While it writes, a reader thread polls `count(*)`
  through `Store.query`, and a second `coevo run` of the same experiment tries to take its lock.
- `killed`: the same config, seed and experiment name in another workdir. One stage job per stage
  is SIGKILLed mid-stage, then the `coevo run` process itself between two commits; `coevo resume`
  finishes the experiment.
- `seed1`: seed 1, round 0 only, to show that another seed gives other content.

Nothing is mocked: the faults are real signals to real processes, a real tmpfs, real flipped bytes.
The CLI runs as a user runs it (`python -m flows.cli`), each process with Prefect's ephemeral server
under its own PREFECT_HOME.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from components.store import DATA_TABLES, Store, StoreError, content_hash_sql, experiment_filter
from components.tables import TABLES
from tests import conftest as shared
from tests.conftest import REPO, alive, coevo_cmd, proc_stat

MICRO = REPO / "configs" / "micro.yaml"
EXPERIMENT = "fault"
# The same in every run, so every run has the same config hash; 3 retries absorb the injected kills.
# Shorter training than the shipped micro config (these runs test faults, not learning): half the bootstrap
# steps still leave round 1 right answers to select and train on.
COMMON_SET = ["stage_retries=3", "bootstrap.steps=250", "train_policy.steps=40"]
KILL_STAGES = ("generate", "verify", "score", "filter", "train_policy", "evaluate")
# A round-1 kill lands once the job has created its temp output dir, i.e. it is inside the stage body;
# long stages wait further for the job to log this line (work under way), then for this delay. A job
# that publishes first is a miss, and the same stage is killed in round 2 as soon as its job is up.
KILL_MARKERS = {"generate": "problems at levels", "train_policy": "SFT on", "evaluate": "held-out problems"}
KILL_DELAY_S = {"generate": 0.2, "train_policy": 0.3, "evaluate": 0.5}
# The flow process is killed between two commits: after round 2's `generate` committed, while the
# job of the next stage (`verify`) runs, so resume also has an attempt left `running` to settle.
FLOW_KILL_AFTER = (2, "generate")
FLOW_KILL_DURING = (2, "verify")
FIXTURE_TIMEOUT_S = 1500

START_RE = re.compile(rf"{re.escape(EXPERIMENT)}/r(\d+)/(\w+)/a(\d+): starting job")
READER_SQL = ("SELECT (SELECT count(*) FROM trajectories), (SELECT count(*) FROM verifications), "
              "(SELECT count(*) FROM selections)")
READER_TABLES = ("trajectories", "verifications", "selections")


# -- running the CLI -------------------------------------------------------------------------

# Each CLI process gets its own ephemeral Prefect server (under its own PREFECT_HOME) and the workdir's MLflow.
# COEVO_TORCH_THREADS=1 (shared.coevo_env): three runs share two cores, and every run (reference,
# killed, rerun) must train with the same thread count to compare checkpoints bit for bit.
UNSET = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "COEVO_WORKDIR")
FAULT_ENV = {
    "COLUMNS": "250", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
    # Several ephemeral Prefect servers start at once on two cores; the default 20 s is too short.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}


def coevo_env(prefect_home: Path) -> dict[str, str]:
    return shared.coevo_env(prefect_home, env=FAULT_ENV, unset=UNSET)


def run_coevo(*args: str, prefect_home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return shared.run_coevo(*args, prefect_home=prefect_home, env=FAULT_ENV, unset=UNSET, timeout=timeout)


def squash(text: str) -> str:
    """Drop all whitespace: rich wraps long messages (paths included) at the terminal width."""
    return re.sub(r"\s+", "", text)


def contains(haystack: str, needle: str) -> bool:
    return squash(needle) in squash(haystack)


# -- processes ----------------------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := proc_stat(int(d))) is not None:
            children[st[1]].append(int(d))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and everything it started (collected first: orphans get reparented)."""
    pids = [pid] + descendants(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def cmdline(pid: int) -> bytes:
    """A process's command line, its arguments joined by spaces; b"" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").rstrip()
    except OSError:
        return b""


def find_job(spec_path: Path, timeout_s: float = 60.0) -> int | None:
    """The pid of `python -m components.jobs <stage> --spec <spec_path>`: a new interpreter, or a job forked
    from the warm server (`components/jobs/warm.py`), whose process title is that command as one string."""
    want = f" --spec {spec_path}".encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            line = cmdline(int(d))
            if b" -m components.jobs " in line and line.endswith(want):
                return int(d)
        time.sleep(0.01)
    return None


class LogTail:
    """New complete lines of a growing log file."""

    def __init__(self, path: Path, pos: int = 0):
        self.path, self.pos, self._buf = path, pos, ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        *done, self._buf = (self._buf + data.decode(errors="replace")).split("\n")
        return done


# -- runs ------------------------------------------------------------------------------------------

@dataclass
class Run:
    name: str
    workdir: Path
    overrides: list[str]
    experiment: str = EXPERIMENT
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    wall_s: float = 0.0
    # snapshots taken when the fixture ended (later tests rerun stages of these experiments)
    hashes: dict[str, tuple[int, str]] = field(default_factory=dict)
    stage_runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def prefect_home(self) -> Path:
        return self.workdir / ".prefect"

    @property
    def store(self) -> Store:
        return Store(self.workdir / "store", lock_timeout_s=60)

    @property
    def exp_dir(self) -> Path:
        return self.workdir / self.experiment

    def start(self, *args: str) -> subprocess.Popen:
        log = self.workdir.parent / f"{self.name}-{len(self.logs)}-{args[0]}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(coevo_cmd(*args), cwd=REPO, env=coevo_env(self.prefect_home), stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        self.logs.append(log)
        return p

    def start_run(self) -> subprocess.Popen:
        sets = [x for o in [f"workdir={self.workdir}", f"experiment={self.experiment}", *self.overrides]
                for x in ("--set", o)]
        return self.start("run", "--config", str(MICRO), *sets)

    def start_resume(self) -> subprocess.Popen:
        return self.start("resume", self.experiment, "--workdir", str(self.workdir))

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-n:])
                         for log in self.logs)

    def assert_finished(self) -> None:
        last = self.procs[-1]
        assert last.returncode == 0, f"{self.name}: last coevo process exited {last.returncode}\n{self.log_tail()}"

    def cli(self, *args: str, prefect_home: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return run_coevo(*args, "--workdir", str(self.workdir), prefect_home=prefect_home or self.prefect_home,
                         timeout=timeout)


@dataclass
class FaultRuns:
    ref: Run
    killed: Run
    seed1: Run
    kills: list[dict[str, Any]]
    missed: list[dict[str, Any]]
    flow_kill: dict[str, Any] | None
    reader_counts: list[tuple[int, ...]]
    reader_errors: list[str]
    holder: dict[str, Any]  # a reader that held one transaction open through the whole `ref` run
    second_writer: dict[str, Any]
    wall_s: float


def _kill_job(run: Run, tail_pos: int, log: Path, rnd: int, stage: str, attempt: int,
              last_chance: bool) -> dict[str, Any] | None:
    out_dir = run.exp_dir / f"r{rnd}" / stage / f"a{attempt}"
    spec = out_dir.with_name(out_dir.name + ".spec.json")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    pid = find_job(spec)
    if pid is None:
        return None
    t0 = time.monotonic()
    marker_seen = False
    if last_chance:
        time.sleep(0.2)  # the job process is up and its attempt is `running`: kill it wherever it is
    else:
        while alive(pid) and not tmp.exists():
            time.sleep(0.002)
        if stage in KILL_MARKERS:
            tail = LogTail(log, tail_pos)
            while alive(pid) and not marker_seen:
                marker_seen = any(KILL_MARKERS[stage] in line for line in tail.lines())
                time.sleep(0.01)
        end = time.monotonic() + KILL_DELAY_S.get(stage, 0.0)
        while alive(pid) and time.monotonic() < end:
            time.sleep(0.01)
    if not alive(pid) or out_dir.exists():
        return None  # it finished (published its output) first: a miss, round 2 gets the kill instead
    tmp_existed = tmp.exists()
    os.kill(pid, signal.SIGKILL)
    return {"stage_run_id": f"{run.experiment}/r{rnd}/{stage}/a{attempt}", "round": rnd, "stage": stage,
            "attempt": attempt, "pid": pid, "tmp_existed": tmp_existed, "marker_seen": marker_seen,
            "published_before_kill": out_dir.exists(), "after_s": round(time.monotonic() - t0, 2),
            "mode": "on_sight" if last_chance else "mid_stage"}


def _drive_killed(run: Run, deadline: float) -> tuple[list[dict], list[dict], dict | None]:
    """Run `killed`: SIGKILL one job per stage mid-stage, then the flow process, then resume."""
    remaining = set(KILL_STAGES)
    kills: list[dict] = []
    missed: list[dict] = []
    flow_kill: dict | None = None
    armed = False  # FLOW_KILL_AFTER has committed: kill the flow once FLOW_KILL_DURING's job is running
    commit_re = re.compile(rf"{re.escape(run.experiment)}/r{FLOW_KILL_AFTER[0]}/{FLOW_KILL_AFTER[1]}/a\d+: committed")
    proc = run.start_run()
    tail = LogTail(run.logs[-1])
    while time.monotonic() < deadline:
        for line in tail.lines():
            if flow_kill is None and commit_re.search(line):
                armed = True
            m = START_RE.search(line)
            if not m:
                continue
            rnd, stage, attempt = int(m.group(1)), m.group(2), int(m.group(3))
            if armed and flow_kill is None and (rnd, stage) == FLOW_KILL_DURING:
                out_dir = run.exp_dir / f"r{rnd}" / stage / f"a{attempt}"
                job = find_job(out_dir.with_name(out_dir.name + ".spec.json"))
                victims = kill_tree(proc.pid)  # `kill -9` of the flow first; its server and job die with it
                proc.wait()
                flow_kill = {"pid": proc.pid, "returncode": proc.returncode, "job_pid": job,
                             "running": f"{run.experiment}/r{rnd}/{stage}/a{attempt}", "killed_pids": victims}
                proc = run.start_resume()
                tail = LogTail(run.logs[-1])
                break
            if stage in remaining and rnd >= 1:
                k = _kill_job(run, tail.pos, run.logs[-1], rnd, stage, attempt, last_chance=rnd >= 2)
                if k is None:
                    missed.append({"round": rnd, "stage": stage, "attempt": attempt})
                else:
                    kills.append(k)
                    remaining.discard(stage)
        if proc.poll() is not None and not tail.lines():
            break
        time.sleep(0.02)
    return kills, missed, flow_kill


def _reader(run: Run, stop: threading.Event, counts: list, errors: list) -> None:
    store = run.store
    while not stop.is_set():
        try:
            _, rows = store.query(READER_SQL)
            counts.append(tuple(int(x) for x in rows[0]))
        except StoreError as e:
            if "no store at" not in str(e):
                errors.append(str(e))
        except Exception as e:  # noqa: BLE001 - anything else a reader sees is a finding
            errors.append(f"{type(e).__name__}: {e}")
        stop.wait(0.2)


def _holder(run: Run, stop: threading.Event, out: dict) -> None:
    """Open a reader as soon as the store exists and hold one transaction on it until `stop`, reading every
    half second: a notebook left open beside a run. It must never fail the run, and it keeps its snapshot."""
    store = run.store
    out.update(counts=[], errors=[])
    while not stop.is_set() and not store.exists():
        stop.wait(0.05)
    try:
        with store.reader() as con:
            con.execute("BEGIN TRANSACTION")
            out["opened"] = time.monotonic()
            while not stop.is_set():
                out["counts"].append(con.execute(READER_SQL).fetchone())
                stop.wait(0.5)
            out["closed"] = time.monotonic()
            out["after"] = tuple(con.execute(READER_SQL).fetchone())  # still the snapshot it began on
            con.execute("COMMIT")
        out["fresh"] = tuple(store.query(READER_SQL)[1][0])  # a new transaction sees the finished run
    except Exception as e:  # noqa: BLE001 - anything a reader sees is a finding
        out["errors"].append(f"{type(e).__name__}: {e}")


def _second_writer(run: Run, base: Path, out: dict, deadline: float) -> None:
    lock = run.exp_dir / ".lock"
    first = run.procs[0]
    while time.monotonic() < deadline and first.poll() is None:
        try:
            if json.loads(lock.read_text() or "{}").get("pid") == first.pid:
                break
        except (OSError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    out["holder_pid"] = first.pid
    if first.poll() is not None:
        return  # the first run is over: a second `coevo run` now would just run the experiment again
    sets = [x for o in [f"workdir={run.workdir}", f"experiment={run.experiment}", *run.overrides]
            for x in ("--set", o)]
    out["result"] = run_coevo("run", "--config", str(MICRO), *sets, prefect_home=base / "second-writer.prefect",
                              timeout=300)
    out["holder_alive_after"] = first.poll() is None


@pytest.fixture(scope="session")
def fault_runs(tmp_path_factory) -> FaultRuns:
    base = tmp_path_factory.mktemp("fault")
    ref = Run("ref", base / "ref", list(COMMON_SET))
    killed = Run("killed", base / "killed", list(COMMON_SET))
    # rounds=0 keeps it cheap; round-0 content depends on (seed, round, stage) only, not on `rounds`.
    seed1 = Run("seed1", base / "seed1", [*COMMON_SET, "seed=1", "rounds=0"])
    t0, started = time.monotonic(), time.time()
    deadline = t0 + FIXTURE_TIMEOUT_S
    stop = threading.Event()
    counts: list[tuple[int, ...]] = []
    errors: list[str] = []
    second: dict[str, Any] = {}
    holder: dict[str, Any] = {}
    hold = threading.Event()
    threads: list[threading.Thread] = []
    try:
        ref.start_run()
        seed1.start_run()
        threads = [threading.Thread(target=_reader, args=(ref, stop, counts, errors), daemon=True),
                   threading.Thread(target=_holder, args=(ref, hold, holder), daemon=True),
                   threading.Thread(target=_second_writer, args=(ref, base, second, deadline), daemon=True)]
        for t in threads:
            t.start()
        kills, missed, flow_kill = _drive_killed(killed, deadline)
        for run in (ref, seed1):
            run.procs[-1].wait(timeout=max(1.0, deadline - time.monotonic()))
        holder["run_ended"] = time.monotonic()
        hold.set()
        stop.set()
        for t in threads:
            t.join(timeout=300)
    finally:
        stop.set()
        hold.set()
        for run in (ref, killed, seed1):
            for p in run.procs:
                if p.poll() is None:
                    kill_tree(p.pid)
                    p.wait()
    for run in (ref, killed, seed1):
        run.wall_s = max(log.stat().st_mtime for log in run.logs) - started  # its last process's last output
        if run.procs[-1].returncode == 0:
            run.hashes = run.store.table_hashes(run.experiment)
            run.stage_runs = run.store.stage_runs(run.experiment)
    runs = FaultRuns(ref, killed, seed1, kills, missed, flow_kill, counts, errors, holder, second,
                     time.monotonic() - t0)
    (base / "fault_runs.json").write_text(json.dumps({  # for a person reading a failure
        "wall_s": {r.name: round(r.wall_s, 1) for r in (ref, killed, seed1)}, "kills": kills, "missed": missed,
        "flow_kill": flow_kill, "reader_distinct_counts": sorted(set(counts)), "reader_errors": errors,
        "holder": {k: v for k, v in holder.items() if k != "counts"} | {"distinct": sorted(set(holder.get("counts", [])))},
        "second_writer_rc": second["result"].returncode if "result" in second else None,
    }, indent=1, default=str))
    return runs


# -- store helpers --------------------------------------------------------------------------------

def round_filter(table: str) -> str:
    """The store's experiment filter for `table` (components.store.experiment_filter), narrowed to one round:
    a SQL condition with two `?`, the experiment id and the round."""
    return experiment_filter(table).replace("experiment_id = ?", "experiment_id = ? AND round = ?")


def round_hashes(store: Store, experiment: str, round: int) -> dict[str, tuple[int, str]]:
    """(rows, content hash) per data table for one round; like Store.table_hashes, attempt columns left out."""
    out = {}
    for table in DATA_TABLES:
        _, desc = store.query(f"DESCRIBE {table}")
        _, rows = store.query(content_hash_sql(table, [r[0] for r in desc], round_filter(table)), [experiment, round])
        out[table] = (int(rows[0][0]), rows[0][1])
    return out


def duplicate_keys(store: Store) -> dict[str, int]:
    """Declared key values (components.tables) held by more than one row, per table (empty when all are unique)."""
    out = {}
    for table, t in TABLES.items():
        key = ", ".join(t.key)
        _, rows = store.query(f"SELECT count(*) FROM (SELECT {key} FROM {table} GROUP BY ALL HAVING count(*) > 1)")
        if rows[0][0]:
            out[table] = int(rows[0][0])
    return out


def runs_by_round(store: Store, experiment: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in store.stage_runs(experiment):
        out[r["round"]].append(r)
    return out


def committed(store_or_runs: Store | list[dict[str, Any]], experiment: str) -> dict[tuple[int, str], dict[str, Any]]:
    runs = store_or_runs.stage_runs(experiment) if isinstance(store_or_runs, Store) else store_or_runs
    return {(r["round"], r["stage"]): r for r in runs if r["status"] == "committed"}


def rows_of(store: Store, stage_run_ids: list[str]) -> int:
    """Data rows still carrying any of these stage runs' ids."""
    if not stage_run_ids:
        return 0
    n = 0
    for table in DATA_TABLES:
        if table == "problems":
            continue  # keyed by content and shared: kept with the id of the attempt that first added it
        _, rows = store.query(f"SELECT count(*) FROM {table} WHERE list_contains(?, stage_run_id)", [stage_run_ids])
        n += int(rows[0][0])
    return n
