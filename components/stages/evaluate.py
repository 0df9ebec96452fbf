"""`evaluate`: held-out greedy accuracy and maj@k of the round's policy, and with the round's reward models
best-of-N, step-level F1 against the domain's oracle, and the rest of `components.evaluation.reward_metrics`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.stages.base import (Planner, Stage, backend_metrics, backend_of, domain_of, log, reward_scores,
                                   steps_by_trajectory, write)

ROLES = ("prm", "orm", "implicit")


@dataclass
class Inputs:
    policy_uri: str
    policy_model_id: str
    prm_uri: str | None = None  # the round's reward models, for best-of-N and step-level metrics
    prm_model_id: str | None = None
    orm_uri: str | None = None
    orm_model_id: str | None = None
    implicit_uri: str | None = None  # score.reward_model=implicit: this round's policy against round 0's
    implicit_model_id: str | None = None
    reference_uri: str | None = None


def plan(p: Planner) -> Inputs:
    cfg = p.cfg
    # The stage that trained the policy: its committed manifest is checked now, so an output edited
    # after its commit is refused before an attempt is recorded.
    p.read("bootstrap" if p.round == 0 else "train_policy")
    policy = p.model(p.round)
    inputs = Inputs(policy_uri=policy["uri"], policy_model_id=policy["model_id"])
    for role in ("prm", "orm"):
        rm = p.optional_model(p.round, role) if p.round > 0 and cfg.train_reward.enabled else None
        if rm:
            setattr(inputs, f"{role}_uri", rm["uri"])
            setattr(inputs, f"{role}_model_id", rm["model_id"])
    if cfg.score.reward_model == "implicit" and p.round > 0:
        inputs.implicit_uri, inputs.implicit_model_id = policy["uri"], policy["model_id"]
        inputs.reference_uri = p.model(0)["uri"]
    return inputs


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.evaluation import evaluate, reward_metrics
    from components.labeling import oracle_labels

    cfg, domain, inp = spec.cfg(), domain_of(spec), spec.inputs_as(Inputs)
    e = cfg.evaluate
    levels = e.levels or domain.levels()
    problems = [p for level in levels for p in domain.test_set(level)[: e.problems_per_level]]
    roles = [role for role in ROLES if getattr(inp, f"{role}_uri")]
    best_of_n = e.best_of_n if roles else []
    n_samples = max([e.maj_k, *best_of_n])
    log("evaluate", f"{len(problems)} held-out problems at levels {levels}: greedy + {n_samples} samples"
                    + (f", reward-model best-of-{best_of_n}" if best_of_n else ""))
    backend = backend_of(spec, inp.policy_uri)
    batch, vers, rows = evaluate(
        domain, backend, problems, experiment=spec.experiment, round=spec.round,
        model_id=inp.policy_model_id, maj_k=e.maj_k, temperature=e.temperature,
        max_new_tokens=e.max_new_tokens, seed=spec.seed, n_samples=n_samples,
    )
    tables: dict[str, list[dict[str, Any]]] = {}
    if roles:
        steps = steps_by_trajectory(batch.steps)
        correct = {v["trajectory_id"]: bool(v["correct"]) for v in vers}
        items = [{"trajectory_id": t["trajectory_id"], "problem_id": t["problem_id"],
                  "steps": steps.get(t["trajectory_id"], [])} for t in batch.trajectories]
        oracle_rows = oracle_labels(domain, {p.problem_id: p for p in problems}, [it for it in items if it["steps"]])
        oracle: dict[str, list[bool]] = {}
        for r in oracle_rows:
            oracle.setdefault(r["trajectory_id"], []).append(r["value"] == 1.0)
        score_rows, prm_steps, orm, implicit = [], None, None, None
        for role in roles:
            got = reward_scores(spec, role, getattr(inp, f"{role}_uri"), getattr(inp, f"{role}_model_id"),
                                batch.trajectories, steps, reference_uri=inp.reference_uri)
            score_rows += got
            if role == "prm":
                prm_steps = {t["trajectory_id"]: [] for t in batch.trajectories}
                for r in got:
                    if r["aggregate"] == "step":
                        prm_steps[r["trajectory_id"]].append(r["value"])
            elif role == "orm":
                orm = {r["trajectory_id"]: r["value"] for r in got}
            else:  # the weakest step ranks, as for the PRM
                implicit = {r["trajectory_id"]: r["value"] for r in got if r["aggregate"] == "min"}
        have = {(r["level"], r["metric"]) for r in rows}  # maj@N and pass@N for N = maj_k are already there
        rows += [r for r in reward_metrics(batch.trajectories, correct, best_of_n=best_of_n, experiment=spec.experiment,
                                           round=spec.round, model_id=inp.policy_model_id, prm_steps=prm_steps,
                                           orm_scores=orm, implicit_scores=implicit, oracle=oracle, steps=steps)
                 if (r["level"], r["metric"]) not in have]
        tables = {"scores": score_rows, "step_labels": oracle_rows}
    write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps,
          verifications=vers, evaluations=rows, **tables)
    metrics = backend_metrics(backend)
    for r in rows:
        key = r["metric"] if r["level"] == -1 else f"{r['metric']}_L{r['level']}"
        metrics[key] = r["value"]
    log("evaluate", " ".join(f"L{r['level']}={r['value']:.2f}" for r in rows
                             if r["metric"] == "greedy_acc" and r["level"] >= 0))
    if roles:
        log("evaluate", " ".join(f"{k}={metrics[k]:.3f}" for k in sorted(metrics)
                                 if k.startswith(("prm_bon", "orm_bon", "implicit_bon", "maj_at", "prm_step_f1",
                                                  "processbench")) and "_L" not in k))
    return metrics


STAGE = Stage(name="evaluate", section="evaluate", gpu=True, reads=("bootstrap", "train_policy", "train_reward"),
              writes=("problems", "trajectories", "steps", "verifications", "evaluations", "scores", "step_labels"),
              inputs=Inputs, plan=plan, run=run, samples=True)
