"""Stage job bodies: read committed inputs, call the stage function, hand rows to the writer.

This module and `__main__` are the only places that read and write Parquet and manifests; the stage
functions themselves (`components.generation`, `components.filtering`, ...) return data.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.domains import get_domain
from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter, sha256_dir
from components.seeding import derive_seed
from components.tables import to_table


def log(stage: str, msg: str) -> None:
    print(f"[{stage}] {msg}", flush=True)


def _domain(spec: StageSpec):
    cfg = spec.cfg()
    return get_domain(cfg.domain.name, **cfg.domain.options)


def _backend(spec: StageSpec, model_uri: str):
    from components.models.backends import get_backend

    g = spec.cfg().generate
    return get_backend(g.backend, model_uri, batch_size=g.batch_size, **g.backend_options)


def _unique(problems: list) -> list:
    """Drop repeats (a small level can have fewer distinct problems than asked for), keeping order."""
    seen: set[str] = set()
    return [p for p in problems if not (p.problem_id in seen or seen.add(p.problem_id))]


def _write(out: StageOutputWriter, **tables: list[dict[str, Any]]) -> None:
    for name, rows in tables.items():
        out.write_table(name, to_table(name, rows))


# -- stages ------------------------------------------------------------------------------

def run_generate(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.generation import generate

    cfg, domain = spec.cfg(), _domain(spec)
    levels: list[int] = spec.params["levels"]
    problems = []
    for level in levels:
        # One seed per level (the shard), so adding a level does not reshuffle the others.
        problems += domain.sample_problems(level, cfg.generate.problems_per_level,
                                           seed=spec.params["problem_seeds"][str(level)])
    problems = _unique(problems)
    g = cfg.generate
    per = (f"up to {g.samples_per_problem} samples each, {g.wave_size} per wave until {g.until_correct} right"
           if g.until_correct else f"{g.samples_per_problem} samples each")
    log("generate", f"{len(problems)} problems at levels {levels}, {per}")
    t0 = time.perf_counter()
    backend = _backend(spec, spec.params["policy_uri"])
    search = None
    if g.search is not None and "search_prm_uri" in spec.params:
        from components.rewards.prm import PRMScorer
        from components.search import prm_step_search

        scorer = PRMScorer(spec.params["search_prm_uri"])
        log("generate", f"PRM-guided steps ({spec.params['search_prm_id']}): up to {g.search.max_tries} draws "
                        f"per step, keep at P(good) >= {g.search.threshold}")

        def search(prompts, n, temperature, top_p, max_new_tokens, seed, stop=None):
            out, stats = prm_step_search(domain, backend, scorer.score_steps, prompts, n=n,
                                         max_tries=g.search.max_tries, threshold=g.search.threshold,
                                         temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                         seed=seed, max_steps=g.search.max_steps,
                                         progress=lambda msg: log("generate", msg))
            for k, v in stats.items():  # summed over waves (generate.until_correct)
                search_stats[k] = search_stats.get(k, 0) + v
            return out
    search_stats: dict[str, float] = {}
    wave_stats: dict[str, float] = {}
    kw = dict(experiment=spec.experiment, round=spec.round, purpose="train",
              policy_model_id=spec.params["policy_model_id"], temperature=g.temperature, top_p=g.top_p,
              max_new_tokens=g.max_new_tokens, sample=search)
    if g.until_correct is None:
        batch = generate(domain, backend, problems, n=g.samples_per_problem, seed=spec.seed, **kw)
    else:
        from components.generation import generate_until_correct
        from components.verification import resolve_verifier

        # The verify stage's own function, so "right" here is what it will store.
        _, verifier = resolve_verifier(domain, cfg.verify.verifier)
        batch, wave_stats = generate_until_correct(
            domain, backend, problems, verifier=verifier, want=g.until_correct, wave_size=g.wave_size,
            n=g.samples_per_problem, seed=spec.seed, progress=lambda msg: log("generate", msg), **kw)
    dt = time.perf_counter() - t0
    _write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps)
    log("generate", f"{len(batch.trajectories)} trajectories, {batch.num_tokens} tokens in {dt:.1f}s")
    metrics = {"trajectories": len(batch.trajectories), "problems": len(problems), "tokens": batch.num_tokens,
               "tokens_per_s": batch.num_tokens / max(dt, 1e-9)}
    metrics |= {f"adaptive_{k}": float(v) for k, v in wave_stats.items()}
    if search_stats:
        # Discarded step draws are generation too: v_round_summary counts them in the round's budget.
        metrics |= {f"search_{k}": float(v) for k, v in search_stats.items()}
        log("generate", f"search: {search_stats['redraws']} redrawn steps, {search_stats['discarded_tokens']} "
                        f"discarded tokens, {search_stats['accepted_below_threshold']} steps kept below threshold")
    return metrics


def run_verify(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.verification import resolve_verifier, verify

    cfg, domain = spec.cfg(), _domain(spec)
    trajs = spec.rows("generate", "trajectories")
    answers = {p["problem_id"]: p["answer"] for p in spec.rows("generate", "problems")}
    name, fn = resolve_verifier(domain, cfg.verify.verifier)
    rows = verify(trajs, answers, fn, name=name, version=spec.code_version or "dev")
    _write(out, verifications=rows)
    n_ok = sum(1 for r in rows if r["correct"])
    metrics: dict[str, float] = {"verified": len(rows), "pass_rate": n_ok / max(len(rows), 1)}
    level_of = {t["trajectory_id"]: t["level"] for t in trajs}
    for level in sorted(set(level_of.values())):
        sub = [r for r in rows if level_of[r["trajectory_id"]] == level]
        metrics[f"pass_rate_L{level}"] = sum(1 for r in sub if r["correct"]) / len(sub)
    log("verify", f"{n_ok}/{len(rows)} correct")
    return metrics


def _steps_by_trajectory(steps: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in sorted(steps, key=lambda r: (r["trajectory_id"], r["step_index"])):
        out.setdefault(r["trajectory_id"], []).append(r["text"])
    return out


def _problems(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from components.domains.base import Problem

    return {p["problem_id"]: Problem(p["problem_id"], p["domain"], p["level"], p["prompt"], p["answer"])
            for p in rows}


def reward_model_scores(role: str, uri: str, model_id: str, trajs: list[dict[str, Any]],
                        steps: dict[str, list[str]], reference_uri: str | None = None,
                        beta: float = 0.05) -> list[dict[str, Any]]:
    """`scores` rows of a PRM or the implicit PRM (every step, plus min/last/mean) or an ORM (the
    whole trajectory). The implicit PRM is the policy at `uri` against the one at `reference_uri`."""
    from components.scoring import step_score_rows, trajectory_score_rows

    tids = [t["trajectory_id"] for t in trajs]
    if role == "implicit":
        from components.rewards.implicit import implicit_step_rewards

        if reference_uri is None:
            raise ValueError("reward_model_scores: the implicit PRM needs a reference model")
        values = implicit_step_rewards(uri, reference_uri, [t["prompt"] for t in trajs], [steps.get(t, []) for t in tids],
                                       beta=beta)
        return step_score_rows(tids, values, "implicit", model_id)
    if role == "prm":
        from components.rewards.prm import PRMScorer

        values = PRMScorer(uri).score_steps([t["prompt"] for t in trajs], [steps.get(t, []) for t in tids])
        return step_score_rows(tids, values, "prm", model_id)
    from components.rewards.orm import ORMScorer

    values = ORMScorer(uri).score([t["prompt"] for t in trajs], [t["completion"] for t in trajs])
    return trajectory_score_rows(tids, values, "orm", model_id)


def run_score(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.labeling import mc_first_error_labels, mc_step_labels, oracle_labels
    from components.scoring import choose_for_mc, outcome_scores, plan_first_error

    cfg, domain = spec.cfg(), _domain(spec)
    sc = cfg.score
    trajs = spec.rows("generate", "trajectories")
    vers = spec.rows("verify", "verifications")
    steps = _steps_by_trajectory(spec.rows("generate", "steps"))
    problems = _problems(spec.rows("generate", "problems"))
    rows = outcome_scores(vers)
    labels: list[dict[str, Any]] = []
    metrics: dict[str, float] = {"scored": len(trajs)}
    items = [{"trajectory_id": t["trajectory_id"], "problem_id": t["problem_id"], "prompt": t["prompt"],
              "steps": steps.get(t["trajectory_id"], []), "answer_ref": problems[t["problem_id"]].answer}
             for t in trajs]
    if sc.mc_rollouts:
        correct = {v["trajectory_id"]: v["correct"] for v in vers}
        if sc.mc_strategy == "first_error":
            chosen, alive = plan_first_error(trajs, correct, sc.mc_max_trajectories, spec.seed, sc.mc_search_unsolved)
            for it in items:
                it["root_alive"] = it["problem_id"] in alive
        else:
            chosen = set(choose_for_mc(trajs, correct, sc.mc_max_trajectories, spec.seed))
        todo = [it for it in items if it["trajectory_id"] in chosen]
        log("score", f"Monte Carlo labels ({sc.mc_strategy}): {len(todo)} trajectories, k={sc.mc_rollouts} rollouts "
                     "per step prefix")
        t0 = time.perf_counter()
        label_fn = mc_first_error_labels if sc.mc_strategy == "first_error" else mc_step_labels
        mc, stats = label_fn(domain, _backend(spec, spec.params["policy_uri"]), todo, k=sc.mc_rollouts,
                                   temperature=sc.mc_temperature,
                                   max_new_tokens=sc.mc_max_new_tokens or cfg.generate.max_new_tokens, seed=spec.seed)
        labels += mc
        metrics |= {f"mc_{k}": float(v) for k, v in stats.items()} | {"mc_seconds": time.perf_counter() - t0}
        log("score", f"{stats['rollouts']} rollouts from {stats['unique_prefixes']} distinct prefixes, "
                     f"{stats['generated_tokens']} tokens")
    if sc.oracle_labels:
        oracle = oracle_labels(domain, problems, [it for it in items if it["steps"]])
        labels += oracle  # for evaluation only: train_reward reads Monte Carlo sources alone
        metrics["oracle_labelled_steps"] = len(oracle)
    if "reward_model_uri" in spec.params:
        rm_rows = reward_model_scores(cfg.score.reward_model, spec.params["reward_model_uri"],
                                      spec.params["reward_model_id"], trajs, steps,
                                      reference_uri=spec.params.get("reference_uri"), beta=sc.implicit_beta)
        rows += rm_rows
        mins = [r["value"] for r in rm_rows if r["aggregate"] in ("min", "outcome") and r["step_index"] == -1]
        metrics["rm_mean_score"] = sum(mins) / max(len(mins), 1)
        log("score", f"{cfg.score.reward_model} {spec.params['reward_model_id']} scored {len(trajs)} trajectories")
    _write(out, scores=rows, step_labels=labels)
    metrics["mean_outcome"] = sum(r["value"] for r in rows if r["scorer"] == "outcome") / max(len(trajs), 1)
    return metrics


def run_filter(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.filtering import dpo_pairs, rft_filter
    from components.reward_eval import repeated_step_rate

    cfg = spec.cfg()
    f = cfg.filter
    trajs = spec.rows("generate", "trajectories")
    correct = {v["trajectory_id"]: v["correct"] for v in spec.rows("verify", "verifications")}
    scores, source = _ranking_scores(spec, f.rank_by)
    steps_ok: dict[str, bool | None] | None = None
    if f.check_steps:
        domain = _domain(spec)
        steps_ok = {t["trajectory_id"]: domain.check_steps(t["prompt"], t["completion"]) for t in trajs}
    bad: set[str] = set()
    if f.drop_mc_bad_steps:
        bad |= {lab["trajectory_id"] for lab in spec.rows("score", "step_labels")
                if lab["source"] == "mc_hard" and lab["value"] == 0.0}
    if f.min_step_score is not None:
        bad |= {s["trajectory_id"] for s in spec.rows("score", "scores") if s["scorer"] == "prm"
                and s["aggregate"] == "min" and s["value"] < f.min_step_score}
    if bad:
        steps_ok = {t["trajectory_id"]: (steps_ok or {}).get(t["trajectory_id"]) is not False
                    and t["trajectory_id"] not in bad for t in trajs}
    rows = rft_filter(trajs, correct, scores, experiment=spec.experiment, round=spec.round,
                      dedup=f.dedup, max_per_problem=f.max_per_problem, steps_ok=steps_ok)
    n_sel = sum(r["selected"] for r in rows)
    metrics: dict[str, float] = {"selected": n_sel, "considered": len(rows), "selected_fraction": n_sel / max(len(rows), 1)}
    if f.dpo_pairs:
        eligible = {t["trajectory_id"]: (steps_ok or {}).get(t["trajectory_id"]) is not False for t in trajs}
        pairs = dpo_pairs(trajs, correct, scores, experiment=spec.experiment, round=spec.round,
                          max_pairs_per_problem=f.max_pairs_per_problem, eligible=eligible)
        rows += pairs
        metrics["dpo_pairs"] = len(pairs) // 2
    # Reward-hacking monitor: what the filter keeps should not drift longer or repetitive round to round.
    by_id = {t["trajectory_id"]: t for t in trajs}
    kept = [by_id[r["trajectory_id"]] for r in rows if r["selected"] and r["purpose"] == "policy_sft"]
    if kept:
        metrics["selected_mean_tokens"] = sum(t["num_tokens"] for t in kept) / len(kept)
        steps = _steps_by_trajectory(spec.rows("generate", "steps"))
        metrics["selected_repeated_step_rate"] = repeated_step_rate([steps.get(t["trajectory_id"], []) for t in kept])
        ranked = [scores[t["trajectory_id"]] for t in kept if t["trajectory_id"] in scores]
        if source != "outcome" and ranked:
            metrics["selected_mean_rank_score"] = sum(ranked) / len(ranked)
    _write(out, selections=rows)
    log("filter", f"selected {n_sel} of {len(trajs)} trajectories for policy_sft, ranked by {source}"
                  + (f"; {metrics['dpo_pairs']:.0f} DPO pairs" if f.dpo_pairs else ""))
    return metrics


def _ranking_scores(spec: StageSpec, aggregate: str) -> tuple[dict[str, float], str]:
    """What ranks trajectories: the reward model's aggregate where the score stage has one, else the
    mean Monte Carlo value of the steps (round 1 of coevo), else the verifier outcome."""
    scores = spec.rows("score", "scores")
    for scorer in ("prm", "implicit", "orm"):
        agg = "outcome" if scorer == "orm" else aggregate
        got = {s["trajectory_id"]: s["value"] for s in scores
               if s["scorer"] == scorer and s["step_index"] == -1 and s["aggregate"] == agg}
        if got:
            return got, f"{scorer} {agg}"
    mc: dict[str, list[float]] = {}
    for lab in spec.rows("score", "step_labels"):
        if lab["source"] == "mc_soft":
            mc.setdefault(lab["trajectory_id"], []).append(lab["value"])
    if mc:
        return {t: sum(v) / len(v) for t, v in mc.items()}, "mc_soft mean"
    return {s["trajectory_id"]: s["value"] for s in scores if s["scorer"] == "outcome"}, "outcome"


def run_train_reward(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    """The round's PRM on the Monte Carlo labels of `label_rounds`, and optionally an ORM on outcomes."""
    from components.labeling import prm_examples
    from components.rewards.prm import PRMParams, train_prm

    cfg = spec.cfg()
    tr = cfg.train_reward
    rounds: list[int] = spec.params["label_rounds"]
    examples, decisions, outcome_examples, labelled_round = [], [], [], {}
    for r in rounds:
        trajs = spec.rows("generate", "trajectories", round=r)
        steps = _steps_by_trajectory(spec.rows("generate", "steps", round=r))
        labels: dict[str, dict[int, dict[str, float]]] = {}
        for lab in spec.rows("score", "step_labels", round=r):
            labels.setdefault(lab["trajectory_id"], {}).setdefault(lab["step_index"], {})[lab["source"]] = lab["value"]
        prior: dict[str, list[float]] = {}
        for sc in sorted(spec.rows("score", "scores", round=r), key=lambda x: x["step_index"]):
            if sc["scorer"] == "prm" and sc["aggregate"] == "step":
                prior.setdefault(sc["trajectory_id"], []).append(sc["value"])
        items = [{"trajectory_id": t["trajectory_id"], "prompt": t["prompt"], "steps": steps.get(t["trajectory_id"], [])}
                 for t in sorted(trajs, key=lambda t: t["trajectory_id"])]
        ex, dec = prm_examples(items, labels, source=tr.label_source, soft_threshold=tr.soft_threshold,
                               prior_scores=prior, consensus=tr.consensus_filter)
        examples += ex
        labelled_round |= {e["trajectory_id"]: r for e in ex}
        if r == spec.round:  # each trajectory's decision is made once, in its own round
            decisions = [d | {"experiment_id": spec.experiment, "round": r, "purpose": "reward_train",
                              "rank": None, "pair_id": None} for d in dec]
        if tr.orm:
            correct = {v["trajectory_id"]: v["correct"] for v in spec.rows("verify", "verifications", round=r)}
            outcome_examples += [{"prompt": t["prompt"], "completion": t["completion"], "label": bool(correct[t["trajectory_id"]]),
                                  "trajectory_id": t["trajectory_id"], "round": r}
                                 for t in trajs if correct.get(t["trajectory_id"]) is not None]
    if not examples:
        raise RuntimeError(f"{spec.stage_run_id}: no Monte Carlo step labels in rounds {rounds}; "
                           "is score.mc_rollouts > 0?")
    n_demos = 0
    if tr.demos:  # gold solutions: every step good
        domain, seen = _domain(spec), {(e["prompt"], tuple(e["completions"])) for e in examples}
        for tid, t in sorted(_selected(spec, 0).items()):
            steps = domain.split_steps(t["completion"])
            if steps and (t["prompt"], tuple(steps)) not in seen:
                seen.add((t["prompt"], tuple(steps)))
                examples.append({"prompt": t["prompt"], "completions": steps, "labels": [True] * len(steps),
                                 "trajectory_id": tid})
                labelled_round[tid] = 0
                n_demos += 1
    n_steps = sum(v is not None for e in examples for v in e["labels"])  # None: a step without a label
    n_good = sum(v is True for e in examples for v in e["labels"])
    init = spec.params.get("init_prm_uri")
    demo_note = f", {n_demos} of them round-0 demonstrations" if n_demos else ""
    log("train_reward", f"PRM on {len(examples)} trajectories ({n_steps} labelled steps, {n_good / n_steps:.0%} good) "
                        f"from rounds {rounds}{demo_note}; {tr.head} head, "
                        f"init {'previous PRM' if init else 'policy backbone'}")
    model_dir = out.artifact_dir("prm")
    prm_metrics = train_prm(spec.params["policy_uri"], examples, str(model_dir),
                            PRMParams(max_steps=tr.steps, batch_size=tr.batch_size, learning_rate=tr.learning_rate,
                                      seed=spec.seed, head=tr.head, lm_weight=tr.lm_weight), init_from_prm=init)
    log("train_reward", f"PRM loss {prm_metrics['first_loss']:.4f} -> {prm_metrics['final_loss']:.4f} "
                        f"in {prm_metrics['runtime_s']:.1f}s")
    models = [_model_row(spec, "prm", model_dir, "prm", spec.params.get("parent_model_id"), len(examples))]
    inputs = [_model_input(spec, "prm", e["trajectory_id"], labelled_round[e["trajectory_id"]]) for e in examples]
    metrics = {f"prm_{k}": v for k, v in prm_metrics.items() if isinstance(v, (int, float))}
    metrics |= {"label_good_fraction": n_good / n_steps, "demo_examples": n_demos, "consensus_dropped":
                sum(1 for d in decisions if d["reason"].startswith("consensus"))}
    if tr.orm:
        from components.rewards.orm import ORMParams, train_orm

        orm_dir = out.artifact_dir("orm")
        orm_metrics = train_orm(spec.params["policy_uri"], outcome_examples, str(orm_dir),
                                ORMParams(max_steps=tr.orm_steps, seed=spec.seed))
        log("train_reward", f"ORM on {orm_metrics['pairs']} pairs: loss {orm_metrics['final_loss']:.4f}")
        models.append(_model_row(spec, "orm", orm_dir, "orm", None, len(outcome_examples)))
        inputs += [_model_input(spec, "orm", e["trajectory_id"], e["round"]) for e in outcome_examples]
        metrics |= {f"orm_{k}": v for k, v in orm_metrics.items() if isinstance(v, (int, float))}
    _write(out, models=models, model_inputs=inputs, selections=decisions)
    return {k: float(v) for k, v in metrics.items()}


def _model_row(spec: StageSpec, role: str, model_dir: Path, artifact: str, parent: str | None,
               train_examples: int) -> dict[str, Any]:
    return {"model_id": _model_id(spec, role), "experiment_id": spec.experiment, "role": role, "round": spec.round,
            "uri": str(Path(spec.out_dir) / artifact), "sha256": sha256_dir(model_dir), "parent_model_id": parent,
            "train_examples": train_examples, "mlflow_run_id": None, "registered_name": None,
            "registered_version": None}


def _model_input(spec: StageSpec, role: str, trajectory_id: str, source_round: int) -> dict[str, Any]:
    use = "new" if source_round == spec.round else "replay"
    return {"model_id": _model_id(spec, role), "trajectory_id": trajectory_id, "source_round": source_round, "use": use}


def _bootstrap_examples(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Gold demonstrations for round 0, stored as trajectories (purpose='demo') for lineage."""
    from components.generation import problem_row, trajectory_id

    cfg, domain = spec.cfg(), _domain(spec)
    b = cfg.bootstrap
    problems = []
    for level in b.levels:
        problems += domain.sample_problems(level, b.problems_per_level, seed=derive_seed(spec.seed, 0, "demo", level))
    n_seed_total = round(len(problems) * b.seed_fraction / max(1.0 - b.seed_fraction, 1e-9))
    per_seed_level = n_seed_total // max(len(b.seed_levels), 1)
    for level in b.seed_levels:
        problems += domain.sample_problems(level, per_seed_level, seed=derive_seed(spec.seed, 0, "seed_demo", level))
    trajs, sels = [], []
    for p in _unique(problems):
        tid = trajectory_id(spec.experiment, spec.round, "demo", p.problem_id, 0)
        completion = domain.reference_solution(p)
        trajs.append({
            "trajectory_id": tid, "experiment_id": spec.experiment, "round": spec.round, "purpose": "demo",
            "problem_id": p.problem_id, "level": p.level, "policy_model_id": None, "sample_index": 0,
            "prompt": p.prompt, "completion": completion, "answer": p.answer, "num_tokens": 0,
            "finish_reason": "reference", "temperature": None, "top_p": None, "max_new_tokens": None, "seed": None,
        })
        sels.append({"trajectory_id": tid, "experiment_id": spec.experiment, "round": spec.round,
                     "purpose": "policy_sft", "selected": True, "rank": 0, "reason": "gold demonstration",
                     "pair_id": None})
    return [problem_row(p, "train") for p in _unique(problems)], trajs, sels


def run_train_policy(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.models.tiny import TinyLlamaConfig, create_tiny_llama
    from components.training.sft import SFTParams, train_sft

    cfg = spec.cfg()
    model_dir = out.artifact_dir("model")
    init_uri: str | None = spec.params.get("init_uri")
    extra: dict[str, list[dict[str, Any]]] = {}
    if spec.round == 0:
        problems, trajs, sels = _bootstrap_examples(spec)
        extra = {"problems": problems, "trajectories": trajs, "selections": sels,
                 "model_inputs": [{"model_id": _model_id(spec), "trajectory_id": t["trajectory_id"],
                                   "source_round": 0, "use": "new"} for t in trajs]}
        examples = [{"prompt": t["prompt"], "completion": t["completion"]} for t in trajs]
        steps, batch, lr = cfg.bootstrap.steps, cfg.bootstrap.batch_size, cfg.bootstrap.learning_rate
        if init_uri is None:
            init_dir = out.artifact_dir("init_model")  # kept: the random init is part of the lineage
            tiny = TinyLlamaConfig(**cfg.policy.tiny.model_dump())
            init_uri = str(create_tiny_llama(tiny, init_dir, seed=spec.seed))
            log("train_policy", f"created a from-scratch tiny Llama at {init_uri}")
    else:
        new = _selected(spec, spec.round)
        pool = {tid: t for r in range(spec.round) for tid, t in _selected(spec, r).items() if tid not in new}
        n_replay = min(len(pool), round(spec.params["replay_ratio"] * len(new)))
        replay = random.Random(spec.seed).sample(sorted(pool), n_replay)
        chosen = [(tid, new[tid], "new") for tid in sorted(new)] + [(tid, pool[tid], "replay") for tid in replay]
        examples = [{"prompt": t["prompt"], "completion": t["completion"]} for _, t, _ in chosen]
        extra["model_inputs"] = [{"model_id": _model_id(spec), "trajectory_id": tid, "source_round": t["round"],
                                  "use": use} for tid, t, use in chosen]
        log("train_policy", f"{len(new)} new selections + {n_replay} replayed from {len(pool)} earlier ones")
        tp = cfg.train_policy
        steps, batch, lr = tp.steps, tp.batch_size, tp.learning_rate
        if tp.epochs is not None:
            steps = min(steps, math.ceil(tp.epochs * len(examples) / batch))
    if not examples and spec.round == 0:
        raise RuntimeError(f"{spec.stage_run_id}: the bootstrap has no demonstrations; nothing to train on")
    if not examples:
        # A round that kept nothing (no sample was right) carries its policy forward unchanged,
        # as ReST does, instead of failing the experiment; the next round samples again.
        log("train_policy", "WARNING: no trajectory was selected this round; the policy carries over unchanged")
        steps = 0
    method = cfg.train_policy.method if spec.round > 0 else "sft"
    pairs, pair_inputs = _round_pairs(spec) if method != "sft" else ([], [])
    metrics: dict[str, Any] = {}
    dpo_from = init_uri
    if method != "dpo":
        # SFT first; with pairs to follow, its model is kept as an artifact of its own (lineage).
        sft_dir = model_dir if method == "sft" or not pairs else out.artifact_dir("sft_model")
        log("train_policy", f"SFT on {len(examples)} examples, {steps} steps of batch {batch}, from {init_uri}")
        if steps > 0:
            metrics = train_sft(init_uri, examples, str(sft_dir),
                                SFTParams(max_steps=steps, batch_size=batch, learning_rate=lr, seed=spec.seed),
                                progress_callback=_train_progress)
        else:
            _copy_model(init_uri, sft_dir)
            metrics = {"train_loss": float("nan"), "steps": 0}
        dpo_from = str(sft_dir)
    if method != "sft":
        # Under 'dpo' the SFT selections trained nothing; under 'sft+dpo' a chosen side is often an SFT example too.
        sft_inputs = extra["model_inputs"] if method == "sft+dpo" else []
        known = {m["trajectory_id"] for m in sft_inputs}
        extra["model_inputs"] = sft_inputs + [m for m in pair_inputs if m["trajectory_id"] not in known]
        if pairs:
            from components.training.dpo import DPOParams, train_dpo

            d = cfg.train_policy.dpo
            log("train_policy", f"DPO on {len(pairs)} pairs, {d.steps} steps, beta {d.beta}, from {dpo_from}, "
                                f"reference {spec.params['dpo_reference_model_id']}")
            dpo = train_dpo(dpo_from, spec.params["dpo_reference_uri"], pairs, str(model_dir),
                            DPOParams(max_steps=d.steps, batch_size=d.batch_size, learning_rate=d.learning_rate,
                                      beta=d.beta, sft_weight=d.sft_weight, seed=spec.seed),
                            progress_callback=_train_progress)
            metrics |= {f"dpo_{k}": v for k, v in dpo.items()}
        elif method == "dpo":
            log("train_policy", "WARNING: no DPO pair this round; the policy carries over unchanged")
            _copy_model(init_uri, model_dir)
    final_uri = str(Path(spec.out_dir) / "model")
    model_id = _model_id(spec)
    models = [{
        "model_id": model_id, "experiment_id": spec.experiment, "role": "policy", "round": spec.round,
        "uri": final_uri, "sha256": sha256_dir(model_dir), "parent_model_id": spec.params.get("parent_model_id"),
        "train_examples": len(extra["model_inputs"]), "mlflow_run_id": None, "registered_name": None,
        "registered_version": None,
    }]
    _write(out, models=models, **extra)
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))} | {"examples": len(examples),
                                                                                      "dpo_pairs": len(pairs)}


def _model_id(spec: StageSpec, role: str = "policy") -> str:
    return f"{spec.experiment}/{role}/r{spec.round}"


def _selected(spec: StageSpec, round: int) -> dict[str, dict[str, Any]]:
    """Trajectories selected for policy SFT in `round` (round 0: the demos train_policy stored)."""
    src_t, src_s = ("train_policy", "train_policy") if round == 0 else ("generate", "filter")
    trajs = {t["trajectory_id"]: t for t in spec.rows(src_t, "trajectories", round=round)}
    return {s["trajectory_id"]: trajs[s["trajectory_id"]] for s in spec.rows(src_s, "selections", round=round)
            if s["selected"] and s["purpose"] == "policy_sft"}


def _round_pairs(spec: StageSpec) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """This round's DPO pairs ({"prompt", "chosen", "rejected"}) and their `model_inputs` rows."""
    trajs = {t["trajectory_id"]: t for t in spec.rows("generate", "trajectories")}
    sides: dict[str, dict[str, str]] = {}
    for s in spec.rows("filter", "selections"):
        if s["selected"] and s["purpose"] in ("dpo_chosen", "dpo_rejected"):
            sides.setdefault(s["pair_id"], {})[s["purpose"]] = s["trajectory_id"]
    pairs, inputs = [], []
    for pid in sorted(sides):
        c, r = trajs[sides[pid]["dpo_chosen"]], trajs[sides[pid]["dpo_rejected"]]
        pairs.append({"prompt": c["prompt"], "chosen": c["completion"], "rejected": r["completion"]})
        inputs += [{"model_id": _model_id(spec), "trajectory_id": t["trajectory_id"], "source_round": spec.round,
                    "use": use} for t, use in ((c, "dpo_chosen"), (r, "dpo_rejected"))]
    return pairs, inputs


def _train_progress(step: int, total: int, loss: float | None) -> None:
    loss_s = f", loss {loss:.4f}" if loss is not None else ""
    log("train_policy", f"step {step}/{total}{loss_s}")


def _copy_model(uri: str, dest: Path) -> None:
    from components.models.tiny import load_policy

    model, tok = load_policy(uri)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)


def run_evaluate(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.evaluation import evaluate, reward_metrics
    from components.labeling import oracle_labels

    cfg, domain = spec.cfg(), _domain(spec)
    e = cfg.evaluate
    levels = e.levels or domain.levels()
    problems = [p for level in levels for p in domain.test_set(level)[: e.problems_per_level]]
    has_rm = any(f"{role}_uri" in spec.params for role in ("prm", "orm", "implicit"))
    best_of_n = e.best_of_n if has_rm else []
    n_samples = max([e.maj_k, *best_of_n])
    log("evaluate", f"{len(problems)} held-out problems at levels {levels}: greedy + {n_samples} samples"
                    + (f", reward-model best-of-{best_of_n}" if best_of_n else ""))
    batch, vers, rows = evaluate(
        domain, _backend(spec, spec.params["policy_uri"]), problems, experiment=spec.experiment, round=spec.round,
        model_id=spec.params["policy_model_id"], maj_k=e.maj_k, temperature=e.temperature,
        max_new_tokens=e.max_new_tokens, seed=spec.seed, n_samples=n_samples,
    )
    tables: dict[str, list[dict[str, Any]]] = {}
    if has_rm:
        steps = _steps_by_trajectory(batch.steps)
        correct = {v["trajectory_id"]: bool(v["correct"]) for v in vers}
        items = [{"trajectory_id": t["trajectory_id"], "problem_id": t["problem_id"],
                  "steps": steps.get(t["trajectory_id"], [])} for t in batch.trajectories]
        oracle_rows = oracle_labels(domain, {p.problem_id: p for p in problems}, [it for it in items if it["steps"]])
        oracle: dict[str, list[bool]] = {}
        for r in oracle_rows:
            oracle.setdefault(r["trajectory_id"], []).append(r["value"] == 1.0)
        score_rows, prm_steps, orm, implicit = [], None, None, None
        for role in ("prm", "orm", "implicit"):
            if f"{role}_uri" in spec.params:
                got = reward_model_scores(role, spec.params[f"{role}_uri"], spec.params[f"{role}_model_id"],
                                          batch.trajectories, steps, reference_uri=spec.params.get("reference_uri"),
                                          beta=cfg.score.implicit_beta)
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
                               round=spec.round, model_id=spec.params["policy_model_id"], prm_steps=prm_steps,
                               orm_scores=orm, implicit_scores=implicit, oracle=oracle, steps=steps)
                 if (r["level"], r["metric"]) not in have]
        tables = {"scores": score_rows, "step_labels": oracle_rows}
    _write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps,
           verifications=vers, evaluations=rows, **tables)
    metrics = {}
    for r in rows:
        key = r["metric"] if r["level"] == -1 else f"{r['metric']}_L{r['level']}"
        metrics[key] = r["value"]
    log("evaluate", " ".join(f"L{r['level']}={r['value']:.2f}" for r in rows
                             if r["metric"] == "greedy_acc" and r["level"] >= 0))
    if has_rm:
        log("evaluate", " ".join(f"{k}={metrics[k]:.3f}" for k in sorted(metrics)
                                 if k.startswith(("prm_bon", "orm_bon", "implicit_bon", "maj_at", "prm_step_f1", "processbench")) and "_L" not in k))
    return metrics


STAGE_JOBS: dict[str, Callable[[StageSpec, StageOutputWriter], dict[str, float]]] = {
    "generate": run_generate,
    "verify": run_verify,
    "score": run_score,
    "train_reward": run_train_reward,
    "filter": run_filter,
    "train_policy": run_train_policy,
    "evaluate": run_evaluate,
}
