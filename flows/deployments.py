"""Serve the deployments of `infra/prefect.yaml` from this process, so a run started in the UI executes here.

    coevo server up                       # a Prefect server (and MLflow) for the workdir
    coevo serve                           # then press "Run" on a deployment in the Prefect UI

    from flows.deployments import build_deployments
    build_deployments("infra/prefect.yaml")   # RunnerDeployments, e.g. for prefect.serve(...)

`infra/prefect.yaml` stays the one place deployments are declared: `prefect deploy` reads it for a
work pool, and this module reads the same entries (entrypoint, parameters, schedules, tags) for
`prefect.serve`. Work pool settings are ignored when serving: served runs execute in this process's
machine, no worker needed.

Each flow's type hints become the parameter form the UI renders, and the API validates a run's
parameters against it before the run exists. What only this machine knows is added to the form when
serving (`FormChoices`): the configs found (the checkout's `configs/` and `--configs` folders), the
store's experiments, the server's work pools and the MLflow registry's models become choices.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass
class FormChoices:
    """The choices the deployments' forms offer on this machine, read when serving starts."""

    configs: dict[str, str] = field(default_factory=dict)  # value -> what it runs (recipe, rounds, backend, ...)
    experiments: list[str] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)  # those of the stored experiments' recipes
    work_pools: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # models:/<name>@<alias>, models:/<name>/<version>
    workdir: str | None = None

    @classmethod
    def discover(cls, workdir: str | Path, config_dirs: list[Path] = (), log: Callable[[str], None] = print,
                 ) -> FormChoices:
        recipes = _experiment_recipes(workdir)
        return cls(configs=find_configs([REPO / "configs", *config_dirs], log), experiments=sorted(recipes),
                   stages=_stages_of(recipes.values()) or _stages_of(_all_recipes()), work_pools=_work_pools(),
                   models=_registered_models(workdir, log), workdir=str(workdir))

    def apply(self, deployment: Any) -> None:
        """Constrain the deployment's parameter schema (and drop a default the choices exclude)."""
        props = deployment._parameter_openapi_schema.properties
        if "config_path" in props and self.configs:
            props["config_path"]["enum"] = list(self.configs)
            props["config_path"]["description"] = ("The experiment's YAML, as found when `coevo serve` started; "
                                                    "blank fields below take its values:\n\n" + "\n".join(
                                                        f"- `{k}`: {v}" for k, v in self.configs.items()))
        _choose(props, "experiment", self.experiments)
        _choose(props, "stage", self.stages)
        _choose(props, "work_pool", self.work_pools)
        _choose(props, "registered", self.models)
        if "workdir" in props and self.workdir is not None:
            deployment.parameters["workdir"] = self.workdir
        for name, value in list(deployment.parameters.items()):
            allowed = _enum(props.get(name, {}))
            if allowed is not None and value is not None and value not in allowed:
                del deployment.parameters[name]  # e.g. an example experiment this store does not hold


def _enum(prop: dict[str, Any]) -> list[Any] | None:
    if "enum" in prop:
        return prop["enum"]
    return next((a["enum"] for a in prop.get("anyOf", []) if "enum" in a), None)


def _choose(props: dict[str, Any], name: str, values: list[str]) -> None:
    """A string parameter (or a nullable one) becomes a choice among `values`; none found: it stays free."""
    if name not in props or not values:
        return
    prop = props[name]
    target = next((a for a in prop.get("anyOf", []) if a.get("type") == "string"), prop)
    target["enum"] = list(values)


def find_configs(dirs: list[Path], log: Callable[[str], None] = print) -> dict[str, str]:
    """Each loadable experiment YAML in `dirs` (the checkout's own as `configs/<name>`, others by absolute
    path), with what it runs; one that does not load is left out, saying why."""
    from components.config import ConfigError, load_config
    from flows.evolution import check_startable

    found: dict[str, str] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise DeploymentError(f"config folder not found: {d}")
        for path in sorted(d.glob("*.y*ml")):
            value = f"configs/{path.name}" if path.parent.resolve() == (REPO / "configs").resolve() else str(path.resolve())
            try:
                cfg = load_config(path)
            except ConfigError as e:
                log(f"config {path} is not offered: {' '.join(str(e).split())}")
                continue
            found[value] = (f"experiment {cfg.experiment}, recipe {cfg.recipe}, rounds {cfg.rounds}, backend "
                            f"{cfg.generate.backend}, shards {cfg.execution.shards}, pool {cfg.execution.pool or 'local'}")
            try:  # offered all the same: the model may be built while this serves; its run is refused until then
                check_startable(cfg)
            except ConfigError as e:
                found[value] += " (cannot start here yet: " + "; ".join(
                    line.strip() for line in str(e).splitlines()[1:]) + ")"
                log(f"config {value} cannot start here yet: {str(e).splitlines()[1].strip()}")
    return found


def _experiment_recipes(workdir: str | Path) -> dict[str, str]:
    """The store's experiments and their recipes."""
    from components.store import Store

    store = Store(os.environ.get("COEVO_CATALOG") or Path(workdir) / "store")
    if not store.exists():
        return {}
    return dict(store.query("SELECT experiment_id, recipe FROM experiments")[1])


def _stages_of(recipes) -> list[str]:
    """Every stage a round of these recipes runs (round 0's and the others'), in the registry's order; a recipe
    that no longer loads offers none."""
    from components.recipes import get_recipe
    from components.stages import STAGES

    names: set[str] = set()
    for name in set(recipes):
        try:
            recipe = get_recipe(name)
        except (ValueError, ImportError, AttributeError):
            continue
        names |= set(recipe.round_stages(0)) | set(recipe.round_stages(1))
    return [s for s in STAGES if s in names]


def _all_recipes() -> list[str]:
    from components.recipes import RECIPES

    return list(RECIPES)


def _work_pools() -> list[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return sorted(p.name for p in client.read_work_pools())


def _registered_models(workdir: str | Path, log: Callable[[str], None]) -> list[str]:
    """The registry's models, newest first: each alias, then each version."""
    from mlflow.tracking import MlflowClient

    from components.servers import mlflow_store_uri

    uri = os.environ.get("MLFLOW_TRACKING_URI") or mlflow_store_uri(workdir)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return []
    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        out = []
        for m in client.search_registered_models():
            out += [f"models:/{m.name}@{a}" for a in sorted(m.aliases or {})]
            versions = sorted(client.search_model_versions(f"name = '{m.name}'"), key=lambda v: -int(v.version))
            out += [f"models:/{m.name}/{v.version}" for v in versions]
        return out
    except Exception as e:  # noqa: BLE001 - no registry, no choices: the field takes a path
        log(f"registered models not listed ({type(e).__name__}: {e})")
        return []


def build_deployments(path: str | Path, log: Callable[[str], None] = print,
                      choices: FormChoices | None = None) -> list:
    out = []
    for d in load_prefect_yaml(path):
        flow = resolve_flow(d["entrypoint"])
        if flow is None:
            log(f"skipping deployment {d['name']!r}: {d['entrypoint']} does not exist in this checkout")
            continue
        schedules = [Cron(s["cron"], timezone=s.get("timezone"), active=bool(s.get("active", True)),
                          parameters=s.get("parameters") or {})
                     for s in d.get("schedules") or [] if s.get("cron")]
        deployment = flow.to_deployment(
            name=d["name"],
            description=d.get("description"),
            tags=d.get("tags") or [],
            parameters=d.get("parameters") or {},
            schedules=schedules or None,
            version=d.get("version"),
        )
        if choices is not None:
            choices.apply(deployment)
        out.append(deployment)
    return out


def ensure_gpu_limit(limit: int, log: Callable[[str], None] = print) -> None:
    """The `gpu` tag concurrency limit: at most `limit` GPU stage tasks run at once on this server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="gpu", concurrency_limit=limit)  # an upsert by tag
    log(f"tag concurrency limit: gpu={limit}")


def serve_deployments(path: str | Path = "infra/prefect.yaml", limit: int | None = None, gpu_limit: int = 1,
                      log: Callable[[str], None] = print, workdir: str | Path = "workdir",
                      config_dirs: list[Path] = ()) -> None:
    choices = FormChoices.discover(workdir, list(config_dirs), log)
    log(f"forms offer {len(choices.configs)} configs, {len(choices.experiments)} experiments, "
        f"{len(choices.work_pools)} work pools, {len(choices.models)} registered models")
    deployments = build_deployments(path, log, choices)
    if not deployments:
        raise DeploymentError(f"{path}: none of the deployments' flows exist")
    if gpu_limit > 0:
        ensure_gpu_limit(gpu_limit, log)
    serve(*deployments, limit=limit)
