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
REPO_ROOT = Path(__file__).resolve().parent.parent


def code_version() -> str | None:
    """`COEVO_CODE_VERSION` where set (an image built without .git names its commit so), else the git sha of
    the code (with '-dirty' if the tree has changes), else None."""
    if os.environ.get("COEVO_CODE_VERSION"):
        return os.environ["COEVO_CODE_VERSION"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
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

    def run_url(self, run_id: str | None) -> str | None:
        """The MLflow UI's page of a run, where the tracking URI is a server (a SQLite file has no UI)."""
        if not self.enabled or run_id is None or not self.uri.startswith(("http://", "https://")):
            return None
        return f"{self.uri.rstrip('/')}/#/experiments/{self.mlflow_experiment_id}/runs/{run_id}"

    def artifact_url(self, run_id: str | None, path: str) -> str | None:
        """A URL the MLflow server serves one of the run's artifact files from (an image for a Prefect page)."""
        if self.run_url(run_id) is None:
            return None
        from urllib.parse import urlencode

        return f"{self.uri.rstrip('/')}/get-artifact?{urlencode({'path': path, 'run_uuid': run_id})}"

    def link_orchestrator_run(self, run_id: str | None, url: str, what: str) -> None:
        """Put the Prefect run's page on the MLflow run: a tag, and the run's description (a link there)."""
        if not self.enabled or run_id is None:
            return
        self.client.set_tag(run_id, "prefect.flow_run_url", url)
        self.client.set_tag(run_id, "mlflow.note.content", f"Orchestrated by the Prefect flow run [{what}]({url}).")

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

    def log_episodes(self, round: int, episodes: list[dict[str, Any]]) -> list[str]:
        """Agent episodes as MLflow traces, linked to the round's run and tagged with their `trajectory_id`: a span
        per assistant turn, each tool call a span inside the turn that made it, timed by the stored latencies; the
        outcome reward and verdict as assessments. Each episode is {"trajectory", "turns", "verification"} rows.
        Returns the trace ids."""
        if not self.enabled or not episodes:
            return []
        import json
        import time

        import mlflow
        from mlflow.entities import AssessmentSource

        # Traces and assessments go to the global tracking URI: this one while they are logged, and afterwards
        # whatever it was (unset included: `mlflow.set_tracking_uri` would leave MLFLOW_TRACKING_URI behind).
        from mlflow.tracking._tracking_service.utils import _use_tracking_uri

        run_id = self.round_run(round)
        ids = []
        with _use_tracking_uri(self.uri):
            for ep in episodes:
                t = ep["trajectory"]
                turns = sorted(ep["turns"], key=lambda u: u["turn_index"])
                opening = [{"role": u["role"], "content": u["content"]} for u in turns if u["role"] in ("system", "user")
                           and u["turn_index"] < 2]
                clock = time.time_ns()
                root = self.client.start_trace(
                    f"episode {t['trajectory_id']}", span_type="AGENT", inputs={"messages": opening},
                    attributes={"level": t["level"], "purpose": t["purpose"], "policy_model_id": t["policy_model_id"]},
                    tags={"coevo.trajectory_id": t["trajectory_id"], TAG_EXPERIMENT: self.cfg.experiment,
                          TAG_ROUND: str(round), "coevo.problem_id": t["problem_id"]},
                    experiment_id=self.mlflow_experiment_id, start_time_ns=clock, run_id=run_id)
                open_turn = None  # (span, text): a turn's span stays open over the tool calls it made

                def close(turn, at):
                    self.client.end_span(root.trace_id, turn[0].span_id, outputs={"content": turn[1]}, end_time_ns=at)

                for u in turns[len(opening):]:
                    took = max(1000, int((u["latency_s"] or 0.0) * 1e9))  # >= 1 us: the spans keep the turns' order
                    if u["role"] == "assistant":
                        if open_turn is not None:
                            close(open_turn, clock)
                        span = self.client.start_span(
                            f"turn {u['turn_index']}", root.trace_id, root.span_id, span_type="CHAT_MODEL",
                            inputs={"turn_index": u["turn_index"]},
                            attributes={"num_tokens": u["num_tokens"], "finish_reason": u["finish_reason"]},
                            start_time_ns=clock)
                        open_turn = (span, u["content"])
                    else:
                        parent = open_turn[0].span_id if open_turn is not None else root.span_id
                        args = json.loads(u["tool_arguments"]) if u["tool_arguments"] else None
                        span = self.client.start_span(f"tool {u['tool_name'] or u['role']}", root.trace_id, parent,
                                                      span_type="TOOL", inputs={"arguments": args},
                                                      attributes={"truncated": bool(u["truncated"]),
                                                                  "error": u["error"] or ""},
                                                      start_time_ns=clock)
                        self.client.end_span(root.trace_id, span.span_id, outputs={"observation": u["content"]},
                                             status="ERROR" if u["tool_ok"] is False else "OK",
                                             end_time_ns=clock + took)
                    clock += took
                if open_turn is not None:
                    close(open_turn, clock)
                self.client.end_trace(root.trace_id, outputs={"answer": t["answer"], "ended": t["finish_reason"]},
                                      end_time_ns=clock)
                ids.append(root.trace_id)
            mlflow.flush_trace_async_logging()  # traces are exported in the background: stored before their assessments
            for trace_id, ep in zip(ids, episodes, strict=True):
                v = ep["verification"]
                source = AssessmentSource(source_type="CODE", source_id=v["verifier"])
                mlflow.log_feedback(trace_id=trace_id, name="reward", value=float(v["reward"] or 0.0), source=source)
                mlflow.log_feedback(trace_id=trace_id, name="correct", value=bool(v["correct"]), source=source,
                                    rationale=v["detail"])
        return ids

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
