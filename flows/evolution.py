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
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run as flow_run_ctx

from components import storage
from components.config import ExperimentConfig, load_config
from components.curriculum import pick_levels
from components.locking import ExperimentLock
from components.plots import accuracy_per_round, round_summary
from components.recipes import get_recipe
from components.stages import PlanningError
from components.store import Store
from components.tracking import Tracker, code_version
from tasks.stages import stage_task

CONFIG_SNAPSHOT = "config.yaml"


def _load(config_path: str, overrides: list[str] | None) -> ExperimentConfig:
    return load_config(config_path, overrides or [])


def _flow_run_id() -> str | None:
    return str(flow_run_ctx.id) if flow_run_ctx.id else None


def _tracker(cfg: ExperimentConfig) -> Tracker:
    tracker = Tracker(cfg)
    tracker.start({"config_hash": cfg.config_hash(), "rounds": str(cfg.rounds), "git_sha": code_version() or "unknown",
                   "prefect_flow_run_id": _flow_run_id() or "none", "recipe": cfg.recipe})
    return tracker


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
    levels, reason = pick_levels(rates, c.low, c.high, c.max_levels)
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
    key = re.sub(r"[^a-z0-9-]+", "-", f"{cfg.experiment}-round-{round}".lower()).strip("-")
    create_table_artifact(table, key=key, description=f"coevo {cfg.experiment} round {round}: metrics")
    plot = accuracy_per_round(evals, cfg.experiment_dir / "plots" / "accuracy_per_round.png",
                              title=f"{cfg.experiment}: held-out greedy accuracy")
    tracker.log_artifact(plot, artifact_path="plots")
    all_rounds = store.round_summary(cfg.experiment)
    tracker.log_artifact(round_summary(all_rounds, cfg.experiment_dir / "plots" / "round_summary.png",
                                       title=f"{cfg.experiment}: rounds"), artifact_path="plots")
    _trace_episodes(cfg, store, tracker, round)
    _register_models(cfg, store, tracker, round, {"policy": ("heldout_greedy_acc", s.get("greedy_acc")),
                                                   "prm": ("heldout_prm_step_f1", s.get("prm_step_f1")),
                                                   "orm": ("heldout_greedy_acc", None)})
    tracker.finish_round(round)
    return {"round": round, **{k: v for k, v in s.items() if k != "experiment_id"}}


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
def evolution_round(config_path: str, round: int, overrides: list[str] | None = None) -> dict[str, Any]:
    """One round: the recipe's stages in order (rft: generate → verify → score → filter → train_policy →
    evaluate; round 0: bootstrap → evaluate)."""
    cfg = _load(config_path, overrides)
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
def self_evolution(config_path: str, overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """All rounds of an experiment; committed stages are skipped, so this also resumes."""
    cfg = _load(config_path, overrides)
    logger = get_run_logger()
    with ExperimentLock(cfg.experiment_dir, _flow_run_id()):
        _register(cfg)
        n = Store.for_config(cfg).fail_dangling_runs(cfg.experiment)
        if n:
            logger.warning(f"marked {n} attempt(s) left running by an earlier process as failed")
        tracker = _tracker(cfg)
        summaries = []
        try:
            for r in range(cfg.rounds + 1):
                summaries.append(evolution_round(config_path=config_path, round=r, overrides=overrides))
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
def run_stage(experiment: str, round: int, stage: str, downstream: bool = False, workdir: str = "workdir") -> dict[str, Any]:
    """Rerun one stage of a round as a new attempt. Its commit marks stale what was computed from the old one:
    the round's later stages and every later round (`coevo status` shows them); `downstream` recomputes them
    now, as `coevo resume` would later."""
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
def evaluate_model(model: str, config_path: str = "configs/arith.yaml", overrides: list[str] | None = None,
                   name: str | None = None) -> dict[str, float]:
    """Held-out accuracy of any model (HF name or local path) on a config's domain, outside the rounds.

    Runs the same `evaluate` job as a round, logs an MLflow run `eval:<name>` in the experiment
    (tag `coevo.eval`), and publishes a Prefect table artifact. The store is not touched.
    """
    from components.jobs.launch import evaluate_model_job

    cfg = _load(config_path, overrides)
    logger = get_run_logger()
    name = name or Path(model.rstrip("/")).name or model
    out_dir, metrics = evaluate_model_job(cfg, model, name, code_version=code_version(), log=logger.info)
    Tracker(cfg).log_run(f"eval:{name}", tags={"coevo.eval": name, "coevo.model": model},
                         metrics={f"evaluate/{k}": v for k, v in metrics.items()},
                         params={"model": model, "config_hash": cfg.config_hash()})
    key = re.sub(r"[^a-z0-9-]+", "-", f"{cfg.experiment}-eval-{name}".lower()).strip("-")
    create_table_artifact([{"metric": k, "value": round_(v)} for k, v in sorted(metrics.items())], key=key,
                          description=f"coevo: {model} on the held-out sets of {cfg.experiment}")
    logger.info(f"{model}: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items()) if "greedy" in k)
                + f" (Parquet and manifest in {out_dir})")
    return metrics
