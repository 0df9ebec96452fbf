"""MLflow tracking: a parent run per experiment, a nested run per round, metrics named `stage/metric`.

Runs are found again by tag, so a resumed or rerun experiment logs into the same runs instead of
creating duplicates. Uses `MlflowClient` (no global fluent state), so several experiments can be
tracked from one process.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from typing import Any

from components.config import ExperimentConfig

TAG_EXPERIMENT = "coevo.experiment"
# MLflow's UI opens an experiment without a kind in its GenAI (traces) view, which is empty for coevo;
# a model-training experiment opens on its runs and their charts.
TAG_KIND, KIND_TRAINING = "mlflow.experimentKind", "custom_model_development"
TAG_ROUND = "coevo.round"


def code_version() -> str | None:
    """The git sha of the code (with '-dirty' if the tree has changes), or None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha.stdout.strip()[:12] + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def tracking_uri(cfg: ExperimentConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(cfg.workdir).resolve() / 'mlflow.db'}"


def artifact_location(cfg: ExperimentConfig) -> str:
    """Where a new MLflow experiment keeps its artifacts: `tracking.artifact_location`, else beside the stage
    outputs where those lie in shared storage (`<storage>/mlartifacts`), else `<workdir>/mlartifacts`."""
    from components.storage import is_remote, join

    if cfg.tracking.artifact_location:
        return cfg.tracking.artifact_location
    shared = os.environ.get("COEVO_STORAGE") or cfg.execution.storage
    if shared and is_remote(shared):
        return join(shared, "mlartifacts")
    return (Path(cfg.workdir).resolve() / "mlartifacts").as_uri()


class Tracker:
    """Thin wrapper over MlflowClient for one experiment; a disabled tracker does nothing."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.enabled = cfg.tracking.enabled
        self._round_runs: dict[int, str] = {}
        self.parent_run_id: str | None = None
        if not self.enabled:
            return
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        name = cfg.tracking.experiment_name or cfg.experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            artifacts = artifact_location(cfg)
            self.mlflow_experiment_id = self.client.create_experiment(name, artifact_location=artifacts,
                                                                      tags={TAG_KIND: KIND_TRAINING})
        else:
            self.mlflow_experiment_id = exp.experiment_id
            if exp.tags.get(TAG_KIND) != KIND_TRAINING:  # an experiment made by an older coevo, or by hand
                self.client.set_experiment_tag(exp.experiment_id, TAG_KIND, KIND_TRAINING)

    def _find_run(self, filter_string: str) -> str | None:
        runs = self.client.search_runs([self.mlflow_experiment_id], filter_string=filter_string, max_results=1,
                                       order_by=["attributes.start_time ASC"])
        return runs[0].info.run_id if runs else None

    def start(self, tags: dict[str, str]) -> str | None:
        if not self.enabled:
            return None
        exp = self.cfg.experiment
        run_id = self._find_run(f"tags.`{TAG_EXPERIMENT}` = '{exp}' and tags.`{TAG_ROUND}` = 'all'")
        if run_id is None:
            run = self.client.create_run(self.mlflow_experiment_id, run_name=exp,
                                         tags={TAG_EXPERIMENT: exp, TAG_ROUND: "all", **tags})
            run_id = run.info.run_id
            params = {k: _param(v) for k, v in self.cfg.flat().items()}
            items = list(params.items())
            from mlflow.entities import Param

            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + 100]])
        else:
            for k, v in tags.items():
                self.client.set_tag(run_id, k, v)
            self.client.update_run(run_id, status="RUNNING")
        self.parent_run_id = run_id
        return run_id

    def round_run(self, round: int) -> str | None:
        if not self.enabled:
            return None
        if round in self._round_runs:
            return self._round_runs[round]
        exp = self.cfg.experiment
        run_id = self._find_run(f"tags.`{TAG_EXPERIMENT}` = '{exp}' and tags.`{TAG_ROUND}` = '{round}'")
        if run_id is None:
            run = self.client.create_run(
                self.mlflow_experiment_id, run_name=f"round-{round}",
                tags={TAG_EXPERIMENT: exp, TAG_ROUND: str(round), "mlflow.parentRunId": self.parent_run_id or ""},
            )
            run_id = run.info.run_id
            self.client.log_param(run_id, "round", round)
            self.client.log_param(run_id, "config_hash", self.cfg.config_hash())
        self._round_runs[round] = run_id
        return run_id

    def log_stage(self, round: int, stage: str, metrics: dict[str, float], duration_s: float | None) -> None:
        """Stage metrics go to the round run; they also go to the parent with step=round for curves."""
        if not self.enabled:
            return
        from mlflow.entities import Metric
        import time

        ts = int(time.time() * 1000)
        values = {f"{stage}/{k}": float(v) for k, v in metrics.items() if _finite(v)}
        if duration_s is not None:
            values[f"timing/{stage}"] = float(duration_s)
        run_id = self.round_run(round)
        batch = [Metric(k, v, ts, 0) for k, v in sorted(values.items())]
        self.client.log_batch(run_id, metrics=batch)
        if self.parent_run_id:
            self.client.log_batch(self.parent_run_id, metrics=[Metric(k, v, ts, round) for k, v in sorted(values.items())])

    def log_artifact(self, path: Path, round: int | None = None, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        run_id = self.parent_run_id if round is None else self.round_run(round)
        self.client.log_artifact(run_id, str(path), artifact_path)

    def finish_round(self, round: int) -> None:
        if self.enabled and round in self._round_runs:
            self.client.set_terminated(self._round_runs[round], "FINISHED")

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled and self.parent_run_id:
            self.client.set_terminated(self.parent_run_id, status)

    def register_model(self, name: str, model_dir: str, round: int, tags: dict[str, str],
                       score: float | None, score_tag: str = "heldout_greedy_acc",
                       artifact_path: str = "policy", current: bool = True) -> str | None:
        """Log a round's checkpoint to its round run and register it as a version of `name` (once:
        a version is found again by its model_id tag, so a resumed round registers nothing twice).

        The version's source is the logged artifact, which a remote tracking server accepts (it
        refuses local paths). Each committed attempt is a version of its own (its model_id names the attempt).
        Aliases: `current` moves here where `current` says this is the newest round's live model; `best` is
        the version with the highest `score` (held-out accuracy for a policy, step F1 for a PRM), kept in tag
        `score_tag`. MLflow reserves `latest`, and `models:/<name>/latest` already resolves to the newest version.
        """
        if not self.enabled or not self.cfg.tracking.register_models:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(name, tags={TAG_EXPERIMENT: self.cfg.experiment},
                                                description=f"coevo {self.cfg.experiment}: one version per round")
        found = self.client.search_model_versions(f"name = '{name}'")
        mine = [v for v in found if v.tags.get("coevo.model_id") == tags["coevo.model_id"]]
        if mine:
            version = mine[0].version
        else:
            run_id = self.round_run(round)
            self.client.log_artifacts(run_id, model_dir, artifact_path=artifact_path)
            source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
            all_tags = {**tags, TAG_ROUND: str(round)}
            if score is not None:
                all_tags[score_tag] = f"{score:.6f}"
            version = self.client.create_model_version(name, source=source, run_id=run_id, tags=all_tags).version
            found = self.client.search_model_versions(f"name = '{name}'")
        if current:
            self.client.set_registered_model_alias(name, "current", version)
        scored = [(float(v.tags[score_tag]), -int(v.version), v.version) for v in found if score_tag in v.tags]
        if scored:
            self.client.set_registered_model_alias(name, "best", max(scored)[2])
        return str(version)

    def log_run(self, name: str, tags: dict[str, str], metrics: dict[str, float], params: dict[str, str]) -> str | None:
        """A finished run outside the parent/round tree (e.g. an `evaluate_model` result)."""
        if not self.enabled:
            return None
        import time

        from mlflow.entities import Metric, Param

        run = self.client.create_run(self.mlflow_experiment_id, run_name=name,
                                     tags={TAG_EXPERIMENT: self.cfg.experiment, **tags})
        ts = int(time.time() * 1000)
        self.client.log_batch(run.info.run_id, params=[Param(k, _param(v)) for k, v in params.items()],
                              metrics=[Metric(k, float(v), ts, 0) for k, v in sorted(metrics.items()) if _finite(v)])
        self.client.set_terminated(run.info.run_id)
        return run.info.run_id

    def metric_history(self, key: str) -> dict[int, float]:
        """Parent-run metric by round (step), e.g. `evaluate/greedy_acc`."""
        if not self.enabled or not self.parent_run_id:
            return {}
        return {m.step: m.value for m in self.client.get_metric_history(self.parent_run_id, key)}


def _param(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 6000 else s[:5997] + "..."


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
