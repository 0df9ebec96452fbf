"""Prefect flows: `self_evolution` (all rounds), `evolution_round` (one round), `run_stage` (rerun one stage).

    coevo run --config configs/arith.yaml          # runs self_evolution
    coevo rerun arith-default --round 2 --stage score

Flows only sequence tasks and make round-level decisions (curriculum, what to skip on resume).
Every committed stage is skipped on a second run, so `self_evolution` on an existing experiment
is a resume.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from prefect import flow, get_client, get_run_logger
from prefect.artifacts import (create_image_artifact, create_link_artifact, create_markdown_artifact,
                               create_table_artifact)
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.runtime import flow_run as flow_run_ctx
from prefect.settings import get_current_settings
from prefect.utilities.urls import url_for
from pydantic import Field

from components import storage
from components.config import ConfigError, ExperimentConfig, load_config
from components.curriculum import pick_levels
from components.locking import ExperimentLock
from components.plots import accuracy_per_round, compute_curve, round_summary
from components.recipes import RECIPES, get_recipe
from components.search.curves import curve_points
from components.stages import PlanningError
from components.store import Store, StoreError
from components.tracking import Tracker, code_version
from tasks.progress import artifact_key
from tasks.stages import stage_task

CONFIG_SNAPSHOT = "config.yaml"
REPO = Path(__file__).resolve().parent.parent

# The typed parameters of the flows, which the Prefect UI renders as a form and its API validates before a
# run exists. Choices that depend on this machine (its configs, the store's experiments, the work pools, the
# registry's models) are added to the deployment's schema when `coevo serve` starts (flows/deployments.py).
# `run_stage`'s `stage` stays a string here: its check names the stages of that experiment's recipe, which a
# type cannot; `coevo serve` offers the stored recipes' stages as its choices.
RecipeName = Literal[tuple(RECIPES)]  # type: ignore[valid-type]
Backend = Literal["hf", "vllm", "openai"]
Round = Annotated[int, Field(ge=0)]
# The config fields the form sets, by parameter name; everything else goes through `overrides`.
TYPED_FIELDS = {"recipe": "recipe", "rounds": "rounds", "backend": "generate.backend",
                "shards": "execution.shards", "work_pool": "execution.pool"}


def _resolve_config(config_path: str) -> str:
    """A relative config path from the working directory, else from the checkout (the form's `configs/…`)."""
    path = Path(config_path)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        return str(REPO / path)
    return config_path


def _load(config_path: str, overrides: list[str] | None, startable: bool = False) -> ExperimentConfig:
    cfg = load_config(_resolve_config(config_path), overrides or [])
    if startable:
        check_startable(cfg)
    return cfg


def check_startable(cfg: ExperimentConfig) -> None:
    """`cfg.check_startable`: the data always; the given model only where a stage will load it, until round 0's
    bootstrap committed (recipe `import` stores trajectories and loads no model). The store is read only where
    the model is missing, so a check of a new shared catalog never opens it."""
    try:
        cfg.check_startable(model=cfg.recipe != "import")
    except ConfigError:
        try:
            started = Store.for_config(cfg).committed_run(cfg.experiment, 0, "bootstrap") is not None
        except StoreError:
            started = False
        if not started:
            raise
        cfg.check_startable(model=False)


def typed_overrides(overrides: list[str] | None, **fields: Any) -> list[str]:
    """`overrides` plus a KEY=VALUE for each typed field that is set (not None), which must not be set twice.

    >>> typed_overrides(["train_policy.steps=5"], rounds=2, backend=None)
    ['train_policy.steps=5', 'rounds=2']
    """
    given = {TYPED_FIELDS[k]: v for k, v in fields.items() if v is not None}
    twice = [o for o in overrides or [] if o.split("=", 1)[0].strip() in given]
    if twice:
        raise ValueError(f"set both as a field and in overrides: {twice}; keep one")
    return [*(overrides or []), *(f"{k}={v}" for k, v in given.items())]


def _flow_run_id() -> str | None:
    return str(flow_run_ctx.id) if flow_run_ctx.id else None


def _tracker(cfg: ExperimentConfig, link: bool = False) -> Tracker:
    """The experiment's MLflow tracker; `link`: this flow run and the experiment's MLflow run link each other."""
    tracker = Tracker(cfg)
    tracker.start({"config_hash": cfg.config_hash(), "rounds": str(cfg.rounds), "git_sha": code_version() or "unknown",
                   "prefect_flow_run_id": _flow_run_id() or "none", "recipe": cfg.recipe})
    if link:
        _link_runs(tracker, tracker.parent_run_id, f"{cfg.experiment}: all rounds", artifact_key(f"{cfg.experiment}-mlflow"))
    return tracker


def _link_runs(tracker: Tracker, mlflow_run_id: str | None, what: str, key: str) -> None:
    """A link artifact on this Prefect flow run to the MLflow run, and the flow run's page on the MLflow run."""
    flow_run_id = _flow_run_id()
    prefect_url = url_for("flow-run", obj_id=flow_run_id) if flow_run_id else None
    if prefect_url:
        tracker.link_orchestrator_run(mlflow_run_id, prefect_url, what)
    mlflow_url = tracker.run_url(mlflow_run_id)
    if mlflow_url:
        create_link_artifact(mlflow_url, link_text=f"MLflow run: {what}", key=key,
                             description=f"The MLflow run of {what}: metrics, params, plots and models.")


def _plan_round(cfg: ExperimentConfig, store: Store, round: int) -> list[int]:
    """The round's curriculum levels: as stored, unless a rerun of an earlier round made the round stale, when
    they are planned again from the earlier round's evaluation as it now stands."""
    existing = store.round_plan(cfg.experiment, round)
    if existing is not None and not store.stale_stages(cfg.experiment, round):
        return existing
    rates = store.level_pass_rates(cfg.experiment, round - 1)
    if not rates:
        raise PlanningError(f"{cfg.experiment} round {round - 1}: no committed evaluation to plan the curriculum from")
    c = cfg.curriculum
    solved = store.level_solved_shares(cfg.experiment, round - 1) if c.floor_from_samples else None
    levels, reason = pick_levels(rates, c.low, c.high, c.max_levels, solved)
    store.set_round_plan(cfg.experiment, round, levels, reason)
    get_run_logger().info(f"round {round} curriculum: levels {levels} ({reason})")
    return levels


def _publish_round(cfg: ExperimentConfig, store: Store, tracker: Tracker, round: int) -> dict[str, Any]:
    evals = store.evaluations(cfg.experiment)
    summary = store.round_summary(cfg.experiment, round)
    timings = store.stage_timings(cfg.experiment, round)
    this_round = [e for e in evals if e["round"] == round]
    table = [{"level": "all" if e["level"] == -1 else e["level"], "metric": e["metric"],
              "value": round_(e["value"]), "n": e["n"]} for e in this_round]
    s = summary[0] if summary else {}
    table += [{"level": "-", "metric": k, "value": s.get(k), "n": None}
              for k in ("generated", "generated_tokens", "mc_tokens", "search_tokens", "budget_tokens", "selected",
                        "dpo_pairs", "truncated", "train_pass_rate") if k in s]
    table += [{"level": "-", "metric": f"timing/{t['stage']}", "value": round_(t["duration_s"]), "n": None}
              for t in timings]
    create_table_artifact(table, key=artifact_key(f"{cfg.experiment}-round-{round}"),
                          description=f"coevo {cfg.experiment} round {round}: metrics")
    plot = accuracy_per_round(evals, cfg.experiment_dir / "plots" / "accuracy_per_round.png",
                              title=f"{cfg.experiment}: held-out greedy accuracy")
    all_rounds = store.round_summary(cfg.experiment)
    summary_plot = round_summary(all_rounds, cfg.experiment_dir / "plots" / "round_summary.png",
                                 title=f"{cfg.experiment}: rounds")
    curves = curve_points(evals)
    curve_plot = compute_curve(curves, cfg.experiment_dir / "plots" / "compute_curve.png",
                               title=f"{cfg.experiment}: accuracy against compute") if round in curves else None
    for on in (None, round):  # the experiment's run holds the newest; each round's run, the plots as of it
        tracker.log_artifact(plot, round=on, artifact_path="plots")
        tracker.log_artifact(summary_plot, round=on, artifact_path="plots")
        if curve_plot:
            tracker.log_artifact(curve_plot, round=on, artifact_path="plots")
    # The plots as they stood after this round, on the round's run page (served by the MLflow server).
    image = tracker.artifact_url(tracker.round_run(round), "plots/accuracy_per_round.png")
    if image:
        create_image_artifact(image, key=artifact_key(f"{cfg.experiment}-round-{round}-accuracy"),
                              description=f"coevo {cfg.experiment}: held-out greedy accuracy after round {round}")
    _link_runs(tracker, tracker.round_run(round), f"{cfg.experiment} round {round}",
               artifact_key(f"{cfg.experiment}-round-{round}-mlflow"))
    _trace_episodes(cfg, store, tracker, round)
    _register_models(cfg, store, tracker, round, {"policy": ("heldout_greedy_acc", s.get("greedy_acc")),
                                                   "prm": ("heldout_prm_step_f1", s.get("prm_step_f1")),
                                                   "orm": ("heldout_greedy_acc", None)})
    tracker.finish_round(round)
    ui = get_current_settings().ui_url
    links = {"round_run": url_for("flow-run", obj_id=_flow_run_id()) if _flow_run_id() else None,
             "table": f"{ui}/artifacts/key/{artifact_key(f'{cfg.experiment}-round-{round}')}" if ui else None,
             "plot": image, "mlflow": tracker.run_url(tracker.round_run(round))}
    return {"round": round, **{k: v for k, v in s.items() if k != "experiment_id"}, "links": links}


class RoundIndex:
    """A markdown artifact on the experiment's flow run, one row per finished round, linking the round's flow
    run, its table artifact, its plot and its MLflow run; the newest plot below. Updated after each round."""

    def __init__(self, experiment: str):
        self.experiment, self.rows, self.artifact_id = experiment, [], None

    def add(self, summary: dict[str, Any]) -> None:
        self.rows.append(summary)
        body = self.markdown()
        if self.artifact_id is None:
            self.artifact_id = create_markdown_artifact(body, key=artifact_key(f"{self.experiment}-rounds"),
                                                        description=f"coevo {self.experiment}: rounds so far")
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(self.artifact_id, ArtifactUpdate(data=body))

    def markdown(self) -> str:
        def link(text: str, url: str | None) -> str:
            return f"[{text}]({url})" if url else "-"

        lines = [f"# {self.experiment}: rounds", "",
                 "| round | greedy acc | selected | round run | metrics | plot | MLflow |", "|---|---|---|---|---|---|---|"]
        for s in self.rows:
            acc = s.get("greedy_acc")
            links = s.get("links") or {}
            lines.append(f"| {s['round']} | {'-' if acc is None else f'{acc:.3f}'} | {s.get('selected', '-')} | "
                         f"{link('flow run', links.get('round_run'))} | {link('table', links.get('table'))} | "
                         f"{link('plot', links.get('plot'))} | {link('run', links.get('mlflow'))} |")
        newest = (self.rows[-1].get("links") or {}).get("plot") if self.rows else None
        if newest:
            lines += ["", f"![held-out greedy accuracy after round {self.rows[-1]['round']}]({newest})"]
        return "\n".join(lines)


def _trace_episodes(cfg: ExperimentConfig, store: Store, tracker: Tracker, round: int) -> None:
    """A sample of the round's agent episodes (its training episodes; round 0's held-out ones) as MLflow traces."""
    n = cfg.tracking.trace_episodes
    if not tracker.enabled or n == 0:
        return
    purpose = "eval" if round == 0 else "train"
    _, ids = store.query("SELECT t.trajectory_id FROM trajectories t WHERE t.experiment_id = ? AND t.round = ? AND "
                         "t.purpose = ? AND EXISTS (SELECT 1 FROM turns u WHERE u.trajectory_id = t.trajectory_id) "
                         "ORDER BY hash(t.trajectory_id) LIMIT ?", [cfg.experiment, round, purpose, n])
    if not ids:
        return  # not an agent environment's round
    wanted = [i for (i,) in ids]

    def rows(table: str) -> list[dict[str, Any]]:
        cols, got = store.query(f"SELECT * FROM {table} WHERE trajectory_id IN (SELECT unnest(?))", [wanted])
        return [dict(zip(cols, r)) for r in got]

    trajs, turns, vers = rows("trajectories"), rows("turns"), rows("verifications")
    by = {t["trajectory_id"]: {"trajectory": t, "turns": [], "verification": None} for t in trajs}
    for u in turns:
        by[u["trajectory_id"]]["turns"].append(u)
    for v in vers:
        by[v["trajectory_id"]]["verification"] = v
    try:
        traced = tracker.log_episodes(round, [by[i] for i in wanted if by[i]["verification"] is not None])
    except Exception as e:  # a sample for reading: its failure costs the traces, not the round
        get_run_logger().warning(f"round {round}: episodes not logged as MLflow traces: {type(e).__name__}: {e}")
        return
    get_run_logger().info(f"round {round}: {len(traced)} episodes logged as MLflow traces")


def _register_models(cfg: ExperimentConfig, store: Store, tracker: Tracker, round: int,
                     scores: dict[str, tuple[str, float | None]]) -> None:
    """Each of the round's models becomes a version of `<experiment>-<role>` (policy, prm, orm), tagged
    with its round and the SQL that lists its training data; alias `best` goes by `scores[role]`."""
    rows = store.round_models(cfg.experiment, round)
    if not tracker.enabled:
        return
    newest = store.newest_model_rounds(cfg.experiment)
    for m in rows:
        if round == 0 and m["role"] == "policy" and cfg.bootstrap.steps == 0:
            # The given model, untouched: copying (maybe GBs of) it into MLflow's artifacts adds nothing.
            get_run_logger().info(f"round 0's policy is the given model {m['uri']}: not registered")
            continue
        tags = {"coevo.model_id": m["model_id"], "coevo.role": m["role"], "coevo.stage_run_id": m["stage_run_id"],
                "coevo.train_examples": str(m["train_examples"]), "config_hash": cfg.config_hash(),
                "coevo.lineage": f"SELECT * FROM v_lineage WHERE trained_model_id = '{m['model_id']}'"}
        score_tag, score = scores.get(m["role"], ("heldout_greedy_acc", None))
        name = f"{cfg.experiment}-{m['role']}"
        # `current` is the newest round's live model: a rerun of an earlier round registers a version, not it.
        version = tracker.register_model(name, str(storage.fetch(m["uri"])), round, tags, score, score_tag=score_tag,
                                         artifact_path=f"{m['role']}/a{attempt_of(m['stage_run_id'])}",
                                         current=newest.get(m["role"]) == round)
        if version:
            store.set_model_registration(m["model_id"], name, version, tracker.round_run(round))
            get_run_logger().info(f"registered {name} version {version} ({m['model_id']})")


def attempt_of(stage_run_id: str) -> int:
    """The attempt number in `<experiment>/r<round>/<stage>/a<attempt>`."""
    return int(stage_run_id.rsplit("/a", 1)[1])


def round_(v: Any) -> Any:
    return round(float(v), 4) if isinstance(v, (int, float)) else v


def run_round(cfg: ExperimentConfig, round: int, tracker: Tracker, only: list[str] | None = None) -> dict[str, Any]:
    """Run the round's stages in order, skipping committed ones unless an earlier stage reran."""
    logger = get_run_logger()
    store = Store.for_config(cfg)
    version = code_version()
    if round > 0:
        _plan_round(cfg, store, round)
    dirty = False
    for stage in get_recipe(cfg.recipe).round_stages(round, cfg):
        if only is not None and stage not in only:
            continue
        committed = store.committed_run(cfg.experiment, round, stage)
        if committed and not committed["stale"] and not dirty and only is None:
            logger.info(f"round {round} {stage}: already committed ({committed['stage_run_id']}), skipping")
            continue
        result = stage_task(cfg, stage)(cfg, round, version)
        dirty = True
        if tracker.enabled:
            store.set_mlflow_run(result.stage_run_id, tracker.round_run(round))
        tracker.log_stage(round, stage, result.metrics, result.duration_s)
    return _publish_round(cfg, store, tracker, round)


@flow(name="evolution_round", log_prints=True)
def evolution_round(config_path: str, round: Round, overrides: list[str] | None = None) -> dict[str, Any]:
    """One round: the recipe's stages in order (rft: generate → verify → score → filter → train_policy →
    evaluate; round 0: bootstrap → evaluate).

    Args:
        config_path: The experiment's YAML: one of the configs `coevo serve` found.
        round: The round to run (0: the bootstrap).
        overrides: Any other setting, KEY=VALUE as for `coevo run --set`, e.g. rounds=2.
    """
    cfg = _load(config_path, overrides, startable=True)
    if round > cfg.rounds:
        raise ValueError(f"round {round} is beyond the experiment's rounds={cfg.rounds}")
    with ExperimentLock(cfg.experiment_dir, _flow_run_id()):
        _register(cfg)
        return run_round(cfg, round, _tracker(cfg))


def _register(cfg: ExperimentConfig) -> None:
    store = Store.for_config(cfg)
    extended = store.register_experiment(cfg.experiment, cfg.model_dump_json(), cfg.config_hash(), cfg.seed,
                                         cfg.recipe, code_version(), extends=cfg.extends)
    if extended:
        get_run_logger().info(f"experiment {cfg.experiment} continues with rounds={cfg.rounds} (more rounds, or "
                              "fields added since its config was stored, at their defaults): its committed rounds "
                              "are kept, config hash now " + cfg.config_hash())
    snapshot = cfg.experiment_dir / CONFIG_SNAPSHOT
    if extended or not snapshot.exists():
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        body = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        # Written whole or not at all: rerun and resume load it, and a half-written one would be a wrong config.
        tmp = snapshot.with_name(f".{snapshot.name}.{os.getpid()}.tmp")
        tmp.write_text(f"# coevo resume {cfg.experiment}\n# resolved config of this experiment (overrides applied)\n{body}")
        os.replace(tmp, snapshot)


@flow(name="self_evolution", log_prints=True)
def self_evolution(config_path: str = "configs/arith.yaml", recipe: RecipeName | None = None,
                   rounds: Annotated[int | None, Field(ge=0)] = None, backend: Backend | None = None,
                   shards: Annotated[int | None, Field(ge=1)] = None, work_pool: str | None = None,
                   more_rounds: Annotated[int | None, Field(ge=1)] = None,
                   overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """All rounds of an experiment; committed stages are skipped, so this also resumes.

    Args:
        config_path: The experiment's YAML: one of the configs `coevo serve` found.
        recipe: Which stages a round runs; blank: the config's.
        rounds: Self-improvement rounds after round 0; blank: the config's.
        backend: What samples in generate, score and evaluate; blank: the config's.
        shards: Jobs each sampling stage splits into; blank: the config's.
        work_pool: The Prefect work pool that runs the stage jobs; blank: the config's (local subprocesses
            unless it names one).
        more_rounds: Resume the stored experiment to this many rounds past its stored `rounds` (a nightly
            schedule's setting); a new experiment runs the config's rounds.
        overrides: Any other setting, KEY=VALUE as for `coevo run --set`, e.g. train_policy.steps=100.
    """
    overrides = typed_overrides(overrides, recipe=recipe, rounds=rounds, backend=backend, shards=shards,
                                work_pool=work_pool)
    cfg = _load(config_path, overrides, startable=True)
    logger = get_run_logger()
    if more_rounds is not None:
        if rounds is not None:
            raise ValueError("set rounds or more_rounds, not both")
        stored = Store.for_config(cfg).experiment_rounds(cfg.experiment)
        if stored is not None:
            overrides = [*overrides, f"rounds={stored + more_rounds}"]
            cfg = _load(config_path, overrides)
            logger.info(f"experiment {cfg.experiment}: {stored} rounds stored, resuming to {cfg.rounds}")
        else:
            logger.info(f"experiment {cfg.experiment} is new: running the config's {cfg.rounds} rounds")
    unused = get_recipe(cfg.recipe).unused(cfg)
    if unused:
        logger.warning(f"recipe {cfg.recipe} does not read these settings: {'; '.join(unused)}")
    with ExperimentLock(cfg.experiment_dir, _flow_run_id()):
        _register(cfg)
        n = Store.for_config(cfg).fail_dangling_runs(cfg.experiment)
        if n:
            logger.warning(f"marked {n} attempt(s) left running by an earlier process as failed")
        tracker = _tracker(cfg, link=True)
        summaries, index = [], RoundIndex(cfg.experiment)
        try:
            for r in range(cfg.rounds + 1):
                summaries.append(evolution_round(config_path=config_path, round=r, overrides=overrides))
                index.add(summaries[-1])
        except BaseException:
            tracker.finish("FAILED")
            raise
        tracker.finish()
        logger.info(f"experiment {cfg.experiment}: {cfg.rounds} rounds done; store {cfg.store_path}")
        return summaries


@flow(name="import_trajectories", log_prints=True)
def import_trajectories(config_path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Existing trajectories into the store: recipe `import`, whose one round (0) is the `import` stage. The
    files are the config's `imports` (`coevo import` sets them); committed imports are skipped on a rerun."""
    return self_evolution(config_path=config_path, overrides=[*(overrides or []), "recipe=import", "rounds=0"])[0]


@flow(name="run_stage", log_prints=True)
def run_stage(experiment: str, round: Round, stage: str, downstream: bool = False,
              workdir: str = "workdir") -> dict[str, Any]:
    """Rerun one stage of a round as a new attempt. Its commit marks stale what was computed from the old one:
    the round's later stages and every later round (`coevo status` shows them); `downstream` recomputes them
    now, as `coevo resume` would later.

    Args:
        experiment: An experiment of the store (the choices are those it held when `coevo serve` started).
        round: The round whose stage reruns.
        stage: The stage to rerun (the choices: the stored experiments' recipes' stages); it must be one of
            the experiment's recipe's stages in that round.
        downstream: Also recompute now what the rerun makes stale.
        workdir: The workdir that holds the experiment.
    """
    config_path = Path(workdir) / experiment / CONFIG_SNAPSHOT
    if not config_path.is_file():
        raise ValueError(f"unknown experiment {experiment!r}: no {config_path}")
    cfg = load_config(config_path)
    stages = get_recipe(cfg.recipe).round_stages(round, cfg) if 0 <= round <= cfg.rounds else []
    if not stages:
        raise ValueError(f"experiment {experiment} has rounds 0..{cfg.rounds}; round {round} does not exist")
    if stage not in stages:
        raise ValueError(f"round {round} has stages {stages}; {stage!r} is not one of them")
    store = Store.for_config(cfg)
    if store.committed_run(experiment, round, stage) is None:
        raise ValueError(f"{experiment} round {round} stage {stage} was never committed: use `coevo resume`")
    later = stages[stages.index(stage) + 1:]
    with ExperimentLock(cfg.experiment_dir, _flow_run_id()):
        tracker = _tracker(cfg)
        summary = run_round(cfg, round, tracker, only=[stage] + (later if downstream else []))
        last = max((r["round"] for r in store.stage_runs(experiment) if r["status"] == "committed"), default=round)
        if downstream:
            for r in range(round + 1, last + 1):
                summary = run_round(cfg, r, tracker)
        else:
            stale = [(r["round"], r["stage"]) for r in store.stage_runs(experiment) if r["stale"]
                     and r["status"] == "committed"]
            if stale:
                get_run_logger().info(f"{len(stale)} committed stage(s) are now stale (round {round}'s {later} and "
                                      f"every later round): `coevo resume {experiment}` or --downstream recomputes them")
        return summary


@flow(name="evaluate_model", log_prints=True)
def evaluate_model(model: str | None = None, registered: str | None = None,
                   config_path: str = "configs/arith.yaml", overrides: list[str] | None = None,
                   name: str | None = None) -> dict[str, float]:
    """Held-out accuracy of any model (HF name or local path) on a config's domain, outside the rounds.

    Runs the same `evaluate` job as a round, logs an MLflow run `eval:<name>` in the experiment
    (tag `coevo.eval`), and publishes a Prefect table artifact. The store is not touched.

    Args:
        model: A local model folder or a Hugging Face name (or a registry URI, models:/<name>@<alias>).
        registered: A model of the MLflow registry instead: models:/<name>@<alias> or models:/<name>/<version>.
        config_path: The YAML whose domain and evaluate settings are used.
        overrides: Any other setting, KEY=VALUE as for `coevo run --set`, e.g. evaluate.maj_k=8.
        name: The MLflow run's name (default: the model's last path part).
    """
    if (model is None) == (registered is None):
        raise ValueError("give one of model (a path or HF name) and registered (models:/<name>@<alias>)")
    model = model or registered
    from components.jobs.launch import evaluate_model_job

    cfg = _load(config_path, overrides)
    logger = get_run_logger()
    uri = model
    if model.startswith("models:/"):
        name = name or model.removeprefix("models:/").replace("/", "-v").replace("@", "-")
        model = str(_download_registered(cfg, model, logger.info))
    name = name or Path(model.rstrip("/")).name or model
    out_dir, metrics = evaluate_model_job(cfg, model, name, code_version=code_version(), log=logger.info)
    Tracker(cfg).log_run(f"eval:{name}", tags={"coevo.eval": name, "coevo.model": uri},
                         metrics={f"evaluate/{k}": v for k, v in metrics.items()},
                         params={"model": model, "config_hash": cfg.config_hash()})
    create_table_artifact([{"metric": k, "value": round_(v)} for k, v in sorted(metrics.items())],
                          key=artifact_key(f"{cfg.experiment}-eval-{name}"),
                          description=f"coevo: {uri} on the held-out sets of {cfg.experiment}")
    logger.info(f"{model}: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items()) if "greedy" in k)
                + f" (Parquet and manifest in {out_dir})")
    return metrics


def _download_registered(cfg: ExperimentConfig, uri: str, log: Any) -> Path:
    """A registry model's files (`models:/<name>@<alias>` or `/<version>`), under the experiment's `evals/`."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    from components.tracking import tracking_uri

    dst = cfg.experiment_dir / "evals" / "registry" / re.sub(r"[^A-Za-z0-9_.-]+", "-", uri.removeprefix("models:/"))
    shutil.rmtree(dst, ignore_errors=True)  # an alias moves: fetch what it names now
    dst.mkdir(parents=True, exist_ok=True)
    try:
        mlflow.set_registry_uri(tracking_uri(cfg))
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst),
                                                       tracking_uri=tracking_uri(cfg)))
    except MlflowException as e:
        raise ValueError(f"registered model {uri}: {e.message}") from None
    log(f"{uri}: downloaded to {got}")
    return got
