"""One Prefect task per stage. Each adds only orchestration policy: retries, timeouts, tags, logging.

While the job runs, its progress lines update a progress artifact on the task run (tasks/progress.py).

Retries cover transient faults only (the job was killed: OOM, preemption, timeout). A job that
exits with an error (a verifier bug, bad input) fails the round at once. A stage that holds an
accelerator (`Stage.gpu`) is tagged `gpu`: a tag concurrency limit of 1 serialises them per machine.

A stage's task run carries only those of its tags that have a concurrency limit on the API it runs
against. Prefect's task engine asks the server for slots of every tag a run carries, limit or not, and
on SQLite (the ephemeral and `coevo server` database) that write races the server's own recording of
the run's state events: a 503, then the client's fixed 2 s back-off. It cost about 2 s in up to half
of the stage starts measured (docs/scale-out.md); a tag with no limit has nothing to enforce.
"""

from __future__ import annotations

from prefect import Task, get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run as flow_run_ctx
from prefect.runtime import task_run as task_run_ctx
from prefect.states import State

from components.config import ExperimentConfig
from components.jobs.launch import StageJobError, StageResult, pool_of, run_stage_attempt
from components.progress import TeeSink, current_sink, installed
from components.stages import STAGES, Stage
from components.store import Store
from tasks.pool import PoolRunner
from tasks.progress import PrefectProgressSink


def is_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    try:
        state.result()
    except StageJobError as e:
        return e.transient
    except Exception:
        return False
    return False


def stage_tags(stage: str) -> set[str]:
    """The tags a stage's task run may carry; `limited_tags` keeps those with a concurrency limit."""
    return {"coevo", f"stage:{stage}"} | ({"gpu"} if STAGES[stage].gpu else set())


def _make(stage: Stage) -> Task:
    def run(cfg: ExperimentConfig, round: int, code_version: str | None = None) -> StageResult:
        pool = pool_of(cfg, stage.name)
        task_run_id = str(task_run_ctx.id) if task_run_ctx.id else None
        # The job's progress lines fill a progress artifact on this task run (and any terminal bars).
        on_page = PrefectProgressSink(flow_run_ctx.id, task_run_id)
        with installed(TeeSink(current_sink(), on_page)):
            return run_stage_attempt(cfg, Store.for_config(cfg), round, stage.name, code_version=code_version,
                                     log=get_run_logger().info, task_run_id=task_run_id,
                                     runner=PoolRunner(cfg, pool) if pool else None)

    run.__name__ = stage.name
    return task(run, name=stage.name, task_run_name=f"{stage.name}-r{{round}}",
                retry_condition_fn=is_transient, persist_result=False, cache_policy=NO_CACHE)


STAGE_TASKS: dict[str, Task] = {name: _make(s) for name, s in STAGES.items()}


def stage_task(cfg: ExperimentConfig, stage: str) -> Task:
    """The stage's task with the experiment's retry policy applied. A sharded stage retries a killed shard
    alone inside one try of the task, so its try may take a job's time once per retry."""
    sharded = cfg.execution.shards > 1 and STAGES[stage].merge is not None
    job_s = cfg.stage_timeout_s * (1 + cfg.stage_retries if sharded else 1)
    return STAGE_TASKS[stage].with_options(retries=cfg.stage_retries, retry_delay_seconds=2,
                                           timeout_seconds=job_s + 120, tags=limited_tags(stage_tags(stage)))


def limited_tags(tags: set[str]) -> set[str]:
    """The tags that have a concurrency limit (`tag:<tag>`, active) on the current API: reads only."""
    with get_client(sync_client=True) as client:
        limited = set()
        for tag in sorted(tags):
            try:
                if client.read_global_concurrency_limit_by_name(f"tag:{tag}").active:
                    limited.add(tag)
            except ObjectNotFound:
                pass
        return limited
