"""Launch a stage job as a subprocess, stream its output, and commit what it published.

This is the whole lifecycle of one attempt, in plain Python so it runs (and is tested) without
Prefect: record the attempt as `running`, write the spec, run the job, then either commit its
manifest in one transaction or mark the attempt `failed`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from components import progress, storage
from components.config import ExperimentConfig
from components.jobs import warm
from components.jobs.shards import merge_shards, published, shard_specs
from components.jobs.spec import StageSpec
from components.manifest import MANIFEST, ManifestError
from components.stages import STAGES, build_spec
from components.recipes import get_recipe
from components.store import StageRunRef, Store, StoreError, StoreLockedError

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class StageJobError(RuntimeError):
    """The job failed. `transient` is True when it was killed (signal, OOM, timeout, its worker lost), not when
    it raised. `worker` and `flow_run_id` say where it ran, where a work pool ran it."""

    def __init__(self, message: str, returncode: int | None, transient: bool, worker: str | None = None,
                 flow_run_id: str | None = None):
        super().__init__(message)
        self.returncode = returncode
        self.transient = transient
        self.worker = worker
        self.flow_run_id = flow_run_id


@dataclass
class StageResult:
    stage_run_id: str
    round: int
    stage: str
    attempt: int
    out_dir: str
    metrics: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    rows: dict[str, int] = field(default_factory=dict)


# A job exits with this (EX_TEMPFAIL) when its engine or server failed in a way a retry may not see again.
EXIT_TRANSIENT = 75
VLLM_VENV = REPO_ROOT / ".venv-vllm"


def job_python(cfg: ExperimentConfig | None, stage: str) -> str:
    """The interpreter a stage's job runs under.

    `COEVO_JOB_PYTHON_<STAGE>` wins where set. Otherwise a stage that samples (`Stage.samples`: generate,
    score, evaluate) under `generate.backend: vllm` runs in vLLM's environment, whose fastapi and
    transformers pins clash with Prefect's: `COEVO_VLLM_PYTHON`, else this checkout's `.venv-vllm`
    (`make vllm`) where it exists. Everything else runs under the flow's own interpreter, which is also
    right where vLLM is installed beside the project (a GPU image).
    """
    if python := os.environ.get(f"COEVO_JOB_PYTHON_{stage.upper()}"):
        return python
    if cfg is not None and cfg.generate.backend == "vllm" and STAGES[stage].samples:
        if python := os.environ.get("COEVO_VLLM_PYTHON"):
            return python
        if (VLLM_VENV / "bin" / "python").exists():
            return str(VLLM_VENV / "bin" / "python")
    return sys.executable


def pool_of(cfg: ExperimentConfig, stage: str) -> str | None:
    """The Prefect work pool that runs `stage`'s jobs, or None to run them here as subprocesses.

    `execution.stage_pools[stage]` first, then for a GPU stage (`Stage.gpu`) COEVO_GPU_POOL or
    `execution.gpu_pool`, then COEVO_POOL or `execution.pool`. The name `local` means a subprocess here.
    """
    e = cfg.execution
    pool = os.environ.get("COEVO_POOL") or e.pool
    if STAGES[stage].gpu:
        pool = os.environ.get("COEVO_GPU_POOL") or e.gpu_pool or pool
    pool = e.stage_pools.get(stage, pool)
    return None if pool in (None, "", "local") else pool


def job_command(stage: str, spec_path: str | Path, python: str | None = None) -> list[str]:
    """`python -m components.jobs <stage> --spec …` (see `job_python`). The job imports this checkout
    (PYTHONPATH), so another environment needs only the packages, not an install of the project. A training
    stage whose section sets `processes` > 1 runs under `accelerate launch` (`accelerate_launch_args`)."""
    return [python or job_python(None, stage), *accelerate_launch_args(stage, spec_path),
            "-m", "components.jobs", stage, "--spec", str(spec_path)]


def accelerate_launch_args(stage: str, spec_path: str | Path) -> list[str]:
    """`-m accelerate.commands.launch --num_processes N …` where the spec's config sets the stage's section's
    `processes` (train_policy, train_reward) above 1; [] otherwise, and where the spec is not written yet.

    With CUDA, one process per GPU: `--multi_gpu` (DDP over NCCL), or `--use_fsdp` (FSDP2, the full state dict
    gathered to save, each process loading the whole checkpoint as under DDP). Without CUDA, N CPU processes on
    gloo: accelerate's `--cpu` launcher starts one process (more need mpirun), so torchrun's (`--multi_gpu`)
    starts them, and the trainers, finding no GPU (`use_cpu`), join them on gloo. Port 0: accelerate picks a
    free one. Raises StageJobError (not transient) where the machine cannot run it.
    """
    import json

    stage_def = STAGES.get(stage)
    if stage_def is None or not storage.exists(spec_path):
        return []
    section = (json.loads(storage.read_text(spec_path)).get("config") or {}).get(stage_def.section) or {}
    if not isinstance(section, dict):  # `import` reads `imports`, a list: no stage there trains
        return []
    n, strategy = int(section.get("processes", 1)), section.get("strategy", "ddp")
    if n <= 1:
        return []
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{stage_def.section}.processes={n}"
    if strategy == "fsdp" and not gpus:
        raise StageJobError(f"stage {stage}: {stage_def.section}.strategy=fsdp shards the model over CUDA GPUs, and "
                            "this machine has none; use strategy=ddp (CPU processes on gloo)", None, transient=False)
    if gpus and n > gpus:
        raise StageJobError(f"stage {stage}: {where} needs a CUDA GPU per process; this machine has {gpus}",
                            None, transient=False)
    mode = (["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
             "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_cpu_ram_efficient_loading", "false"]
            if strategy == "fsdp" else ["--multi_gpu"])
    return ["-m", "accelerate.commands.launch", "--num_processes", str(n), *mode, "--num_machines", "1",
            "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no"]


def run_job(stage: str, spec_path: str | Path, log: Callable[[str], None], timeout_s: float,
            on_start: Callable[[int], None] | None = None, python: str | None = None) -> None:
    env = os.environ | {"PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                        "COEVO_JOB_LAUNCHED_AT": repr(time.time())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = job_command(stage, spec_path, python)
    # A job that is a new interpreter (not forked warm: its server must see one environment) gets a temporary
    # folder of its own, removed after it however it ended. In it torchrun makes its log folder (`torchelastic_*`,
    # which it never removes: one was left for every `accelerate launch` job), each process but the first its
    # scratch (components/jobs/__main__.py), which a process killed with its launcher (SIGKILL, past the timeout)
    # cannot remove itself, and whatever a vLLM job's engine leaves there (`vllm serve` left IPC sockets).
    own_tmp = command[0] != sys.executable or "accelerate.commands.launch" in command
    scratch = tempfile.mkdtemp(prefix="coevo-job-") if own_tmp else None
    if scratch:
        env["TMPDIR"] = scratch
    try:
        _run(stage, command, env, log, timeout_s, on_start)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(stage: str, command: list[str], env: dict[str, str], log: Callable[[str], None], timeout_s: float,
         on_start: Callable[[int], None] | None) -> None:
    if command[0] != sys.executable:
        log(f"{stage}: job runs under {command[0]}")
    proc: subprocess.Popen | warm.WarmJob | None = None
    if warm.enabled() and command[0] == sys.executable and command[1:3] == ["-m", "components.jobs"]:
        try:
            proc = warm.WarmJob(command[3:], env, REPO_ROOT)  # forked from the warm server: imports done
        except warm.WarmStartError as e:
            log(f"{stage}: warm start failed ({e}); starting a new interpreter")
    if proc is None:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, env=env, cwd=REPO_ROOT)
    if on_start:
        on_start(proc.pid)
    tail: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail[:] = (tail + [line])[-30:]
            log(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        raise StageJobError(f"stage {stage} timed out after {timeout_s:.0f}s", None, transient=True) from None
    except BaseException:  # the launcher is ending (SIGTERM, Ctrl-C): its job ends with it, not on its own after
        proc.kill()
        proc.wait()
        raise
    reader.join(timeout=30)
    if rc != 0:
        killed = rc < 0 or rc in (137, 143)
        what = (f"was killed by signal {-rc}" if rc < 0 else "failed transiently (exit 75)" if rc == EXIT_TRANSIENT
                else f"exited with code {rc}")
        raise StageJobError(f"stage {stage} job {what}:\n" + "\n".join(tail[-15:]), rc,
                            transient=killed or rc == EXIT_TRANSIENT)


class JobRunner(Protocol):
    """Runs the job of `spec_path` to its end, or raises StageJobError; returns (worker, flow run id): where it
    ran. `local_runner` runs it as a subprocess here; `tasks.pool.PoolRunner` as a flow run on a work pool."""

    def __call__(self, stage: str, spec_path: str, log: Callable[[str], None], timeout_s: float,
                 python: str | None) -> tuple[str, str | None]: ...


def local_runner(stage: str, spec_path: str, log: Callable[[str], None], timeout_s: float,
                 python: str | None) -> tuple[str, str | None]:
    run_job(stage, spec_path, log, timeout_s, python=python)
    return f"local:{socket.gethostname()}", None


# (shard, try, worker, flow run id, status, error, seconds) of each job try, for the store's `stage_jobs`
OnJob = Callable[[int, int, "str | None", "str | None", str, "str | None", float], None]


def execute(cfg: ExperimentConfig, spec: StageSpec, *, runner: JobRunner | None = None,
            log: Callable[[str], None] = print, on_job: OnJob | None = None) -> Path:
    """Run the stage job(s) of `spec` and return the manifest to commit.

    One job, or, where the stage can be sharded (`Stage.merge`) and `execution.shards` > 1, one job per
    shard side by side (`components.jobs.shards`). A shard whose job was killed (a transient failure: signal,
    timeout, lost worker) is retried alone, up to `stage_retries` times; a shard that published is not rerun.
    """
    runner = runner or local_runner
    stage = STAGES[spec.stage]
    python = job_python(cfg, spec.stage)
    shards = cfg.execution.shards if stage.merge is not None else 1

    def run_one(s: StageSpec, tries: int) -> None:
        spec_path = s.out_dir + ".spec.json"  # beside the attempt, in storage: a worker elsewhere reads it
        storage.write_text(spec_path, s.to_json())
        say = log if s.shards == 1 else (lambda line: log(f"[shard{s.shard}] {line}"))
        for t in range(1, tries + 1):
            t0 = time.perf_counter()
            try:
                worker, flow_run_id = runner(s.stage, spec_path, say, cfg.stage_timeout_s, python)
            except StageJobError as e:
                if on_job:
                    on_job(s.shard, t, e.worker, e.flow_run_id, "failed", str(e), time.perf_counter() - t0)
                if not e.transient or t == tries:
                    raise
                log(f"{s.job_id}: {str(e).splitlines()[0]}; retrying this shard alone (try {t + 1} of {tries})")
                continue
            if on_job:
                on_job(s.shard, t, worker, flow_run_id, "published", None, time.perf_counter() - t0)
            return

    if shards == 1:
        run_one(spec, 1)  # its retries are new attempts (the Prefect task's)
        return storage.fetch(spec.out_dir) / MANIFEST
    parts = shard_specs(spec, stage, cfg.seed, shards)
    todo = [s for s in parts if published(s) is None]
    log(f"{spec.stage_run_id}: {shards} shards" + (f", {shards - len(todo)} already published" if len(todo) < shards
                                                   else ""))
    failed: list[tuple[StageSpec, StageJobError]] = []
    with ThreadPoolExecutor(max_workers=max(len(todo), 1), thread_name_prefix="shard") as pool:
        # Each shard's thread runs in a copy of this context: Prefect's settings (its API URL) and run
        # context reach the pool runner's client there as they do here.
        futures = {pool.submit(contextvars.copy_context().run, run_one, s, 1 + cfg.stage_retries): s for s in todo}
        for f in as_completed(futures):
            try:
                f.result()
            except StageJobError as e:
                failed.append((futures[f], e))
    if failed:
        s, e = min(failed, key=lambda x: x[0].shard)
        raise StageJobError(f"{spec.stage_run_id}: shard(s) {sorted(x[0].shard for x in failed)} of {shards} failed; "
                            f"shard {s.shard}: {e}", e.returncode, transient=False)
    return merge_shards(spec, stage, parts)


def run_stage_attempt(cfg: ExperimentConfig, store: Store, round: int, stage: str, *, code_version: str | None,
                      log: Callable[[str], None] = print, task_run_id: str | None = None,
                      runner: JobRunner | None = None) -> StageResult:
    """Run one new attempt of a stage and commit it. Raises StageJobError/ManifestError on failure."""
    attempt = store.next_attempt(cfg.experiment, round, stage)
    ref = StageRunRef(cfg.experiment, round, stage, attempt)
    spec = build_spec(cfg, store, round, stage, attempt, code_version)
    out_dir = spec.out_dir
    storage.check(cfg.storage_dir)  # refused or missing credentials fail here, before the attempt is recorded
    store.start_stage_run(ref, out_dir, spec.to_json(), spec.config_hash, spec.seed, task_run_id)
    t0 = time.perf_counter()
    log(f"{ref.stage_run_id}: starting job (seed {spec.seed})")

    def job_log(line: str) -> None:
        log(line)
        progress.stage_line(ref.stage_run_id, line)

    lock = threading.Lock()  # shards finish on their own threads; the store takes one writer at a time

    def on_job(shard: int, try_: int, worker: str | None, flow_run_id: str | None, status: str, error: str | None,
               seconds: float) -> None:
        with lock:
            store.record_job(ref.stage_run_id, shard, try_, worker, flow_run_id, status, error, seconds)

    stages = get_recipe(cfg.recipe).round_stages(round, cfg)
    later = stages[stages.index(stage) + 1:] if stage in stages else []
    progress.stage_started(ref.stage_run_id)
    ok = False
    try:
        manifest_path = execute(cfg, spec, runner=runner, log=job_log, on_job=on_job)
        # The job's output is published: a busy store delays its commit, it never throws the job away.
        manifest = when_store_free(lambda: store.commit(ref, manifest_path, later_stages=later), log,
                                   f"{ref.stage_run_id}: commit")
        ok = True
    except (StageJobError, ManifestError, StoreError) as e:
        when_store_free(lambda: store.fail_stage_run(ref, str(e)), log, f"{ref.stage_run_id}: recording the failure")
        raise
    except BaseException as e:  # KeyboardInterrupt, cancellation: never leave `running` behind
        store.fail_stage_run(ref, f"interrupted: {type(e).__name__}: {e}")
        raise
    finally:
        progress.stage_finished(ref.stage_run_id, ok)
    dt = time.perf_counter() - t0
    log(f"{ref.stage_run_id}: committed in {dt:.1f}s " + ", ".join(f"{o['table']}={o['rows']}" for o in manifest.outputs))
    return StageResult(ref.stage_run_id, round, stage, attempt, out_dir, dict(manifest.metrics), dt,
                       {o["table"]: o["rows"] for o in manifest.outputs})


# How long a finished job waits for a busy store (a reader or another writer holding it) before its commit
# fails; each try already waits `Store.lock_timeout_s`.
STORE_BUSY_TRIES = 10


def when_store_free(write: Callable[[], T], log: Callable[[str], None], what: str) -> T:
    """`write()`, tried again while the store is locked by another process: a transient fault, not a failed job."""
    for t in range(1, STORE_BUSY_TRIES + 1):
        try:
            return write()
        except StoreLockedError as e:
            if t == STORE_BUSY_TRIES:
                raise
            log(f"{what}: the store is busy ({e}); trying again ({t + 1} of {STORE_BUSY_TRIES})")
    raise AssertionError("unreachable")


def content_hashes(out_dir: Path) -> dict[str, str]:
    """Per-table hash of a published attempt's rows, plus each artifact's sha256.

    Paths that name the attempt (a model's `uri`) are left out: they say where, not what; so are the columns
    that time the work (a turn's `latency_s`). Model ids are read without their `/a<attempt>`, as the store's
    content hashes read them (`components.store.content_hash_sql`).
    """
    import hashlib
    import json
    import re

    import pyarrow as pa
    import pyarrow.parquet as pq

    from components.manifest import read_manifest
    from components.store import ATTEMPT_SUFFIX, NOT_CONTENT

    m = read_manifest(out_dir / MANIFEST)
    out: dict[str, str] = {}
    for table in sorted({o["table"] for o in m.outputs}):
        data = pa.concat_tables([pq.read_table(p) for p in m.output_paths(out_dir, table)])
        rows = [{k: re.sub(ATTEMPT_SUFFIX, "", v) if k.endswith("model_id") and isinstance(v, str) else v
                 for k, v in row.items() if k not in NOT_CONTENT} for row in data.to_pylist()]
        out[f"table:{table}"] = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
    for a in m.artifacts:
        out[f"artifact:{a['name']}"] = a["sha256"]
    return out


def reproduce_stage(cfg: ExperimentConfig, store: Store, round: int, stage: str, *, code_version: str | None,
                    log: Callable[[str], None] = print) -> dict[str, tuple[str, str]]:
    """Rerun a committed stage into a scratch attempt (never committed) and pair up content hashes. Its inputs
    are read as the store held them when the attempt committed (its snapshot), so a later rerun upstream does
    not change what is reproduced; an attempt committed before the store kept snapshots reads today's."""
    import shutil

    committed = store.committed_run(cfg.experiment, round, stage)
    if committed is None:
        raise StoreError(f"{cfg.experiment} round {round} stage {stage} has no committed attempt to reproduce")
    with contextlib.suppress(StoreError):
        store = store.at(committed["stage_run_id"])
    scratch = cfg.experiment_dir / "scratch" / f"r{round}" / stage / f"a{committed['attempt']}"
    for old in [scratch, *scratch.parent.glob(f"{scratch.name}.shard*")]:
        if old.is_dir():
            shutil.rmtree(old)
    spec = build_spec(cfg, store, round, stage, committed["attempt"], code_version, out_dir=scratch)
    execute(cfg, spec, log=log)
    a, b = content_hashes(storage.fetch(committed["out_dir"])), content_hashes(storage.local(scratch))
    return {k: (a.get(k, ""), b.get(k, "")) for k in sorted(set(a) | set(b))}


def evaluate_model_job(cfg: ExperimentConfig, model: str, name: str, *, code_version: str | None,
                       log: Callable[[str], None] = print) -> tuple[Path, dict[str, float]]:
    """Evaluate any model (HF name or local path) on the config's held-out sets, outside any round.

    The same `evaluate` job as in a round, in its own process; its Parquet and manifest go to
    `workdir/<experiment>/evals/<name>/a<k>/`. Nothing is committed to the store: the store holds
    rounds, and this model belongs to none.
    """
    import re

    from components.jobs.spec import StageSpec
    from components.manifest import read_manifest
    from components.seeding import derive_seed

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "model"
    base = cfg.experiment_dir / "evals" / slug
    attempt = 1 + max([int(p.name[1:]) for p in base.glob("a*") if p.name[1:].isdigit()], default=0)
    out_dir = base / f"a{attempt}"
    base.mkdir(parents=True, exist_ok=True)
    spec = StageSpec(experiment=cfg.experiment, round=0, stage="evaluate", attempt=attempt, out_dir=str(out_dir),
                     seed=derive_seed(cfg.seed, 0, "evaluate"), config=cfg.to_dict(), config_hash=cfg.config_hash(),
                     code_version=code_version, params={"policy_uri": model, "policy_model_id": f"external:{name}"})
    spec_path = base / f"a{attempt}.spec.json"
    spec_path.write_text(spec.to_json())
    log(f"evaluating {model} into {out_dir}")
    run_job("evaluate", spec_path, log, cfg.stage_timeout_s, python=job_python(cfg, "evaluate"))
    return out_dir, dict(read_manifest(out_dir / MANIFEST).metrics)
