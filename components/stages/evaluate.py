"""`evaluate`: held-out greedy accuracy and maj@k of the round's policy, and with the round's reward models
best-of-N, step-level F1 against the domain's oracle, and the rest of `components.evaluation.reward_metrics`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.envs.rollout import episode_steps, is_agent
from components.stages.base import (Planner, Stage, agent_sampler, backend_metrics, backend_of, confidence_judge,
                                    domain_of, log, merged_counts, reward_model_of, reward_scores, steps_by_trajectory,
                                    write)

ROLES = ("prm", "orm", "implicit", "confidence")


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
    confidence_uri: str | None = None  # score.reward_model=confidence: this round's policy (or score.confidence_model)
    confidence_model_id: str | None = None


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
    if cfg.score.reward_model == "confidence":  # round 0 too: the policy (or score.confidence_model) scores itself
        inputs.confidence_uri, inputs.confidence_model_id = confidence_judge(cfg, policy)
    return inputs


def held_out(spec: StageSpec) -> list:
    """The held-out problems: the first `evaluate.problems_per_level` of each level's test set."""
    e, domain = spec.cfg().evaluate, domain_of(spec)
    return [p for level in (e.levels or domain.levels()) for p in domain.test_set(level)[: e.problems_per_level]]


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.evaluation import evaluate
    from components.labeling import oracle_labels

    cfg, domain, inp = spec.cfg(), domain_of(spec), spec.inputs_as(Inputs)
    e = cfg.evaluate
    problems = held_out(spec)
    if spec.shards > 1:
        mine = spec.share((p.problem_id for p in problems), "held-out problems")
        problems = [p for p in problems if p.problem_id in mine]
    roles = [role for role in ROLES if getattr(inp, f"{role}_uri")]
    best_of_n = e.best_of_n if roles else []
    curve = e.search is not None and inp.prm_uri is not None and spec.shards == 1
    n_samples = max([e.maj_k, *best_of_n, *(e.search.budgets if curve else [])])
    log("evaluate", f"{len(problems)} held-out problems at levels {e.levels or domain.levels()}: greedy + "
                    f"{n_samples} samples" + (f", reward-model best-of-{best_of_n}" if best_of_n else "")
                    + (f" (shard {spec.shard} of {spec.shards})" if spec.shards > 1 else ""))
    backend = backend_of(spec, inp.policy_uri)
    episodes: dict[str, list[dict[str, Any]]] = {}
    if is_agent(domain):
        batch, vers, episodes, stats = _episodes(spec, domain, backend, inp, problems, n_samples)
    else:
        batch, vers, _ = evaluate(
            domain, backend, problems, experiment=spec.experiment, round=spec.round,
            model_id=inp.policy_model_id, maj_k=e.maj_k, temperature=e.temperature,
            max_new_tokens=e.max_new_tokens, seed=spec.seed, n_samples=n_samples,
        )
    tables: dict[str, list[dict[str, Any]]] = dict(episodes)
    if roles:
        steps = episode_steps(episodes["turns"]) if is_agent(domain) else steps_by_trajectory(batch.steps)
        items = [{"trajectory_id": t["trajectory_id"], "problem_id": t["problem_id"],
                  "steps": steps.get(t["trajectory_id"], [])} for t in batch.trajectories]
        oracle_rows = oracle_labels(domain, {p.problem_id: p for p in problems}, [it for it in items if it["steps"]])
        score_rows = []
        for role in roles:
            score_rows += reward_scores(spec, role, getattr(inp, f"{role}_uri"), getattr(inp, f"{role}_model_id"),
                                        batch.trajectories, steps, reference_uri=inp.reference_uri,
                                        turns=episodes["turns"] if is_agent(domain) else None)
        tables |= {"scores": score_rows, "step_labels": oracle_rows}
    metrics = backend_metrics(backend) | ({f"agent_{k}": float(v) for k, v in stats.items()} if episodes else {})
    if spec.shards > 1:  # the rows are over all shards' trajectories: `merge` computes them
        write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps,
              verifications=vers, **tables)
        return metrics
    rows = evaluation_rows(spec, problems, batch.trajectories, batch.steps, vers, tables)
    if curve:
        rows += _compute_curve(spec, domain, backend, problems, batch.trajectories, vers, tables["scores"])
    elif e.search is not None:
        log("evaluate", "no compute curve: " + ("round 0 has no PRM to guide the searches" if not inp.prm_uri
                                                 else "a sharded evaluation draws none (each shard holds a part)"))
    write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps,
          verifications=vers, evaluations=rows, **tables)
    return metrics | row_metrics(rows)


def _compute_curve(spec: StageSpec, domain, backend, problems: list, trajectories: list[dict[str, Any]],
                   vers: list[dict[str, Any]], scores: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`evaluate.search`'s curve on one level, as `evaluations` rows (components/search/curves.py)."""
    from components.search.curves import compute_curve, curve_rows

    e, inp = spec.cfg().evaluate, spec.inputs_as(Inputs)
    s = e.search
    levels = sorted({p.level for p in problems})
    level = s.level if s.level is not None else max(levels)
    if level not in levels:
        raise ValueError(f"evaluate.search.level={level} is not among the evaluated levels {levels}")
    on = [p for p in problems if p.level == level][: s.problems]
    ids = {p.problem_id for p in on}
    samples: dict[str, list[dict[str, Any]]] = {}
    for t in trajectories:
        if t["problem_id"] in ids:
            samples.setdefault(t["problem_id"], []).append(t)
    steps: dict[str, list[float]] = {}
    for r in sorted(scores, key=lambda r: (r["trajectory_id"], r["step_index"])):
        if r["model_id"] == inp.prm_model_id and r["aggregate"] == "step":
            steps.setdefault(r["trajectory_id"], []).append(r["value"])
    prm_min = {t["trajectory_id"]: min(steps.get(t["trajectory_id"]) or [0.0]) for t in trajectories}
    prm = reward_model_of(spec, "prm", inp.prm_uri)
    if hasattr(backend, "progress"):
        backend.progress = False  # the searches report their points, which say more
    log("evaluate", f"compute curve on level {level} ({len(on)} problems): budgets {s.budgets}, greedy, maj, "
                    f"prm_bon, {', '.join(s.methods)}")
    searches = None
    if is_agent(domain):  # a step is a turn, drawn with what the environment answers; one turn's tokens at most
        from components.search.episodes import EpisodeSearches

        searches = EpisodeSearches(
            domain, lambda temperature, seed: agent_sampler(backend, inp.policy_uri, temperature=temperature,
                                                            top_p=1.0, max_new_tokens=e.max_new_tokens, seed=seed),
            on, prm.score_steps, temperature=e.temperature, seed=spec.seed)
    points = compute_curve(domain, backend, on, samples, {v["trajectory_id"]: bool(v["correct"]) for v in vers},
                           prm_min, prm.score_steps, budgets=s.budgets, methods=s.methods, expansions=s.expansions,
                           max_step_tokens=s.max_step_tokens, max_depth=s.max_depth, c_puct=s.c_puct,
                           temperature=e.temperature, max_new_tokens=e.max_new_tokens, seed=spec.seed,
                           progress=lambda msg: log("evaluate", msg), searches=searches)
    return curve_rows(points, experiment=spec.experiment, round=spec.round, model_id=inp.policy_model_id,
                      level=level)


def _episodes(spec: StageSpec, env, backend, inp: Inputs, problems: list, n_samples: int):
    """An environment's held-out episodes: one greedy (sample 0) and `n_samples` sampled per problem, verified by
    the loop's own outcome; returns them as a GeneratedBatch, their verifications, their turns and the loop's stats."""
    from components.envs.rollout import EpisodeBatch, episode_stats, run_episodes, verification_rows
    from components.generation import GeneratedBatch

    e = spec.cfg().evaluate
    kw = dict(experiment=spec.experiment, round=spec.round, purpose="eval", policy_model_id=inp.policy_model_id,
              max_new_tokens=e.max_new_tokens)
    runs = [(0.0, 1, spec.seed, 0)] + ([(e.temperature, n_samples, spec.seed + 1, 1)] if n_samples > 1 else [])
    batch = EpisodeBatch()
    for temperature, n, seed, first in runs:
        sampler = agent_sampler(backend, inp.policy_uri, temperature=temperature, top_p=1.0,
                                max_new_tokens=e.max_new_tokens, seed=seed)
        batch.extend(run_episodes(env, sampler, problems, n=n, seed=seed, temperature=temperature,
                                  first_sample_index=first, **kw)[0])
    t = batch.tables
    return (GeneratedBatch(t["problems"], t["trajectories"], t["steps"]),
            verification_rows(env, batch, spec.code_version or "dev"), {"turns": t["turns"]},
            episode_stats(batch.records))


def evaluation_rows(spec: StageSpec, problems: list, trajectories: list[dict[str, Any]], step_rows: list[dict[str, Any]],
                    vers: list[dict[str, Any]], tables: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The `evaluations` rows of the policy's held-out trajectories, and with the round's reward models
    (their `scores` and the oracle's `step_labels` in `tables`) best-of-N and the step-level metrics."""
    from components.evaluation import outcome_rows, reward_metrics

    cfg, domain, inp = spec.cfg(), domain_of(spec), spec.inputs_as(Inputs)
    e = cfg.evaluate
    correct = {v["trajectory_id"]: bool(v["correct"]) for v in vers}
    rows = outcome_rows(domain, problems, trajectories, correct, maj_k=e.maj_k, experiment=spec.experiment,
                        round=spec.round, model_id=inp.policy_model_id, turns=tables.get("turns"))
    roles = [role for role in ROLES if getattr(inp, f"{role}_uri")]
    if not roles:
        return rows
    steps = steps_by_trajectory(step_rows)
    oracle: dict[str, list[bool]] = {}
    for r in tables["step_labels"]:
        oracle.setdefault(r["trajectory_id"], []).append(r["value"] == 1.0)
    prm_steps, orm, weakest = None, None, {}
    for role in roles:
        got = [r for r in tables["scores"] if r["model_id"] == getattr(inp, f"{role}_model_id")]
        if role == "prm":
            prm_steps = {t["trajectory_id"]: [] for t in trajectories}
            for r in sorted(got, key=lambda r: (r["trajectory_id"], r["step_index"])):
                if r["aggregate"] == "step":
                    prm_steps[r["trajectory_id"]].append(r["value"])
        elif role == "orm":
            orm = {r["trajectory_id"]: r["value"] for r in got}
        else:  # the implicit PRM, the sampler's confidence: the weakest step ranks, as for the PRM
            weakest[role] = {r["trajectory_id"]: r["value"] for r in got if r["aggregate"] == "min"}
    have = {(r["level"], r["metric"]) for r in rows}  # maj@N and pass@N for N = maj_k are already there
    return rows + [r for r in reward_metrics(trajectories, correct, best_of_n=e.best_of_n, experiment=spec.experiment,
                                             round=spec.round, model_id=inp.policy_model_id, prm_steps=prm_steps,
                                             orm_scores=orm, implicit_scores=weakest.get("implicit"),
                                             confidence_scores=weakest.get("confidence"), oracle=oracle, steps=steps)
                   if (r["level"], r["metric"]) not in have]


def row_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    metrics = {(r["metric"] if r["level"] == -1 else f"{r['metric']}_L{r['level']}"): r["value"] for r in rows}
    log("evaluate", " ".join(f"L{r['level']}={r['value']:.2f}" for r in rows
                             if r["metric"] == "greedy_acc" and r["level"] >= 0))
    if any(k.startswith(("prm_", "orm_", "implicit_", "confidence_")) for k in metrics):
        log("evaluate", " ".join(f"{k}={metrics[k]:.3f}" for k in sorted(metrics)
                                 if k.startswith(("prm_bon", "orm_bon", "implicit_bon", "confidence_bon", "maj_at",
                                                  "prm_step_f1", "processbench")) and "_L" not in k))
    return metrics


def merge(spec: StageSpec, shard_metrics: list[dict[str, float]], read) -> tuple[dict[str, float], dict]:
    """The `evaluations` rows over every shard's trajectories (a mean of means, or an F1 of F1s, would be wrong)."""
    tables = {t: read(t) for t in ("scores", "step_labels", *(("turns",) if is_agent(domain_of(spec)) else ()))}
    rows = evaluation_rows(spec, held_out(spec), read("trajectories"), read("steps"), read("verifications"), tables)
    return merged_counts(shard_metrics) | row_metrics(rows), {"evaluations": rows}


STAGE = Stage(name="evaluate", section="evaluate", gpu=True, reads=("bootstrap", "train_policy", "train_reward"),
              writes=("problems", "trajectories", "steps", "verifications", "evaluations", "scores", "step_labels",
                      "turns"),
              inputs=Inputs, plan=plan, run=run, samples=True, merge=merge)
