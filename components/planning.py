"""Which committed outputs a stage reads: the dataflow of a round, resolved against the store.

Stage jobs never open the store, so the caller resolves every input to committed Parquet paths
and model URIs here and writes them into the job's spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from components.config import ExperimentConfig
from components.jobs.spec import InputRef, StageSpec
from components.manifest import read_manifest
from components.seeding import derive_seed
from components.store import Store

# Upstream stages (same round) each stage reads.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "generate": (),
    "verify": ("generate",),
    "score": ("generate", "verify"),
    "filter": ("generate", "verify", "score"),
    "train_policy": (),
    "train_reward": ("generate", "verify", "score"),
    "evaluate": ("train_policy",),
}


class PlanningError(RuntimeError):
    """An upstream stage has no committed attempt; the stage cannot run yet."""


def round_stages(cfg: ExperimentConfig, round: int) -> list[str]:
    if round == 0:
        return ["train_policy", "evaluate"]
    stages = ["generate", "verify", "score", "filter", "train_policy", "evaluate"]
    if cfg.train_reward.enabled:
        stages.insert(stages.index("filter"), "train_reward")
    return stages


def input_ref(store: Store, experiment: str, round: int, stage: str) -> InputRef:
    run = store.committed_run(experiment, round, stage)
    if run is None:
        raise PlanningError(f"{experiment} round {round}: stage {stage!r} has no committed attempt")
    out_dir = Path(run["out_dir"])
    m = read_manifest(out_dir / "manifest.json")
    if m.sha256 != run["manifest_sha256"]:
        raise PlanningError(
            f"{out_dir}/manifest.json changed after it was committed (sha256 {m.sha256[:12]}… vs "
            f"{run['manifest_sha256'][:12]}…): the committed output was tampered with"
        )
    tables: dict[str, list[str]] = {}
    for o in m.outputs:
        tables.setdefault(o["table"], []).append(str(out_dir / o["path"]))
    return InputRef(round=round, stage=stage, stage_run_id=run["stage_run_id"], dir=str(out_dir),
                    manifest_sha256=run["manifest_sha256"], tables=tables)


def optional_model(store: Store, experiment: str, round: int, role: str) -> dict[str, Any] | None:
    try:
        return committed_model(store, experiment, round, role)
    except PlanningError:
        return None


def label_rounds(cfg: ExperimentConfig, round: int) -> list[int]:
    """Rounds whose step labels train this round's reward model: all so far, or the last `window_rounds`."""
    w = cfg.train_reward.window_rounds
    return list(range(1 if w is None else max(1, round - w + 1), round + 1))


def committed_model(store: Store, experiment: str, round: int, role: str = "policy") -> dict[str, Any]:
    rows = store.rows(
        "SELECT m.* FROM models m JOIN stage_runs s USING (stage_run_id) "
        "WHERE m.experiment_id=? AND m.round=? AND m.role=? AND s.status='committed'",
        [experiment, round, role],
    )
    if not rows:
        raise PlanningError(f"{experiment} round {round}: no committed {role} model")
    return rows[0]


def level_pass_rates(store: Store, experiment: str, round: int) -> dict[int, float]:
    rows = store.rows(
        "SELECT level, value FROM evaluations e JOIN stage_runs s USING (stage_run_id) "
        "WHERE e.experiment_id=? AND e.round=? AND metric='greedy_acc' AND level >= 0 AND s.status='committed'",
        [experiment, round],
    )
    if not rows:
        raise PlanningError(f"{experiment} round {round}: no committed evaluation to plan the curriculum from")
    return {int(r["level"]): float(r["value"]) for r in rows}


def build_spec(cfg: ExperimentConfig, store: Store, round: int, stage: str, attempt: int,
               code_version: str | None, out_dir: Path | None = None) -> StageSpec:
    exp = cfg.experiment
    out_dir = out_dir or cfg.experiment_dir / f"r{round}" / stage / f"a{attempt}"
    inputs = [input_ref(store, exp, round, s) for s in UPSTREAM[stage]]
    params: dict[str, Any] = {}
    if stage == "generate":
        levels = json.loads(store.rows("SELECT levels_json FROM round_plans WHERE experiment_id=? AND round=?",
                                       [exp, round])[0]["levels_json"])
        policy = committed_model(store, exp, round - 1)
        params |= {"levels": levels, "policy_uri": policy["uri"], "policy_model_id": policy["model_id"],
                   "problem_seeds": {str(lv): derive_seed(cfg.seed, round, "problems", lv) for lv in levels}}
        prm = optional_model(store, exp, round - 1, "prm") if cfg.generate.search is not None else None
        if prm:  # round 1 has no PRM yet: it samples plainly
            params |= {"search_prm_uri": prm["uri"], "search_prm_id": prm["model_id"]}
    elif stage == "score":
        policy = committed_model(store, exp, round - 1)
        params |= {"policy_uri": policy["uri"], "policy_model_id": policy["model_id"]}
        if cfg.score.reward_model == "implicit":
            if round > 1:  # round 1's policy is the reference itself: a log-ratio of 0 everywhere
                ref = committed_model(store, exp, 0)
                params |= {"reward_model_uri": policy["uri"], "reward_model_id": policy["model_id"],
                           "reference_uri": ref["uri"]}
        elif cfg.score.reward_model != "none":
            rm = optional_model(store, exp, round - 1, cfg.score.reward_model)
            if rm:  # round 1 has no earlier reward model: it is scored by Monte Carlo labels and outcome only
                params |= {"reward_model_uri": rm["uri"], "reward_model_id": rm["model_id"]}
    elif stage == "train_reward":
        policy = committed_model(store, exp, round - 1)
        prev = optional_model(store, exp, round - 1, "prm")
        params |= {"policy_uri": policy["uri"], "label_rounds": label_rounds(cfg, round),
                   "init_prm_uri": prev["uri"] if prev and cfg.train_reward.init == "previous" else None,
                   "parent_model_id": prev["model_id"] if prev else None}
        inputs = []
        for r in label_rounds(cfg, round):
            inputs += [input_ref(store, exp, r, s) for s in UPSTREAM[stage]]
        if cfg.train_reward.demos:
            inputs.append(input_ref(store, exp, 0, "train_policy"))
    elif stage == "train_policy":
        if round == 0:
            params["init_uri"] = cfg.policy.model
            params["parent_model_id"] = None
        else:
            parent_round = round - 1 if cfg.train_policy.init == "previous" else 0
            parent = committed_model(store, exp, parent_round)
            params["init_uri"] = parent["uri"]
            params["parent_model_id"] = parent["model_id"]
            # This round's selections are new data; earlier rounds' (demos included) are the replay pool.
            params["replay_ratio"] = cfg.train_policy.replay_ratio
            if cfg.train_policy.method != "sft":
                ref_round = round - 1 if cfg.train_policy.dpo.reference == "previous" else 0
                ref = committed_model(store, exp, ref_round)
                params |= {"dpo_reference_uri": ref["uri"], "dpo_reference_model_id": ref["model_id"]}
            inputs.append(input_ref(store, exp, 0, "train_policy"))
            for r in range(1, round + 1):
                inputs += [input_ref(store, exp, r, "generate"), input_ref(store, exp, r, "filter")]
    elif stage == "evaluate":
        policy = committed_model(store, exp, round)
        params |= {"policy_uri": policy["uri"], "policy_model_id": policy["model_id"]}
        for role in ("prm", "orm"):  # the round's reward models, for best-of-N and step-level metrics
            rm = optional_model(store, exp, round, role) if round > 0 and cfg.train_reward.enabled else None
            if rm:
                params |= {f"{role}_uri": rm["uri"], f"{role}_model_id": rm["model_id"]}
        if cfg.score.reward_model == "implicit" and round > 0:  # this round's policy against round 0's
            params |= {"implicit_uri": policy["uri"], "implicit_model_id": policy["model_id"],
                       "reference_uri": committed_model(store, exp, 0)["uri"]}
    return StageSpec(
        experiment=exp, round=round, stage=stage, attempt=attempt, out_dir=str(out_dir),
        seed=derive_seed(cfg.seed, round, stage), config=cfg.to_dict(), config_hash=cfg.config_hash(),
        code_version=code_version, inputs=inputs, params=params,
    )
