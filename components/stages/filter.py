"""`filter`: choose what the policy trains on (the ranker): right answers, deduplicated, ranked by the
reward model where the round has one, judged step by step (filter.min_step_score, by the previous round's PRM or
with filter.judge=round this round's), and optionally DPO pairs; with filter.hindsight, wrong episodes relabeled
with the task they solved, and with filter.variants right ones posed again with other constants, stored as
trajectories of their own; with filter.max_per_value, at most so many of one
constant of a template; under recipe grpo, each rollout's advantage and the groups that train."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.domains.base import step_verdicts
from components.stages.base import Planner, Stage, domain_of, log, steps_by_trajectory, write

# Reward models rank in this order where a round has several; a user's reward model (dotted path) after them.
RANKERS = ("prm", "implicit", "confidence", "orm")


@dataclass
class Inputs:  # and this round's committed generate, verify and (where the recipe runs it) score outputs
    # filter.hindsight, filter.variants: the policy that sampled the round, whose chat template measures a replayed
    # episode against train_policy.max_length (its observations are the new task's, and can be longer)
    policy_uri: str | None = None


def plan(p: Planner) -> Inputs:
    for stage in ("generate", "verify", "score"):
        if stage in p.round_stages:
            p.read(stage)
    if p.cfg.filter.judges_in_round:  # the judge: this round's PRM, trained without the round's right answers
        p.read("train_reward")
    return Inputs(p.model(p.round - 1)["uri"] if p.cfg.filter.replays else None)


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.filtering import (cap_per_value, dpo_pairs, judge_catch_rates, judge_ranking, judge_threshold,
                                      rft_filter, step_pair_selections, step_rejects)
    from components.reward_eval import repeated_step_rate
    from components.scoring import outcome_scores

    cfg = spec.cfg()
    f = cfg.filter
    trajs = spec.rows("generate", "trajectories")
    vers = spec.rows("verify", "verifications")
    if cfg.train_policy.method == "grpo":
        return grpo_groups(spec, out, trajs, spec.rows("score", "scores") if spec.has("score") else outcome_scores(vers))
    correct = {v["trajectory_id"]: v["correct"] for v in vers}
    scored = spec.has("score")
    score_rows = spec.rows("score", "scores") if scored else outcome_scores(vers)
    labels = spec.rows("score", "step_labels") if scored else []
    scores, source = ranking_scores(score_rows, labels, f.rank_by)
    judge_rows = spec.rows("train_reward", "scores") if f.judges_in_round else []
    if judge_rows:  # the round's right answers are ranked by the judge too, the PRM that never trained on them
        judged_scores, _ = ranking_scores(judge_rows, [], f.rank_by)
        scores, source = scores | judged_scores, f"judge {f.rank_by} (right answers)"
    domain = domain_of(spec)
    checker = step_verdicts(domain, trajs, episode_turns(spec, domain))
    has_checker = any(v is not None for v in checker.values())
    mc_dead: dict[str, int] = {}
    if f.drop_mc_bad_steps:
        for lab in sorted(labels, key=lambda r: r["step_index"]):
            if lab["source"] == "mc_hard" and lab["value"] == 0.0:
                mc_dead.setdefault(lab["trajectory_id"], lab["step_index"])
    if f.judges_in_round:  # this round's PRM, which never trained on the round's right answers
        judge_name, prm_min = "prm", step_judge(judge_rows, "judge")[1]
    else:  # the score stage's: the previous round's PRM, the implicit PRM or the sampler's confidence
        judge_name, prm_min = step_judge(score_rows)
    ids = [t["trajectory_id"] for t in trajs]
    weakest = {t: prm_min[t] for t in ids if correct.get(t) and t in prm_min}  # the judge's view of the right answers
    threshold = judge_threshold(list(weakest.values()), f.min_step_score, f.judge_max_drop)  # calibrated on them
    second: dict[str, float] = {}  # filter.judge=round_and_previous: the previous round's PRM must agree
    if f.judge == "round_and_previous":
        second = {t: v for t, v in step_judge(score_rows, "prm")[1].items() if t in weakest}  # none in round 1
    second_threshold = judge_threshold(list(second.values()), f.min_step_score, f.judge_max_drop)
    opinions = {"prm_min": prm_min, "min_step_score": threshold, "judge": judge_name, "second": second,
                "second_threshold": second_threshold}
    # The learned judges (Monte Carlo labels, the step reward model) apart from the checker, to measure them by it.
    judged = step_rejects(ids, mc_dead_step=mc_dead, **opinions)
    hindsight: dict[str, list[dict[str, Any]]] = {}
    sources: dict[str, str] = {}
    if f.replays:  # wrong episodes relabeled with the task they solved, right ones posed again: they join the right
        hindsight, sources = relabeled(spec, domain, trajs, correct)
        correct = correct | {t: True for t in sources}
    purpose = {t["trajectory_id"]: t["purpose"] for t in hindsight.get("trajectories", [])}
    considered = trajs + hindsight.get("trajectories", [])
    # filter.check_steps checks a replayed episode too, on its turns as replayed (the judges' metrics, below, read
    # the sampled ones alone).
    checked = None
    if f.check_steps:
        checked = checker | (step_verdicts(domain, hindsight["trajectories"], hindsight["turns"]) if hindsight else {})
    rejects = step_rejects([t["trajectory_id"] for t in considered], checker=checked, mc_dead_step=mc_dead, **opinions)
    rows = rft_filter(considered, correct, scores, experiment=spec.experiment, round=spec.round, dedup=f.dedup,
                      max_per_problem=f.max_per_problem, step_rejects=rejects)
    chosen = {r["trajectory_id"] for r in rows if r["selected"]}
    too_long = replays_too_long(spec, hindsight, chosen) if f.replays else set()
    for r in rows:  # a replay longer than SFT takes: its new task's observations can outgrow the source's
        if r["trajectory_id"] in too_long:
            r.update(selected=False, rank=None,
                     reason=f"over train_policy.max_length={spec.cfg().train_policy.max_length} tokens")
    capped = 0
    if f.max_per_value is not None:  # no one constant of a template floods the round (the policy's favourite)
        constants = {t["trajectory_id"]: domain.constants(t["prompt"]) for t in considered}
        capped = cap_per_value(rows, constants, f.max_per_value, later=set(sources))
    for r in rows:  # a relabel or a variant names its source, and why it was left out where it was
        if r["trajectory_id"] in sources:
            why = "" if r["selected"] else f"; {r['reason']}"
            what = "hindsight: relabeled from" if purpose[r["trajectory_id"]] == "hindsight" else "variant of"
            r["reason"] = f"{what} {sources[r['trajectory_id']]}{why}"
    n_sel = sum(r["selected"] for r in rows)
    metrics: dict[str, float] = {"selected": n_sel, "considered": len(rows), "selected_fraction": n_sel / max(len(rows), 1)}
    if f.max_per_value is not None:
        metrics["over_max_per_value"] = capped
    if f.replays:
        metrics["replays_over_max_length"] = len(too_long)
    if threshold is not None and prm_min:
        metrics["judge_min_step_score"] = threshold
    if second:
        metrics["judge_previous_min_step_score"] = second_threshold
    if has_checker:  # evaluation only: the checker measures the learned judges, whether or not it filters
        metrics |= judge_catch_rates(correct, checker, judged)
        metrics |= judge_ranking(weakest, checker)
    if f.dpo_pairs:
        eligible = {tid: tid not in rejects for tid in ids}
        pairs = dpo_pairs(trajs, correct, scores, experiment=spec.experiment, round=spec.round,
                          max_pairs_per_problem=f.max_pairs_per_problem, eligible=eligible)
        rows += pairs
        metrics["dpo_pairs"] = len(pairs) // 2
    if f.step_dpo_pairs and scored:
        steps_pairs = spec.rows("score", "step_pairs")
        rows += step_pair_selections(steps_pairs, experiment=spec.experiment, round=spec.round)
        metrics["step_dpo_pairs"] = len(steps_pairs)
    for on, kind, made, kept_ in ((f.hindsight, "hindsight", "hindsight_relabeled", "hindsight_selected"),
                                  (f.variants, "variant", "variants", "variants_selected")):
        if on:
            metrics |= {made: sum(p == kind for p in purpose.values()),
                        kept_: sum(r["selected"] for r in rows if purpose.get(r["trajectory_id"]) == kind)}
    # Reward-hacking monitor: what the filter keeps should not drift longer or repetitive round to round.
    by_id = {t["trajectory_id"]: t for t in considered}
    kept = [by_id[r["trajectory_id"]] for r in rows if r["selected"] and r["purpose"] == "policy_sft"]
    if kept:
        metrics["selected_mean_tokens"] = sum(t["num_tokens"] for t in kept) / len(kept)
        steps = steps_by_trajectory(spec.rows("generate", "steps"))
        metrics["selected_repeated_step_rate"] = repeated_step_rate([steps.get(t["trajectory_id"], []) for t in kept])
        ranked = [scores[t["trajectory_id"]] for t in kept if t["trajectory_id"] in scores]
        if source != "outcome" and ranked:
            metrics["selected_mean_rank_score"] = sum(ranked) / len(ranked)
    write(out, selections=rows, **hindsight)
    log("filter", f"selected {n_sel} of {len(trajs) + len(sources)} trajectories for policy_sft, ranked by {source}"
                  + (f"; {metrics['hindsight_relabeled']:.0f} wrong episodes relabeled in hindsight, "
                     f"{metrics['hindsight_selected']:.0f} of them selected" if f.hindsight else "")
                  + (f"; {metrics['variants']:.0f} variants of right episodes, {metrics['variants_selected']:.0f} "
                     "of them selected" if f.variants else "")
                  + (f"; {capped} left out over max_per_value={f.max_per_value}" if f.max_per_value else "")
                  + (f"; {len(too_long)} replays longer than train_policy.max_length" if too_long else "")
                  + (f"; {metrics['dpo_pairs']:.0f} DPO pairs" if f.dpo_pairs else "")
                  + (f"; {metrics['step_dpo_pairs']:.0f} step-level DPO pairs" if "step_dpo_pairs" in metrics else "")
                  + (f"; the judge's threshold {threshold:.3f}, calibrated to drop at most {f.judge_max_drop:g} of the "
                     "right answers" if threshold is not None and f.judge_max_drop is not None else ""))
    return metrics


def relabeled(spec: StageSpec, env: Any, trajs: list[dict[str, Any]], correct: dict[str, bool | None],
              ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """filter.hindsight: the round's wrong answered episodes that are right for the task their answer solved;
    filter.variants: its right ones posed again with other constants. Each as the rows of a trajectory of purpose
    'hindsight' or 'variant' (`components.envs.hindsight`), and each one's source."""
    from components.envs.hindsight import relabel_episodes, vary_episodes
    from components.envs.rollout import EpisodeBatch, conversations, verification_rows

    cfg = spec.cfg()
    problems, chats = spec.rows("generate", "problems"), conversations(spec.rows("generate", "turns"))
    batch, sources = EpisodeBatch(), {}
    answered = [t for t in trajs if t["finish_reason"] == "done"]
    if cfg.filter.hindsight:
        more, from_ = relabel_episodes(env, [t for t in answered if correct.get(t["trajectory_id"]) is False],
                                       problems, chats, experiment=spec.experiment, round=spec.round)
        batch.extend(more)
        sources |= from_
    if cfg.filter.variants is not None:
        more, from_ = vary_episodes(env, [t for t in answered if correct.get(t["trajectory_id"])], problems, chats,
                                    cfg.filter.variants, cfg.seed, experiment=spec.experiment, round=spec.round)
        batch.extend(more)
        sources |= from_
    return batch.tables | {"verifications": verification_rows(env, batch, spec.code_version or "dev")}, sources


def replays_too_long(spec: StageSpec, tables: dict[str, list[dict[str, Any]]], selected: set[str]) -> set[str]:
    """The filter's replayed episodes (`relabeled`) among `selected` longer than train_policy.max_length, measured
    with the round's policy's chat template as SFT encodes them: those SFT would train on, and no others."""
    from transformers import AutoTokenizer

    from components.envs.agent import ChatEncoder
    from components.envs.hindsight import longer_than

    limit, uri = spec.cfg().train_policy.max_length, spec.inputs_as(Inputs).policy_uri
    turns = [t for t in tables.get("turns", []) if t["trajectory_id"] in selected]
    if limit is None or not turns:
        return set()
    return longer_than({"turns": turns}, ChatEncoder(AutoTokenizer.from_pretrained(uri), uri), limit)


def grpo_groups(spec: StageSpec, out: StageOutputWriter, trajs: list[dict[str, Any]],
                score_rows: list[dict[str, Any]]) -> dict[str, float]:
    """recipe grpo: every rollout's advantage against its group (`advantages`), and the groups that train
    (`selections`, purpose grpo): those whose rewards differ, up to filter.max_groups."""
    from components.rl.advantages import (group_advantages, process_varied_groups, step_advantages,
                                          zero_variance_share)

    cfg = spec.cfg()
    g = cfg.train_policy.grpo
    outcome = {s["trajectory_id"]: s["value"] for s in score_rows if s["scorer"] == "outcome"}
    missing = [t["trajectory_id"] for t in trajs if t["trajectory_id"] not in outcome]
    if missing:
        raise ValueError(f"filter: {len(missing)} rollouts have no outcome score, e.g. {missing[0]}")
    domain = domain_of(spec)
    turns = episode_turns(spec, domain)  # an environment's episodes: read once, for the checker and turn credit
    checked = steps_checked(domain, trajs, outcome, turns) if cfg.filter.check_steps else {}
    failed = sorted(t for t, ok in checked.items() if not ok)
    if checked:  # rft drops these right answers; here they earn a wrong answer's reward, or keep their own
        zeroed = g.unsound_reward == "zero"
        if zeroed:
            outcome |= dict.fromkeys(failed, 0.0)
        log("filter", f"filter.check_steps: {len(failed)} of {len(checked)} right answers have steps that do not "
                      "check out" + (" and earn 0" if zeroed else ": self-imitation leaves them out, their reward "
                                     "stays (train_policy.grpo.unsound_reward=outcome)"))
    shaping: dict[str, float] = {}
    if g.shaping_weight > 0 and g.credit == "trajectory":
        dense, source = ranking_scores([s for s in score_rows if s["scorer"] != "outcome"], [], g.shaping_aggregate)
        if dense:
            shaping = {t: g.shaping_weight * v for t, v in dense.items()}
            log("filter", f"rewards shaped by {g.shaping_weight} x {source}")
        else:  # the implicit PRM's first round: the policy is its own reference, every log-ratio 0
            log("filter", "no reward-model scores this round: rewards are the outcome alone")
    process: dict[str, list[float]] = {}
    if g.credit == "step":
        steps = steps_by_trajectory(spec.rows("generate", "steps"))
        labels = spec.rows("score", "step_labels") if spec.has("score") else []
        process, source = step_rewards(score_rows, labels, {t["trajectory_id"]: len(steps.get(t["trajectory_id"], []))
                                                            for t in trajs})
        log("filter", f"step credit: {g.shaping_weight} x the group-normalised {source} of each step and the steps "
                      f"after it, on {len(process)} of {len(trajs)} rollouts" if process else
                      "step credit: no step rewards this round (no reward model yet, no Monte Carlo labels): every "
                      "token gets its rollout's outcome advantage")
    rollouts = [{"trajectory_id": t["trajectory_id"], "group_id": t["problem_id"], "outcome": outcome[t["trajectory_id"]],
                 "shaping": shaping.get(t["trajectory_id"], 0.0)} for t in trajs]
    rows = group_advantages(rollouts, scale=g.scale_rewards, max_groups=cfg.filter.max_groups, seed=spec.seed,
                            process_varied=process_varied_groups(rollouts, process))
    rows = [r | {"turn_index": -1, "experiment_id": spec.experiment, "round": spec.round, "process": None,
                 "process_return": None, "steps_checked": checked.get(r["trajectory_id"])} for r in rows]
    turn_rows = step_advantages(rows, process, g.shaping_weight) if process else []
    if turns is not None:
        turn_rows = episode_turn_rows(rows, turn_rows, turns)
    selections = [{"trajectory_id": r["trajectory_id"], "experiment_id": spec.experiment, "round": spec.round,
                   "purpose": "grpo", "selected": r["kept"], "rank": None, "reason": r["reason"], "pair_id": None}
                  for r in rows]
    judged: dict[str, float] = {}
    if cfg.filter.min_step_score is not None:
        ptx, judged = ptx_judge(spec, trajs, outcome, score_rows, checked, turns)
        selections += ptx
    write(out, advantages=rows + turn_rows, selections=selections)
    groups = {r["group_id"] for r in rows}
    kept = {r["group_id"] for r in rows if r["kept"]}
    share = zero_variance_share(rows)
    by_steps = {r["group_id"] for r in rows if r["kept"] and r["reason"] == "process rewards differ"}
    log("filter", f"{len(kept)} of {len(groups)} groups train"
                  + (f" ({len(by_steps)} on their step rewards alone)" if by_steps else "")
                  + f"; {share:.0%} had equal rewards"
                  + ("" if kept else " -- WARNING: no group has a learning signal, the policy carries over"))
    return {"groups": len(groups), "groups_kept": len(kept), "selected": sum(r["kept"] for r in rows),
            "considered": len(rows), "zero_variance_share": share,
            "reward_mean": sum(r["reward"] for r in rows) / max(len(rows), 1),
            **({"step_credit_rollouts": len(process)} if g.credit == "step" else {}),
            **({"steps_failed": len(failed), "steps_checked": len(checked)} if checked else {}), **judged}


def ptx_judge(spec: StageSpec, trajs: list[dict[str, Any]], outcome: dict[str, float], score_rows: list[dict[str, Any]],
              checked: dict[str, bool], turns: list[dict[str, Any]] | None = None,
              ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """filter.min_step_score under recipe grpo: the round's reward model judges which right answers self-imitation
    (train_policy.grpo.ptx_pool) may train on, as rft's filter judges what its SFT trains on. A right answer whose
    weakest step scores below the threshold (lowered by filter.judge_max_drop, as rft's) is left out, as one whose
    steps fail filter.check_steps is; its reward is left alone. Returns a `selections` row (purpose ptx) for every
    right answer, and the filter's metrics: how many the judge left out, and where the domain has a step checker,
    how the judge agrees with it (evaluation only, as rft's filter reports). `checked`: filter.check_steps' verdict
    on every right answer where it is set (a failed one's `outcome` is 0 unless unsound_reward=outcome), else {};
    `turns`: an environment's episodes' rows, which its checker reads (`episode_turns`)."""
    from components.filtering import judge_catch_rates, judge_ranking, judge_threshold

    f = spec.cfg().filter
    failed = {t for t, ok in checked.items() if not ok}
    right = [t for t in trajs if outcome[t["trajectory_id"]] > 0 or t["trajectory_id"] in failed]
    source, weakest = step_judge(score_rows)
    weakest = {t["trajectory_id"]: weakest[t["trajectory_id"]] for t in right if t["trajectory_id"] in weakest}
    threshold = judge_threshold(list(weakest.values()), f.min_step_score, f.judge_max_drop)
    out = {t: f"{source}: weakest step {v:.3f} < min_step_score {threshold:.3f}"
           for t, v in weakest.items() if v < threshold}
    log("filter", f"filter.min_step_score: the {source} judge leaves {len(out)} of {len(weakest)} right answers out "
                  f"of self-imitation (threshold {threshold:.3f})" if weakest else
                  "filter.min_step_score: no reward-model step scores this round: the judge leaves no right answer "
                  "out of self-imitation")
    rows = [{"trajectory_id": t["trajectory_id"], "experiment_id": spec.experiment, "round": spec.round,
             "purpose": "ptx", "selected": t["trajectory_id"] not in out and t["trajectory_id"] not in failed,
             "rank": None, "pair_id": None,
             "reason": out.get(t["trajectory_id"]) or ("steps do not check" if t["trajectory_id"] in failed
                                                      else "right answer")} for t in right]
    metrics = {"ptx_judged_out": float(len(out))}
    if weakest:
        metrics["judge_min_step_score"] = threshold
        checker = checked or steps_checked(domain_of(spec), [t for t in right if t["trajectory_id"] in weakest],
                                           dict.fromkeys(weakest, 1.0), turns)
        if checker:  # evaluation only: the checker measures the judge, whether or not it zeroes rewards
            metrics |= judge_catch_rates(dict.fromkeys(weakest, True), checker, out)
            metrics |= judge_ranking(weakest, checker)
    return rows, metrics


def episode_turns(spec: StageSpec, domain: Any) -> list[dict[str, Any]] | None:
    """The round's episodes' turns, which an environment's step checker reads; None for a text domain."""
    from components.envs.rollout import is_agent

    if not is_agent(domain):
        return None
    return spec.read("generate", "turns").select(["trajectory_id", "turn_index", "role", "content", "tool_name",
                                                   "tool_ok"]).to_pylist()


def steps_checked(domain: Any, trajs: list[dict[str, Any]], outcome: dict[str, float],
                  turns: list[dict[str, Any]] | None = None) -> dict[str, bool]:
    """filter.check_steps under recipe grpo: the domain's step checker on each right answer (outcome > 0), by
    trajectory id; a domain without a checker (it answers None) checks nothing. `turns`: an environment's
    episodes' rows (`step_verdicts`).

    >>> from components.domains.arith import ArithDomain
    >>> trajs = [{"trajectory_id": t, "prompt": "3+4-2\\n", "completion": c} for t, c in
    ...          [("a", "3+4=7\\n7-2=5\\n#### 5\\n"), ("b", "3+4=8\\n8-3=5\\n#### 5\\n"), ("c", "#### 4\\n")]]
    >>> steps_checked(ArithDomain(), trajs, {"a": 1.0, "b": 1.0, "c": 0.0})
    {'a': True, 'b': False}
    """
    right = [t for t in trajs if outcome[t["trajectory_id"]] > 0]
    return {tid: ok for tid, ok in step_verdicts(domain, right, turns).items() if ok is not None}


def episode_turn_rows(rows: list[dict[str, Any]], step_rows: list[dict[str, Any]],
                      turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An agent's episodes, one `advantages` row per assistant turn, keyed by the turn's `turn_index` in `turns`:
    its step's row where the episode has step credit (its steps are its assistant turns, in order), else its
    episode's row (outcome-only credit). The turn's tokens train on it; its observations are masked out.

    >>> rows = [{"trajectory_id": "e", "advantage": 0.5}, {"trajectory_id": "f", "advantage": -0.5}]
    >>> steps = [{"trajectory_id": "e", "turn_index": 0, "advantage": 0.9},
    ...          {"trajectory_id": "e", "turn_index": 1, "advantage": 0.1}]
    >>> turns = [{"trajectory_id": t, "turn_index": i, "role": r} for t in "ef"
    ...          for i, r in enumerate(["user", "assistant", "tool", "assistant"])]
    >>> [(r["trajectory_id"], r["turn_index"], r["advantage"]) for r in episode_turn_rows(rows, steps, turns)]
    [('e', 1, 0.9), ('e', 3, 0.1), ('f', 1, -0.5), ('f', 3, -0.5)]
    """
    by_tid = {r["trajectory_id"]: r for r in rows}
    by_step = {(r["trajectory_id"], r["turn_index"]): r for r in step_rows}
    out, seen = [], Counter()
    for u in sorted(turns, key=lambda u: (u["trajectory_id"], u["turn_index"])):
        tid = u["trajectory_id"]
        if u["role"] != "assistant" or tid not in by_tid:
            continue
        step = seen[tid]
        seen[tid] += 1
        out.append(by_step.get((tid, step), by_tid[tid]) | {"turn_index": u["turn_index"]})
    return out


def step_rewards(scores: list[dict[str, Any]], step_labels: list[dict[str, Any]],
                 num_steps: dict[str, int]) -> tuple[dict[str, list[float]], str]:
    """Each rollout's step rewards, in step order, for step-level credit: a reward model's step scores where the
    round has them (in RANKERS' order, then a user's), else the Monte Carlo `mc_soft` labels; only rollouts with
    a value for every one of their `num_steps` steps. ({}, "") where there are none.

    >>> s = [{"trajectory_id": "t", "scorer": "prm", "step_index": i, "aggregate": "step", "value": v}
    ...      for i, v in enumerate([0.9, 0.2])]
    >>> step_rewards(s, [], {"t": 2, "u": 1})
    ({'t': [0.9, 0.2]}, 'prm step scores')
    >>> step_rewards([], [{"trajectory_id": "u", "step_index": 0, "source": "mc_soft", "value": 0.5}], {"u": 1})
    ({'u': [0.5]}, 'mc_soft labels')
    """
    def complete(values: dict[str, dict[int, float]]) -> dict[str, list[float]]:
        return {t: [v[i] for i in range(n)] for t, n in num_steps.items()
                if n and (v := values.get(t)) is not None and all(i in v for i in range(n))}

    by_scorer: dict[str, dict[str, dict[int, float]]] = {}
    for s in scores:
        if s["step_index"] >= 0 and s["aggregate"] == "step" and s["scorer"] != "outcome":
            by_scorer.setdefault(s["scorer"], {}).setdefault(s["trajectory_id"], {})[s["step_index"]] = s["value"]
    for scorer in (*RANKERS, *sorted(set(by_scorer) - set(RANKERS))):
        got = complete(by_scorer.get(scorer, {}))
        if got:
            return got, f"{scorer} step scores"
    mc: dict[str, dict[int, float]] = {}
    for lab in step_labels:
        if lab["source"] == "mc_soft":
            mc.setdefault(lab["trajectory_id"], {})[lab["step_index"]] = lab["value"]
    got = complete(mc)
    return (got, "mc_soft labels") if got else ({}, "")


def step_judge(scores: list[dict[str, Any]], scorer: str | None = None) -> tuple[str, dict[str, float]]:
    """The step reward model that judges a round's right answers against filter.min_step_score, and each
    trajectory's weakest step under it: `scorer` where given (the round's own PRM, `judge`), else the first of
    RANKERS, then a user's, that scored steps this round (the previous round's PRM, the implicit PRM, the
    sampler's confidence). ("prm", {}) where none did: before a PRM exists the judge drops nothing.

    >>> s = [{"trajectory_id": "t", "scorer": "confidence", "step_index": -1, "aggregate": "min", "value": 0.25},
    ...      {"trajectory_id": "t", "scorer": "outcome", "step_index": -1, "aggregate": "outcome", "value": 1.0}]
    >>> step_judge(s)
    ('confidence', {'t': 0.25})
    """
    named = sorted({s["scorer"] for s in scores} - {*RANKERS, "outcome"})
    for name in [scorer] if scorer else (*RANKERS, *named):
        weakest = {s["trajectory_id"]: s["value"] for s in scores if s["scorer"] == name and s["aggregate"] == "min"}
        if weakest:
            return name, weakest
    return "prm", {}


def ranking_scores(scores: list[dict[str, Any]], step_labels: list[dict[str, Any]],
                   aggregate: str) -> tuple[dict[str, float], str]:
    """What ranks trajectories: a reward model's aggregate where the score stage has one (an outcome
    reward model's single score), else the mean Monte Carlo value of the steps (round 1 of coevo),
    else the verifier outcome.

    >>> s = [{"trajectory_id": "t", "scorer": "outcome", "step_index": -1, "aggregate": "outcome", "value": 1.0}]
    >>> ranking_scores(s, [{"trajectory_id": "t", "source": "mc_soft", "value": 0.5}], "min")
    ({'t': 0.5}, 'mc_soft mean')
    """
    others = sorted({s["scorer"] for s in scores} - {*RANKERS, "outcome"})
    for scorer in (*RANKERS, *others):
        got = {s["trajectory_id"]: (s["value"], s["aggregate"]) for s in scores
               if s["scorer"] == scorer and s["step_index"] == -1 and s["aggregate"] in (aggregate, "outcome")}
        if got:
            return {t: v for t, (v, _) in got.items()}, f"{scorer} {next(iter(got.values()))[1]}"
    mc: dict[str, list[float]] = {}
    for lab in step_labels:
        if lab["source"] == "mc_soft":
            mc.setdefault(lab["trajectory_id"], []).append(lab["value"])
    if mc:
        return {t: sum(v) / len(v) for t, v in mc.items()}, "mc_soft mean"
    return {s["trajectory_id"]: s["value"] for s in scores if s["scorer"] == "outcome"}, "outcome"


STAGE = Stage(name="filter", section="filter", gpu=False, reads=("generate", "verify", "score", "train_reward"),
              writes=("selections", "advantages", "problems", "trajectories", "steps", "turns", "verifications"),
              inputs=Inputs, plan=plan, run=run)
