"""Stage jobs on a Prefect work pool, sharded across two real process workers, one of them killed.

A Prefect server on 127.0.0.1 (the session's `prefect_server`), a `process` work pool, and two
`prefect worker start --limit 1` processes. A small micro experiment (1 round, `execution.shards=2`)
runs twice:

- `local`: as local subprocesses, the default placement, in the local workdir;
- `killed`: through the pool, with every spec, part, manifest, heartbeat and checkpoint in an S3 bucket
  (moto's server on 127.0.0.1, `s3_endpoint`). Each worker and the flow have a cache of their own, as
  on three machines, so whatever one reads of another's it fetched from the bucket. While a `generate`
  shard runs, its worker is SIGKILLed with every process under it (a node that dies). Its flow run,
  forked from the worker's warm server (`flows/warm_engine.py`), and that server end with it. Its
  heartbeat stops, the orchestrator marks the flow run Crashed and retries that shard alone on the
  worker that is left.

Both must give the same store content, table by table: for a fixed number of shards, neither where
the jobs ran nor the kill changes what the experiment holds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from components.store import Store
from tests.conftest import REPO, TELEMETRY_OFF

pytestmark = pytest.mark.slow

POOL = "coevo-test-pool"
WORKERS = ("worker-a", "worker-b")
# Small enough that a run through the pool takes about a minute; the stages are micro's. A generate shard
# samples for about a second, for the kill to land in it.
SMALL = ["rounds=1", "execution.shards=2", "execution.heartbeat_timeout_s=10",
         "execution.worker_timeout_s=90", "stage_retries=2", "bootstrap.steps=80", "bootstrap.problems_per_level=150",
         "generate.problems_per_level=12", "generate.samples_per_problem=24", "train_policy.steps=20",
         "evaluate.problems_per_level=12", "tracking.enabled=false"]


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _worker_env(s3_env: dict[str, str], cache: Path, tmp: Path) -> dict[str, str]:
    # This interpreter's folder first on PATH, as in an activated environment: flow runs start as
    # `python -m flows.warm_engine` (execution.warm_workers). A TMPDIR of its own: a worker killed leaves its
    # runner's `runner_storage/<uuid>` folder and its warm server's socket folder there, not in /tmp.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return os.environ | TELEMETRY_OFF | s3_env | {
        "PREFECT_API_URL": _api_url(), "PYTHONPATH": str(REPO), "COEVO_TORCH_THREADS": "1", "PATH": path,
        "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "0",
        "PREFECT_LOGGING_LEVEL": "INFO", "COEVO_CACHE_DIR": str(cache), "TMPDIR": str(tmp)}


@pytest.fixture(scope="module")
def workers(prefect_server, s3_endpoint, tmp_path_factory):
    """The pool and its two workers, each running one flow run at a time; stopped at the end."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
    logs = tmp_path_factory.mktemp("workers")
    tmp = Path(tempfile.mkdtemp(prefix="coevo-pool-"))  # short: a warm server's socket path must fit in 108 bytes
    procs = {}
    for name in WORKERS:
        (tmp / name).mkdir()
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process", "--limit", "1",
             "--name", name], env=_worker_env(s3_endpoint.env(), logs / f"{name}-cache", tmp / name), cwd=REPO,
            stdout=open(logs / f"{name}.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_online(set(WORKERS))
        yield procs, logs
    finally:
        for p in procs.values():
            _kill_tree(p.pid)
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_online(names: set[str], timeout_s: float = 90) -> None:
    from prefect.client.orchestration import get_client

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with get_client(sync_client=True) as client:
            online = {w.name for w in client.read_workers_for_work_pool(POOL) if w.status.value == "ONLINE"}
        if names <= online:
            return
        time.sleep(1)
    raise AssertionError(f"workers {sorted(names)} did not come online in {timeout_s}s (online: {sorted(online)})")


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and everything under it, as when its node dies."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def _processes_of(worker: str, within_s: float) -> list[str]:
    """The processes still running for `worker` (its flow runs and its warm server, forked outside its process
    tree, carry its name in their environment) once `within_s` has passed or none is left."""
    t0 = time.monotonic()
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("PREFECT__WORKER_NAME") == worker:
                    left.append(f"{p.pid}: {' '.join(p.cmdline())}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if not left or time.monotonic() - t0 > within_s:
            return left
        time.sleep(0.1)


def _run(workdir: Path, *overrides: str) -> None:
    from flows.evolution import self_evolution

    self_evolution(config_path=str(REPO / "configs" / "micro.yaml"),
                   overrides=[f"workdir={workdir}", "experiment=pool", *SMALL, *overrides])


STORAGE = "pool-run"  # the killed run's prefix in the bucket


@pytest.fixture(scope="module")
def runs(workers, s3_endpoint, tmp_path_factory):
    from components import storage

    procs, logs = workers
    local = tmp_path_factory.mktemp("local")
    _run(local)
    killed = tmp_path_factory.mktemp("killed")
    victim: dict = {}
    fs = s3_endpoint.fs()

    def kill_a_generate_shard() -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600 and not victim:
            for beat in fs.glob(f"{s3_endpoint.bucket}/{STORAGE}/pool/r1/generate/a*.shard*.spec.json.heartbeat"):
                body = json.loads(fs.cat_file(beat) or b"{}")
                if body.get("status") == "running" and time.time() - body["time"] < 3:  # mid-shard
                    victim.update(worker=body["worker"], shard=beat.rsplit("/", 1)[-1].split(".")[1],
                                  pids=_kill_tree(procs[body["worker"]].pid))
                    victim["survivors"] = _processes_of(body["worker"], within_s=5)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_generate_shard, daemon=True)
    killer.start()
    with pytest.MonkeyPatch.context() as mp:  # the flow's credentials and cache: this process is the orchestrator
        for k, v in s3_endpoint.env().items():
            mp.setenv(k, v)
        mp.setenv("COEVO_CACHE_DIR", str(logs / "flow-cache"))
        storage._fs.cache_clear()
        try:
            _run(killed, f"execution.pool={POOL}", f"execution.storage=s3://{s3_endpoint.bucket}/{STORAGE}")
        finally:
            storage._fs.cache_clear()
    killer.join(timeout=5)
    return local, killed, victim, logs


def _jobs(workdir: Path, stage: str, round: int = 1) -> list[dict]:
    store = Store(workdir / "store")
    run = store.committed_run("pool", round, stage)
    assert run is not None, f"round {round} {stage} was not committed in {workdir}"
    return store.stage_jobs(run["stage_run_id"])


def test_every_job_ran_on_the_pool_and_shards_on_both_workers(runs):
    local, killed, _, logs = runs
    stages = [(0, "bootstrap"), (0, "evaluate"), (1, "generate"), (1, "verify"), (1, "score"), (1, "filter"),
              (1, "train_policy"), (1, "evaluate")]
    for round, stage in stages:
        jobs = _jobs(killed, stage, round)
        sharded = stage in ("evaluate", "generate", "verify", "score")
        assert sorted({j["shard"] for j in jobs}) == ([0, 1] if sharded else [0]), f"{stage}: {jobs}"
        assert all(j["worker"] in WORKERS and j["flow_run_id"] for j in jobs), f"{stage} did not run on the pool: {jobs}"
        assert all(j["worker"].startswith("local:") and j["flow_run_id"] is None
                   for j in _jobs(local, stage, round)), f"{stage} of the local run left this machine"
    before_the_kill = {j["worker"] for j in _jobs(killed, "evaluate", 0)}
    assert before_the_kill == set(WORKERS), f"round 0's shards ran on {sorted(before_the_kill)}; worker logs: {logs}"


def test_a_killed_worker_s_shard_is_retried_alone(runs):
    _, killed, victim, _ = runs
    assert victim, "the test never saw a generate shard running, so it killed nothing"
    jobs = _jobs(killed, "generate")
    shard = int(victim["shard"].removeprefix("shard"))
    mine = [j for j in jobs if j["shard"] == shard]
    other = [j for j in jobs if j["shard"] != shard]
    assert [(j["try"], j["status"]) for j in mine] == [(1, "failed"), (2, "published")], mine
    assert mine[0]["worker"] == victim["worker"] and "heartbeat" in mine[0]["error"], mine[0]
    assert mine[1]["worker"] != victim["worker"], f"the retry ran on the dead worker: {mine[1]}"
    assert [(j["try"], j["status"]) for j in other] == [(1, "published")], f"the other shard was rerun: {other}"


def test_the_pool_run_s_outputs_lie_in_the_bucket_and_no_credential_in_the_store(runs, s3_endpoint):
    _, killed, _, logs = runs
    store = Store(killed / "store")
    prefix = f"s3://{s3_endpoint.bucket}/{STORAGE}/pool/"
    assert all(r["out_dir"].startswith(prefix) for r in store.stage_runs("pool")), store.stage_runs("pool")
    assert store.committed_model("pool", 1)["uri"] == prefix + "r1/train_policy/a1/model"
    keys = s3_endpoint.fs().find(f"{s3_endpoint.bucket}/{STORAGE}/pool/r1/generate")
    assert any(k.endswith("a1.shard0/manifest.json") for k in keys) and any(k.endswith("a1/manifest.json") for k in keys)
    local_rounds = sorted(p.name for p in (killed / "pool").glob("r*"))
    assert local_rounds == [], f"stage outputs were written to the orchestrator's workdir: {local_rounds}"
    for name in (*WORKERS, "flow"):  # three machines' caches, each filled from the bucket
        assert any((logs / f"{name}-cache").rglob("manifest.json")), f"{name} never fetched nor wrote a manifest"
    store_files = [p for p in (killed / "store").rglob("*") if p.is_file()]
    assert store_files and not [p for p in store_files if s3_endpoint.secret in p.read_bytes().decode("latin-1")]


def test_flow_runs_fork_from_their_worker_s_warm_server_and_die_with_the_worker(runs):
    """Every flow run of the pool started as `python -m flows.warm_engine` and was forked from its worker's
    server, none as a new interpreter; the killed worker's job and server ended with it."""
    _, killed, victim, logs = runs
    store = Store(killed / "store")
    jobs = [j for r in store.stage_runs("pool") for j in store.stage_jobs(r["stage_run_id"])]
    text = "".join((logs / f"{name}.log").read_text() for name in WORKERS)
    forked = text.count("coevo: flow run forked from the worker's warm server")
    assert "as a new interpreter" not in text, [line for line in text.splitlines() if "new interpreter" in line]
    assert forked == len(jobs), f"{forked} warm flow runs for {len(jobs)} pool jobs"
    assert victim.get("survivors") == [], f"still running after its worker was killed: {victim}"


def test_the_killed_pool_run_has_the_local_run_s_content(runs):
    local, killed, _, _ = runs
    a = Store(local / "store").table_hashes("pool")
    b = Store(killed / "store").table_hashes("pool")
    assert a["trajectories"][0] > 0 and a["evaluations"][0] > 0, a
    assert a == b, {t: (a[t], b[t]) for t in a if a[t] != b[t]}


# -- bad input: a clear error, and nothing committed --------------------------------------------------

def _bootstrap_on(pool: str, tmp_path: Path, *overrides: str):
    from components.config import load_config
    from components.jobs.launch import run_stage_attempt
    from tasks.pool import PoolRunner

    cfg = load_config(REPO / "configs" / "micro.yaml", [f"workdir={tmp_path}", *overrides])
    store = Store.for_config(cfg)
    try:
        run_stage_attempt(cfg, store, 0, "bootstrap", code_version=None, log=lambda _: None,
                          runner=PoolRunner(cfg, pool))
    except Exception as e:
        runs = store.stage_runs(cfg.experiment)
        assert [r["status"] for r in runs] == ["failed"] and store.committed_run(cfg.experiment, 0, "bootstrap") is None
        assert not (tmp_path / "micro" / "r0" / "bootstrap" / "a1").exists(), "a failed attempt published"
        return e
    raise AssertionError(f"bootstrap on pool {pool!r} did not fail")


def test_an_unknown_pool_is_named(prefect_server, tmp_path):
    err = _bootstrap_on("no-such-pool", tmp_path)
    assert "unknown work pool 'no-such-pool'" in str(err) and "prefect work-pool create" in str(err), err


def test_a_pool_no_worker_polls_fails_naming_the_pool_and_the_timeout(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="coevo-idle-pool", type="process"), overwrite=True)
    t0 = time.monotonic()
    err = _bootstrap_on("coevo-idle-pool", tmp_path, "execution.worker_timeout_s=3")
    assert time.monotonic() - t0 < 60
    assert "no worker of work pool 'coevo-idle-pool'" in str(err) and "worker_timeout_s=3s" in str(err), err
    with get_client(sync_client=True) as client:  # the waiting flow run was cancelled, not left for a worker
        runs = client.read_flow_runs()
        mine = [r for r in runs if r.name == "micro/r0/bootstrap/a1" and r.state and r.state.type.value != "COMPLETED"]
        assert mine and all(r.state.type.value == "CANCELLED" for r in mine), [(r.name, r.state) for r in mine]
