"""Stage jobs on a Prefect work pool: `PoolRunner` is a `components.jobs.launch.JobRunner`.

Each job becomes a flow run of the deployment `stage_job/<pool>` (`flows/stage_job.py`, created here on
first use), which a worker of the pool picks up and runs in its environment. This process waits for
the run and tells its endings apart:

- no worker picked it up within `execution.worker_timeout_s`: the run is cancelled and the stage fails,
  naming the pool (not retried: a retry would wait the same way);
- a worker took it (Pending) but its process never started within that time: the worker died in
  between; the run is marked Crashed and the job is retried;
- its heartbeat file (beside the spec, on shared storage) went quiet for `execution.heartbeat_timeout_s`:
  its worker died; the run is marked Crashed and the job is a transient failure, which is retried;
- it ended: Completed means the job published its manifest, which the caller verifies and commits;
  Failed carries the job's own verdict (transient or not) from the heartbeat file.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Crashed

from components import storage
from components.config import ExperimentConfig
from components.jobs.launch import StageJobError

FLOW = "stage_job"
ENTRYPOINT = "flows.stage_job.stage_job"  # a module path: the worker imports the installed project
POLL_S = 0.1  # the heartbeat file, on a shared path
POLL_REMOTE_S = 0.5  # the heartbeat file, in a bucket: a GET each
STATE_EVERY_S = 1.0  # the flow run's state, from the Prefect server
# A process worker's flow run, forked from the worker's warm server (flows/warm_engine.py). `python` is the
# worker's PATH's, as in Prefect's own `command` examples: start the worker in the project's environment.
WARM_COMMAND = "python -m flows.warm_engine"


class QuickRetry(httpx.HTTPTransport):
    """Retries a 503 at once, then after 0.05, 0.1, 0.2 and 0.4 s, before Prefect's client sees it.

    A Prefect server on SQLite answers 503 when a write of ours collides with one of its own or a worker's
    (SQLITE_BUSY), and the write was rolled back. Prefect's client would retry it after 2 s, every time;
    on a small stage that is a shard's whole body (`docs/scale-out.md`). A 503 that outlasts these goes on
    to the client's own retries, as before."""

    BACKOFF_S = (0.0, 0.05, 0.1, 0.2, 0.4)

    def __init__(self) -> None:
        import ssl

        import certifi
        from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

        # TLS as Prefect's client sets it up for its own transport (prefect/client/orchestration)
        if PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():
            verify = ssl.create_default_context()
            verify.check_hostname = False
            verify.verify_mode = ssl.CERT_NONE
        else:
            verify = ssl.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
        super().__init__(retries=3, verify=verify)  # and its connection retries

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        for wait in self.BACKOFF_S:
            if response.status_code != 503:
                break
            response.read()
            response.close()
            time.sleep(wait)
            response = super().handle_request(request)
        return response


def _client():
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # Prefect's ephemeral server, in this process: no HTTP (nor any worker)
        return get_client(sync_client=True)
    return get_client(sync_client=True, httpx_settings={"transport": QuickRetry()})


class PoolError(StageJobError):
    """The pool cannot run the job: it does not exist, or no worker polls it."""

    def __init__(self, message: str):
        super().__init__(message, None, transient=False)


def ensure_deployment(client, pool: str, warm: bool = True) -> UUID:
    """The pool's `stage_job` deployment, created (or updated) on first use; an unknown pool is an error.

    On a `process` pool, `warm` has the worker start each flow run with `WARM_COMMAND`, forked from a
    server of the worker's that imported Prefect and torch once, instead of `python -m prefect.engine`."""
    try:
        work_pool = client.read_work_pool(pool)
    except ObjectNotFound:
        raise PoolError(f"unknown work pool {pool!r} (execution.pool / COEVO_POOL): create it with "
                        f"`prefect work-pool create {pool} --type process`, or see infra/k8s-stage-job.yaml") from None
    flow_id = client.create_flow_from_name(FLOW)
    # The flow run's process is the job's (flows/stage_job.py), so it gets a job's environment (`run_job`).
    env = {"PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    job_variables: dict = {"env": env}
    if warm and work_pool.type == "process":
        job_variables["command"] = WARM_COMMAND
    return client.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool, entrypoint=ENTRYPOINT,
                                    tags=["coevo"], enforce_parameter_schema=False, pull_steps=[],
                                    job_variables=job_variables,
                                    description="One coevo stage job: python -m components.jobs <stage> --spec <spec>")


class PoolRunner:
    """Run stage jobs as flow runs on `pool` (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig, pool: str):
        self.pool = pool
        self.worker_timeout_s = cfg.execution.worker_timeout_s
        self.heartbeat_timeout_s = cfg.execution.heartbeat_timeout_s
        self.warm = cfg.execution.warm_workers
        self._deployment_id: UUID | None = None
        # The shards of one attempt call this from threads at once. Their writes to the API (the deployment's
        # upsert, each flow run's creation) go one at a time: on SQLite, two at once can collide, and the
        # loser waits out the client's 2 s back-off (seen as the second shard's flow run created 2.3 s late).
        self._writes = threading.Lock()

    def __call__(self, stage: str, spec_path: str, log: Callable[[str], None], timeout_s: float,
                 python: str | None) -> tuple[str, str | None]:
        beat_path = heartbeat_path(spec_path)
        storage.write_text(beat_path, "{}")  # a retry's file must not read as the last try's
        with _client() as client:
            # <experiment>/r<round>/<stage>/a<attempt>[.shard<k>], as the folder it writes
            name = "/".join(spec_path.removesuffix(".spec.json").split("/")[-4:])
            where = spec_path if storage.is_remote(spec_path) else str(Path(spec_path).resolve())
            with self._writes:
                if self._deployment_id is None:
                    self._deployment_id = ensure_deployment(client, self.pool, self.warm)
                run = client.create_flow_run_from_deployment(
                    self._deployment_id, parameters={"stage": stage, "spec": where, "timeout_s": timeout_s},
                    name=name, tags=["coevo", f"stage:{stage}"])
            log(f"{stage}: flow run {run.name} ({run.id}) on work pool {self.pool}")
            return self._wait(client, run.id, beat_path, stage, timeout_s)

    def _wait(self, client, run_id: UUID, beat_path: str, stage: str, timeout_s: float) -> tuple[str, str | None]:
        t0 = time.monotonic()
        started: float | None = None
        state, asked = None, 0.0
        poll_s = POLL_REMOTE_S if storage.is_remote(beat_path) else POLL_S
        while True:
            time.sleep(poll_s)
            beat = _read(beat_path)
            worker = beat.get("worker")
            # The heartbeat file tells a job's end first; the server is asked less often: on 2 cores, every
            # request is CPU taken from the jobs.
            if beat.get("status") not in ("published", "failed") and time.monotonic() - asked >= STATE_EVERY_S:
                state, asked = client.read_flow_run(run_id).state, time.monotonic()
            kind = state.type if state else StateType.SCHEDULED
            if kind in (StateType.SCHEDULED, StateType.PENDING) and not beat:
                if time.monotonic() - t0 <= self.worker_timeout_s:
                    continue
                if kind == StateType.PENDING:  # a worker took it, and died before its process started
                    client.set_flow_run_state(run_id, Crashed(message="taken by a worker, never started"), force=True)
                    raise StageJobError(f"{stage} job taken by a worker of work pool {self.pool!r} but not started "
                                        f"within execution.worker_timeout_s={self.worker_timeout_s}s: its worker "
                                        "died?", None, transient=True, flow_run_id=str(run_id))
                client.set_flow_run_state(run_id, Cancelled(message="no worker picked it up"), force=True)
                raise PoolError(f"no worker of work pool {self.pool!r} picked up the {stage} job within "
                                f"execution.worker_timeout_s={self.worker_timeout_s}s: start one with "
                                f"`prefect worker start --pool {self.pool}`")
            started = started or time.monotonic()
            # The job's own ending, from the heartbeat file, comes first: the flow run's state follows it.
            if beat.get("status") == "published" or kind == StateType.COMPLETED:
                return worker or "unknown", str(run_id)
            if beat.get("status") == "failed" or kind in (StateType.FAILED, StateType.CRASHED, StateType.CANCELLED):
                msg = beat.get("error") or f"flow run {run_id} ended {kind.value}: {state.message if state else ''}"
                if not beat:  # it never reached the stage job
                    msg += " before the job started: see the worker's log"
                    if self.warm:
                        msg += (f" (a process pool's worker runs `{WARM_COMMAND}` with the `python` first on its "
                                "PATH; execution.warm_workers=false runs Prefect's own command)")
                transient = beat.get("transient", kind != StateType.FAILED)
                raise StageJobError(f"{stage} job on worker {worker}: {msg}", beat.get("returncode"),
                                    transient=bool(transient), worker=worker, flow_run_id=str(run_id))
            # Silent: its last beat is old, or it never beat though the run started (its process died first).
            quiet = time.time() - beat["time"] if beat else time.monotonic() - started
            if beat.get("status", "running") == "running" and quiet > self.heartbeat_timeout_s:
                client.set_flow_run_state(run_id, Crashed(message=f"no heartbeat for {quiet:.0f}s"), force=True)
                raise StageJobError(f"{stage} job lost: worker {worker} sent no heartbeat for {quiet:.0f}s "
                                    f"(execution.heartbeat_timeout_s={self.heartbeat_timeout_s})", None,
                                    transient=True, worker=worker, flow_run_id=str(run_id))
            if time.monotonic() - started > timeout_s + self.heartbeat_timeout_s:
                client.set_flow_run_state(run_id, Cancelled(message="timed out"), force=True)
                raise StageJobError(f"{stage} job on worker {worker} timed out after {timeout_s:.0f}s", None,
                                    transient=True, worker=worker, flow_run_id=str(run_id))


def heartbeat_path(spec_path: str) -> str:
    return spec_path + ".heartbeat"


def _read(path: str) -> dict:
    try:
        return json.loads(storage.read_text(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
