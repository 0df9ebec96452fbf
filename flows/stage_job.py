"""`stage_job`: one stage job as a flow run of a work pool's worker (`execution.pool`, `tasks/pool.py`).

    prefect worker start --pool coevo-gpu --type process --limit 1     # one job at a time per GPU
    coevo run --config configs/arith.yaml --set execution.pool=coevo-gpu

The orchestrating flow writes the job's spec to shared storage and starts this flow on the pool's
deployment `stage_job/<pool>`. Here, on the worker, it runs the stage job (`components.jobs`: in this
process, or as `python -m components.jobs <stage> --spec <spec>` where the job needs another interpreter
or `accelerate launch`), and beats a heartbeat file beside the spec every few seconds: its
worker, its flow run, and at the end how the job ended. The orchestrator reads that file to learn
where the job ran and to tell a worker that died (no heartbeat) from a job that failed; it then
verifies and commits what the job published. The job never opens the store.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as flow_run_ctx

from components import storage
from components.jobs.launch import EXIT_TRANSIENT, StageJobError, accelerate_launch_args, job_python, run_job
from components.jobs.spec import StageSpec
from tasks.pool import heartbeat_path

HEARTBEAT_EVERY_S = 2.0


@flow(name="stage_job", log_prints=True)
def stage_job(stage: str, spec: str, timeout_s: float = 3600.0) -> str:
    """Run one stage job here and return this worker's name."""
    logger = get_run_logger()
    worker = os.environ.get("PREFECT__WORKER_NAME") or f"process:{socket.gethostname()}:{os.getpid()}"
    beat = {"worker": worker, "flow_run_id": str(flow_run_ctx.id), "status": "running"}
    path = heartbeat_path(spec)
    done = threading.Event()

    def write(body: dict) -> None:
        storage.write_text(path, json.dumps(body | {"time": time.time()}))

    def pump() -> None:
        while not done.wait(HEARTBEAT_EVERY_S):
            write(beat)

    write(beat)
    threading.Thread(target=pump, daemon=True).start()
    logger.info(f"{stage} job on worker {worker}: {spec}")
    try:
        python = job_python(StageSpec.from_file(spec).cfg(), stage)
        in_process = os.environ.get("PYTHONHASHSEED") == "0"  # as `run_job` starts a job (set by the deployment)
        if in_process and python == sys.executable and not accelerate_launch_args(stage, spec):
            # This flow run is already a fresh process of its own: run the job in it, and spare a second
            # interpreter's start-up. The pool runner's heartbeat timeout covers a job that hangs or dies.
            from components.jobs.__main__ import main

            rc = main([stage, "--spec", spec])
            if rc:
                raise StageJobError(f"stage {stage} job exited with code {rc}", rc, transient=rc == EXIT_TRANSIENT)
        else:  # another environment (vLLM's), or N training processes under accelerate
            run_job(stage, spec, logger.info, timeout_s, python=python)
    except StageJobError as e:
        done.set()
        write(beat | {"status": "failed", "transient": e.transient, "returncode": e.returncode, "error": str(e)})
        raise
    done.set()
    write(beat | {"status": "published"})
    return worker
