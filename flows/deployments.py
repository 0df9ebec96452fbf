"""Serve the deployments of `infra/prefect.yaml` from this process, so a run started in the UI executes here.

    coevo server up                       # a Prefect server (and MLflow) for the workdir
    coevo serve                           # then press "Run" on a deployment in the Prefect UI

    from flows.deployments import build_deployments
    build_deployments("infra/prefect.yaml")   # RunnerDeployments, e.g. for prefect.serve(...)

`infra/prefect.yaml` stays the one place deployments are declared: `prefect deploy` reads it for a
work pool, and this module reads the same entries (entrypoint, parameters, schedules, tags) for
`prefect.serve`. Work pool settings are ignored when serving: served runs execute in this process's
machine, no worker needed. Each flow's type hints become the parameter form the UI renders.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from prefect import Flow, serve
from prefect.schedules import Cron

REPO = Path(__file__).resolve().parent.parent


class DeploymentError(ValueError):
    """prefect.yaml is missing, malformed, or names a flow that does not exist."""


def load_prefect_yaml(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        path = REPO / path
    if not path.is_file():
        raise DeploymentError(f"deployment file not found: {path}")
    doc = yaml.safe_load(path.read_text()) or {}
    deployments = doc.get("deployments")
    if not isinstance(deployments, list) or not deployments:
        raise DeploymentError(f"{path}: no `deployments:` list")
    return deployments


def resolve_flow(entrypoint: str) -> Flow | None:
    """`flows/evolution.py:self_evolution` -> the flow object; None if the module lacks it."""
    if ":" not in entrypoint:
        raise DeploymentError(f"entrypoint {entrypoint!r}: expected path/to/module.py:flow_name")
    file, name = entrypoint.rsplit(":", 1)
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    fn = getattr(module, name, None)
    if fn is None:
        return None
    if not isinstance(fn, Flow):
        raise DeploymentError(f"entrypoint {entrypoint!r} is not a Prefect flow")
    return fn


def build_deployments(path: str | Path, log: Callable[[str], None] = print) -> list:
    out = []
    for d in load_prefect_yaml(path):
        flow = resolve_flow(d["entrypoint"])
        if flow is None:
            log(f"skipping deployment {d['name']!r}: {d['entrypoint']} does not exist in this checkout")
            continue
        schedules = [Cron(s["cron"], timezone=s.get("timezone"), active=bool(s.get("active", True)))
                     for s in d.get("schedules") or [] if s.get("cron")]
        out.append(flow.to_deployment(
            name=d["name"],
            description=d.get("description"),
            tags=d.get("tags") or [],
            parameters=d.get("parameters") or {},
            schedules=schedules or None,
            version=d.get("version"),
        ))
    return out


def ensure_gpu_limit(limit: int, log: Callable[[str], None] = print) -> None:
    """The `gpu` tag concurrency limit: at most `limit` GPU stage tasks run at once on this server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="gpu", concurrency_limit=limit)  # an upsert by tag
    log(f"tag concurrency limit: gpu={limit}")


def serve_deployments(path: str | Path = "infra/prefect.yaml", limit: int | None = None, gpu_limit: int = 1,
                      log: Callable[[str], None] = print) -> None:
    deployments = build_deployments(path, log)
    if not deployments:
        raise DeploymentError(f"{path}: none of the deployments' flows exist")
    if gpu_limit > 0:
        ensure_gpu_limit(gpu_limit, log)
    serve(*deployments, limit=limit)
