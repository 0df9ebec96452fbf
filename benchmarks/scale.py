"""Past one machine, measured: two workers against one, and where a round's time goes.

    .venv/bin/python benchmarks/scale.py --workdir /tmp/scale
    .venv/bin/python benchmarks/scale.py --workdir /tmp/scale --report-only

It runs configs/arith.yaml (the embedded default) as local subprocesses twice: `scale`, one round with
`execution.shards=2` and one torch thread per job, and `scale-default`, two rounds as shipped. Then:

1. **Workers.** `scale`'s round 1 `generate` and `score` again, as new attempts of the same stages, on a
   `process` work pool served first by one worker, then by two (each `--limit 1`, one torch thread per
   job: a worker is one core here, one GPU on a cluster). The two arms run side by side in this one run;
   both must commit the same content (the same shards, the same seeds). Each arm runs `--reps` times
   (3), and the ratio is median wall(1 worker) / median wall(2 workers). Goal: at least 1.6. Before
   each arm, every worker has run an untimed `score` attempt: a worker's first flow run starts its warm
   server (`flows/warm_engine.py`), a cost it pays once, as it pays its own start-up, and later flow
   runs fork from it.
2. **Overhead.** Round 1 of `scale-default`, stage by stage, from the store:
   - `body`: the job's own work (`manifest.timings.total_s`: the stage's function and its writes, model
     loads included);
   - `start`: the job process's start-up before the body (interpreter, imports, spec: `startup_s`);
   - `job`: the job as the flow saw it (`stage_jobs.duration_s`), so `job - body - start` is process exit
     and output streaming;
   - `flow`: the rest of the round's wall time: planning, commit, Prefect and MLflow calls, and the gaps
     between stages, up to round 2's first stage.
   Orchestration overhead = everything but `body`, as a share of the round's wall time. Goal: at most 10%.

A Prefect server for the pool arms is started for the workdir (`coevo server up`'s code) and stopped at
the end, with the workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
for _k, _v in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "MLFLOW_ENABLE_TELEMETRY": "false",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)  # no outside calls, as `make` runs it

EXPERIMENT = "scale"
DEFAULT = "scale-default"
POOL = "coevo-bench"
BASE = ["rounds=1", "execution.shards=2", f"experiment={EXPERIMENT}"]


def _env(**extra: str) -> dict[str, str]:
    # This interpreter's folder first on PATH, as an activated environment has it: a worker's flow runs
    # start as `python -m flows.warm_engine` (execution.warm_workers).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return os.environ | {"PYTHONPATH": str(REPO), "COEVO_TORCH_THREADS": "1", "PATH": path, **extra}


def local_run(workdir: Path, experiment: str, overrides: list[str], last_round: int, **env: str) -> None:
    """An experiment as local subprocesses, Prefect's ephemeral server under the workdir; skipped if done."""
    from components.store import Store

    if Store(workdir / "store").committed_run(experiment, last_round, "evaluate"):
        return
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", "configs/arith.yaml",
           *[a for o in [*overrides, f"workdir={workdir}"] for a in ("--set", o)]]
    with open(workdir / f"{experiment}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=_env(PREFECT_HOME=str(workdir / ".prefect"), **env), stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    print(f"{experiment}: {time.perf_counter() - t0:.0f}s")


def pool_arms(workdir: Path, reps: int = 3) -> dict[str, list[float]]:
    """Round 1's generate + score on the pool, `reps` times with 1 worker, then with 2; the wall times."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from components import servers
    from components.config import load_config
    from components.jobs.launch import run_stage_attempt
    from components.store import Store
    from tasks.pool import PoolRunner

    info = servers.up(workdir, prefect_port=servers.free_port(), mlflow_port=servers.free_port())["prefect"]
    workers: list[subprocess.Popen] = []
    walls: dict[str, list[float]] = {}
    try:
        with temporary_settings({PREFECT_API_URL: info.api_url}):
            with get_client(sync_client=True) as client:
                client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
            cfg = load_config(REPO / "configs" / "arith.yaml", [*BASE, f"workdir={workdir}", f"execution.pool={POOL}"])
            store = Store.for_config(cfg)
            for n in (1, 2):
                while len(workers) < n:
                    name = f"bench-worker-{len(workers)}"
                    log = open(workdir / f"{name}.log", "w")
                    workers.append(subprocess.Popen(
                        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process",
                         "--limit", "1", "--name", name], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                        env=_env(PREFECT_API_URL=info.api_url, PREFECT_WORKER_QUERY_SECONDS="0.5",
                                 PREFECT_WORKER_PREFETCH_SECONDS="0"), start_new_session=True))
                _wait_online(n)
                _warm_up(cfg, store, n)
                key = f"{n} worker{'s' if n > 1 else ''}"
                walls[key] = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for stage in ("generate", "score"):
                        r = run_stage_attempt(cfg, store, 1, stage, code_version=None, runner=PoolRunner(cfg, POOL),
                                              log=lambda line: None)
                        print(f"  {n} worker(s): {r.stage_run_id} in {time.perf_counter() - t0:.1f}s")
                    walls[key].append(time.perf_counter() - t0)
    finally:
        for w in workers:
            w.kill()
        servers.down(workdir)
    return walls


def _warm_up(cfg, store, n: int) -> None:
    """Untimed `score` attempts until each of the n workers has run a flow run, which starts its warm server
    (flows/warm_engine.py): a worker's one-time cost, as its own start-up is, not a shard's."""
    from components.jobs.launch import run_stage_attempt
    from tasks.pool import PoolRunner

    seen: set[str] = set()
    for _ in range(4):
        t0 = time.perf_counter()
        r = run_stage_attempt(cfg, store, 1, "score", code_version=None, runner=PoolRunner(cfg, POOL),
                              log=lambda line: None)
        ran = {j["worker"] for j in store.stage_jobs(r.stage_run_id)}
        seen |= ran
        print(f"  warm-up {r.stage_run_id} on {sorted(ran)} in {time.perf_counter() - t0:.1f}s")
        if len(seen) >= n:
            return
    raise SystemExit(f"the warm-up never ran on all {n} workers: only on {sorted(seen)}")


def _wait_online(n: int, timeout_s: float = 120) -> None:
    from prefect.client.orchestration import get_client

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with get_client(sync_client=True) as client:
            if sum(w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(POOL)) >= n:
                return
        time.sleep(1)
    raise SystemExit(f"{n} worker(s) of {POOL} did not come online in {timeout_s}s")


def same_content(workdir: Path) -> bool:
    """Every attempt of round 1's generate and score (local, 1 worker, 2 workers) published the same rows."""
    from components.jobs.launch import content_hashes
    from components.store import Store

    store = Store(workdir / "store")
    ok = True
    for stage in ("generate", "score"):
        runs = [r for r in store.stage_runs(EXPERIMENT) if r["round"] == 1 and r["stage"] == stage
                and r["status"] in ("committed", "superseded")]
        hashes = {r["stage_run_id"]: content_hashes(Path(r["out_dir"])) for r in runs}
        same = len({json.dumps(h, sort_keys=True) for h in hashes.values()}) == 1
        print(f"  {stage}: {len(runs)} attempts, content {'identical' if same else 'DIFFERS'}")
        ok &= same and len(runs) >= 3
    return ok


def overhead(workdir: Path) -> dict[str, float]:
    """Round 1 of the default run, stage by stage."""
    from components.manifest import read_manifest
    from components.store import Store

    store = Store(workdir / "store")
    runs = [r for r in store.stage_runs(DEFAULT) if r["attempt"] == 1]
    r1 = [r for r in runs if r["round"] == 1]
    end = min(r["started_at"] for r in runs if r["round"] == 2)
    wall = (end - r1[0]["started_at"]).total_seconds()
    rows, total = [], {"body": 0.0, "start": 0.0, "job": 0.0}
    for r in r1:
        m = read_manifest(Path(r["out_dir"]) / "manifest.json")
        jobs = [j for j in store.stage_jobs(r["stage_run_id"]) if j["status"] == "published"]
        if "shards" in m.inputs:  # side by side: the longest shard is the stage's time
            shard_ms = [read_manifest(Path(r["out_dir"] + f".shard{k}") / "manifest.json") for k in range(len(jobs))]
            body = max(s.timings["total_s"] for s in shard_ms)
            start = max(s.timings.get("startup_s", 0.0) for s in shard_ms)
        else:
            body, start = m.timings["total_s"], m.timings.get("startup_s", 0.0)
        job = max(j["duration_s"] for j in jobs)
        stage_wall = (r["finished_at"] - r["started_at"]).total_seconds()
        rows.append((r["stage"], stage_wall, job, start, body))
        total["body"] += body
        total["start"] += start
        total["job"] += job
    print(f"\nround 1 of configs/arith.yaml as shipped, local subprocesses: wall {wall:.1f}s")
    print(f"  {'stage':<13} {'wall':>6} {'job':>6} {'start':>6} {'body':>6}")
    for stage, w, j, s, b in rows:
        print(f"  {stage:<13} {w:6.1f} {j:6.1f} {s:6.1f} {b:6.1f}")
    flow = wall - total["job"]
    print(f"  bodies {total['body']:.1f}s, job start-up {total['start']:.1f}s, job exit and streaming "
          f"{total['job'] - total['body'] - total['start']:.1f}s, flow (plan, commit, Prefect, MLflow, gaps) {flow:.1f}s")
    return {"wall": wall, **total, "flow": flow, "overhead": (wall - total["body"]) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/coevo-scale"))
    ap.add_argument("--report-only", action="store_true", help="Print the figures of an earlier run.")
    ap.add_argument("--reps", type=int, default=3, help="Times each pool arm runs; the ratio is of the medians.")
    args = ap.parse_args()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    walls_file = workdir / "walls.json"
    if not args.report_only:
        local_run(workdir, EXPERIMENT, BASE, 1)
        # As shipped: all cores for each job (COEVO_TORCH_THREADS=0, torch's default), one job at a time.
        local_run(workdir, DEFAULT, ["rounds=2", f"experiment={DEFAULT}"], 2, COEVO_TORCH_THREADS="0")
        walls_file.write_text(json.dumps(pool_arms(workdir, args.reps)))
    walls = {k: v if isinstance(v, list) else [v] for k, v in json.loads(walls_file.read_text()).items()}
    print("\nround 1 generate + score on a process work pool, 2 shards:")
    same = same_content(workdir)
    for k, v in walls.items():
        print(f"  {k}: median {statistics.median(v):.1f}s of {', '.join(f'{x:.1f}' for x in v)}")
    o = overhead(workdir)
    ratio = statistics.median(walls["1 worker"]) / statistics.median(walls["2 workers"])
    pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(walls["1 worker"], walls["2 workers"]))
    print(f"\nworkers: 1 -> 2 speeds generate + score up {ratio:.2f}x, median over median (goal >= 1.6; "
          f"rep by rep {pairs}); content identical: {same}")
    print(f"orchestration overhead: {o['overhead']:.0%} of round 1's {o['wall']:.0f}s is outside the job bodies "
          f"(goal <= 10%)")


if __name__ == "__main__":
    main()
