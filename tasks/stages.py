"""One Prefect task per stage. Each adds only orchestration policy: retries, timeouts, tags, logging.

Retries cover transient faults only (the job was killed: OOM, preemption, timeout). A job that
exits with an error (a verifier bug, bad input) fails the round at once.
"""

from __future__ import annotations

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.runtime import task_run as task_run_ctx
from prefect.states import State

from components.config import STAGES, ExperimentConfig
from components.jobs.launch import StageJobError, StageResult, run_stage_attempt
from components.store import Store

# Stages that hold an accelerator: a `gpu` tag concurrency limit of 1 serialises them per machine.
GPU_STAGES = {"generate", "score", "train_policy", "train_reward", "evaluate"}


def is_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    try:
        state.result()
    except StageJobError as e:
        return e.transient
    except Exception:
        return False
    return False


def _run(cfg: ExperimentConfig, round: int, stage: str, code_version: str | None) -> StageResult:
    logger = get_run_logger()
    return run_stage_attempt(cfg, Store(cfg.store_path), round, stage, code_version=code_version,
                             log=logger.info, task_run_id=str(task_run_ctx.id) if task_run_ctx.id else None)


def _make(stage: str) -> Task:
    tags = ["coevo", f"stage:{stage}"] + (["gpu"] if stage in GPU_STAGES else [])

    def run(cfg: ExperimentConfig, round: int, code_version: str | None = None) -> StageResult:
        return _run(cfg, round, stage, code_version)

    run.__name__ = stage
    return task(run, name=stage, task_run_name=f"{stage}-r{{round}}", tags=tags,
                retry_condition_fn=is_transient, persist_result=False, cache_policy=NO_CACHE)


STAGE_TASKS: dict[str, Task] = {s: _make(s) for s in STAGES}


def stage_task(cfg: ExperimentConfig, stage: str) -> Task:
    """The stage's task with the experiment's retry policy applied."""
    return STAGE_TASKS[stage].with_options(retries=cfg.stage_retries, retry_delay_seconds=2,
                                           timeout_seconds=cfg.stage_timeout_s + 120)
