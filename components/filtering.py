"""Stage `filter`: decide which trajectories train the next policy, and say why for each.

`rft` (STaR / ReST-EM): keep correct trajectories, drop exact duplicates per problem, cap per problem.
Every trajectory gets a row, selected or not, so `selections` explains the whole round.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def rft_filter(
    trajectories: list[dict[str, Any]], correct: dict[str, bool | None], scores: dict[str, float], *,
    experiment: str, round: int, dedup: bool, max_per_problem: int,
    step_rejects: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Rows for `selections` with purpose `policy_sft`.

    `step_rejects` maps a trajectory to why its steps are judged wrong, naming the judge (the domain's
    step checker, Monte Carlo labels, a reward model): a right answer in it is dropped with that reason.

    >>> ts = [{"trajectory_id": t, "problem_id": "p", "completion": c, "sample_index": i}
    ...       for i, (t, c) in enumerate([("a", "x"), ("b", "x"), ("c", "y"), ("d", "z")])]
    >>> rows = rft_filter(ts, {"a": True, "b": True, "c": False, "d": True}, {}, experiment="e", round=1,
    ...                   dedup=True, max_per_problem=4)
    >>> [(r["trajectory_id"], r["selected"], r["reason"]) for r in rows]
    [('a', True, 'correct'), ('b', False, 'duplicate'), ('c', False, 'incorrect'), ('d', True, 'correct')]
    """
    rows = []
    for pid, group in _ranked_by_problem(trajectories, scores):
        seen: set[str] = set()
        rank = 0
        for t in group:
            tid = t["trajectory_id"]
            ok = correct.get(tid)
            if ok is None:
                reason, keep = "unverified", False
            elif not ok:
                reason, keep = "incorrect", False
            elif step_rejects and tid in step_rejects:
                reason, keep = step_rejects[tid], False
            elif dedup and t["completion"] in seen:
                reason, keep = "duplicate", False
            elif rank >= max_per_problem:
                reason, keep = f"over max_per_problem={max_per_problem}", False
            else:
                reason, keep = "correct", True
            if ok:
                seen.add(t["completion"])
            rows.append({
                "trajectory_id": tid, "experiment_id": experiment, "round": round, "purpose": "policy_sft",
                "selected": keep, "rank": rank if keep else None, "reason": reason, "pair_id": None,
            })
            rank += keep
    rows.sort(key=lambda r: r["trajectory_id"])
    return rows


def cap_per_value(rows: list[dict[str, Any]], constants: dict[str, list[str]], cap: int,
                  later: set[str] = frozenset()) -> int:
    """filter.max_per_value: deselect, in place, the selected `rows` past `cap` that share a constant of their task
    (`constants`: trajectory -> `<template>: <name>=<value>` keys), so no one value of a template floods what the
    policy trains on. Each problem's first selection goes before its second; trajectories in `later` (relabels)
    after every other. Returns how many it deselected.

    >>> rows = [{"trajectory_id": t, "selected": True, "rank": 0, "reason": "correct"} for t in "abc"]
    >>> cap_per_value(rows, {"a": ["T: k=7"], "b": ["T: k=7"], "c": ["T: k=3"]}, 1, later={"a"})
    1
    >>> [(r["trajectory_id"], r["selected"], r["reason"]) for r in rows]
    [('a', False, 'over max_per_value=1: T: k=7'), ('b', True, 'correct'), ('c', True, 'correct')]
    """
    count: dict[str, int] = defaultdict(int)
    dropped = 0
    for r in sorted((r for r in rows if r["selected"]),
                    key=lambda r: (r["trajectory_id"] in later, r["rank"], r["trajectory_id"])):
        keys = constants.get(r["trajectory_id"]) or []
        full = next((k for k in keys if count[k] >= cap), None)
        if full is not None:
            r.update(selected=False, rank=None, reason=f"over max_per_value={cap}: {full}")
            dropped += 1
            continue
        for k in keys:
            count[k] += 1
    return dropped


CHECKER = "steps do not check"  # the reason the domain's step checker gives


def step_rejects(
    trajectory_ids: list[str], *, checker: dict[str, bool | None] | None = None,
    mc_dead_step: dict[str, int] | None = None, prm_min: dict[str, float] | None = None,
    min_step_score: float | None = None, judge: str = "prm", second: dict[str, float] | None = None,
    second_threshold: float | None = None,
) -> dict[str, str]:
    """Why each trajectory's steps are judged wrong, naming every judge that rejects it: the domain's step
    checker (`checker`: False rejects), Monte Carlo labels (`mc_dead_step`: the first step no rollout got
    past) and the step reward model named `judge` (`prm_min`, its weakest step's score, below `min_step_score`).
    Absent: no judge objects. With a `second` opinion (another PRM's weakest-step scores, filter.judge
    round_and_previous), the reward model rejects only where that one too scores below `second_threshold`, or has
    no score for the trajectory.

    >>> step_rejects(["a", "b", "c"], checker={"a": False, "b": True}, mc_dead_step={"c": 1},
    ...              prm_min={"a": 0.9, "b": 0.125, "c": 0.2}, min_step_score=0.5)
    {'a': 'steps do not check', 'b': 'prm: weakest step 0.125 < min_step_score 0.5', \
'c': 'mc_hard: no rollout from step 1 reached the answer; prm: weakest step 0.200 < min_step_score 0.5'}
    >>> step_rejects(["a", "b", "c"], prm_min={"a": 0.1, "b": 0.2, "c": 0.3}, min_step_score=0.5,
    ...              second={"a": 0.2, "b": 0.7}, second_threshold=0.4)
    {'a': "prm: weakest step 0.100 < min_step_score 0.5, and the previous round's PRM's 0.200 < 0.4", \
'c': 'prm: weakest step 0.300 < min_step_score 0.5'}
    """
    out = {}
    for tid in trajectory_ids:
        why = []
        if checker is not None and checker.get(tid) is False:
            why.append(CHECKER)
        if mc_dead_step and tid in mc_dead_step:
            why.append(f"mc_hard: no rollout from step {mc_dead_step[tid]} reached the answer")
        if min_step_score is not None and prm_min and tid in prm_min and prm_min[tid] < min_step_score:
            agree = "" if not second or tid not in second else \
                f", and the previous round's PRM's {second[tid]:.3f} < {second_threshold:g}"
            if not agree or second[tid] < second_threshold:
                why.append(f"{judge}: weakest step {prm_min[tid]:.3f} < min_step_score {min_step_score:g}{agree}")
        if why:
            out[tid] = "; ".join(why)
    return out


def judge_threshold(weakest: list[float], min_step_score: float | None, max_drop: float | None) -> float | None:
    """The score a right answer's weakest step must reach: `min_step_score`, lowered where more than a `max_drop`
    share (in (0, 1), as filter.judge_max_drop) of `weakest` (the judged right answers' weakest-step scores) would
    fall below it, to the score that drops at most that share. A judge that finds most of a round's sound answers
    unfamiliar then drops its least familiar ones, not most of the round; a judge that drops less than the cap is
    left as it is. Without `min_step_score` there is no threshold (None): the judge drops nothing.

    >>> judge_threshold([0.1, 0.2, 0.3, 0.4, 0.9], 0.5, 0.4)    # 4 of 5 below 0.5: the cap keeps 2
    0.3
    >>> judge_threshold([0.1, 0.6, 0.7, 0.8, 0.9], 0.5, 0.4)    # 1 of 5 below 0.5: under the cap
    0.5
    >>> judge_threshold([], 0.5, 0.4), judge_threshold([0.1, 0.2], 0.5, None), judge_threshold([0.1], None, 0.4)
    (0.5, 0.5, None)
    """
    if min_step_score is None or max_drop is None or not weakest:
        return min_step_score
    ranked = sorted(weakest)
    return min(min_step_score, ranked[int(max_drop * len(ranked))])  # at most that many score strictly below it


def judge_catch_rates(correct: dict[str, bool | None], checker: dict[str, bool | None],
                      judged: dict[str, str]) -> dict[str, float]:
    """How well the learned judges (`judged`: step rejects without the checker's) agree with the domain's
    step checker on the right answers, for evaluation only: the catch rate is the share of right answers
    with unsound steps that they reject, the false-reject rate the share of sound ones they reject.

    >>> judge_catch_rates({"a": True, "b": True, "c": True, "d": False}, {"a": False, "b": True, "c": True,
    ...                   "d": False}, {"a": "prm: ...", "c": "prm: ...", "d": "prm: ..."})
    {'right_answers': 3.0, 'right_unsound': 1.0, 'judge_catch_rate': 1.0, 'judge_false_reject_rate': 0.5}
    """
    right = [t for t, ok in correct.items() if ok and checker.get(t) is not None]
    bad = [t for t in right if checker[t] is False]
    good = [t for t in right if checker[t] is True]
    out = {"right_answers": float(len(right)), "right_unsound": float(len(bad))}
    if bad:
        out["judge_catch_rate"] = sum(t in judged for t in bad) / len(bad)
    if good:
        out["judge_false_reject_rate"] = sum(t in judged for t in good) / len(good)
    return out


def judge_ranking(weakest: dict[str, float], checker: dict[str, bool | None],
                  max_false_drop: float = 0.05) -> dict[str, float]:
    """How well a judge ranks the right answers it judged (`weakest`: its score of each one's weakest step),
    apart from where its threshold sits, for evaluation only, against the domain's step checker:

    - `judge_auc`: the chance that an unsound answer scores below a sound one (ties count half); 0.5 is a coin;
    - `judge_hindsight_catch`: the catch rate of the best threshold in hindsight that drops at most
      `max_false_drop` of the sound ones. No threshold the judge could pick without the checker does better,
      so it bounds what calibration alone can reach.

    >>> r = judge_ranking({"a": 0.1, "b": 0.3, "c": 0.2, "d": 0.9, "e": 0.8}, {"a": False, "b": False, "c": True,
    ...                   "d": True, "e": True}, max_false_drop=0.0)
    >>> r["judge_auc"], r["judge_hindsight_catch"]
    (0.8333333333333334, 0.5)
    """
    from bisect import bisect_left, bisect_right

    good = sorted(s for t, s in weakest.items() if checker.get(t) is True)
    bad = [s for t, s in weakest.items() if checker.get(t) is False]
    if not good or not bad:
        return {}
    above = sum(len(good) - bisect_right(good, s) + 0.5 * (bisect_right(good, s) - bisect_left(good, s)) for s in bad)
    threshold = good[int(max_false_drop * len(good))]  # dropping below it drops at most that share of sound ones
    return {"judge_auc": above / (len(good) * len(bad)),
            "judge_hindsight_catch": sum(s < threshold for s in bad) / len(bad)}


def dpo_pairs(
    trajectories: list[dict[str, Any]], correct: dict[str, bool | None], scores: dict[str, float], *,
    experiment: str, round: int, max_pairs_per_problem: int, eligible: dict[str, bool] | None = None,
) -> list[dict[str, Any]]:
    """Rows for `selections` with purposes `dpo_chosen` and `dpo_rejected`, joined by `pair_id`.

    Per problem: the best-scored eligible correct trajectories against the worst-scored incorrect
    non-empty ones (ties: sample order), distinct texts only, at most `max_pairs_per_problem` pairs. `eligible`
    (e.g. the SFT filter's verdict, so a chosen answer's steps also check out) defaults to correct.
    Only trajectories in a pair get a row: the SFT filter's rows already explain the rest.

    >>> ts = [{"trajectory_id": t, "problem_id": "p", "completion": t, "sample_index": i}
    ...       for i, t in enumerate("abcd")]
    >>> rows = dpo_pairs(ts, {"a": True, "b": True, "c": False, "d": False}, {"a": .4, "b": .9, "c": .3, "d": .1},
    ...                  experiment="e", round=1, max_pairs_per_problem=1)
    >>> [(r["trajectory_id"], r["purpose"], r["pair_id"]) for r in rows]
    [('b', 'dpo_chosen', 'e/r1/p/0'), ('d', 'dpo_rejected', 'e/r1/p/0')]
    """
    eligible = eligible if eligible is not None else {t: bool(ok) for t, ok in correct.items()}
    rows = []
    for pid, order in _ranked_by_problem(trajectories, scores):
        good = _distinct_texts([t for t in order if correct.get(t["trajectory_id"]) and eligible.get(t["trajectory_id"])])
        worst_first = sorted(order, key=lambda t: (scores.get(t["trajectory_id"], 0.0), t["sample_index"]))
        # An empty answer (EOS at once) has no text to train against: DPO needs both sides written.
        bad = _distinct_texts([t for t in worst_first if correct.get(t["trajectory_id"]) is False and t["completion"]])
        for j, (g, b) in enumerate(zip(good, bad)):
            if j >= max_pairs_per_problem:
                break
            pair = f"{experiment}/r{round}/{pid}/{j}"
            for t, purpose, why in ((g, "dpo_chosen", "correct, best reward"), (b, "dpo_rejected", "incorrect, worst reward")):
                rows.append({"trajectory_id": t["trajectory_id"], "experiment_id": experiment, "round": round,
                             "purpose": purpose, "selected": True, "rank": j, "reason": why, "pair_id": pair})
    return rows


def step_pair_selections(step_pairs: list[dict[str, Any]], *, experiment: str, round: int) -> list[dict[str, Any]]:
    """`selections` rows (purpose `step_dpo`) for the step-level pairs (the Monte Carlo search's or an MCTS
    tree's): one per pair, on its rejected trajectory, ranked by the index of the step where the sides part.

    >>> step_pair_selections([{"trajectory_id": "t", "step_index": 2, "chosen_from": "rollout"}], experiment="e",
    ...                      round=1)[0]["reason"]
    'first dead step 2; chosen: a rollout of the live prefix'
    >>> step_pair_selections([{"trajectory_id": "t", "step_index": 1, "chosen_from": "u", "source": "tree",
    ...                        "chosen_q": 0.75, "rejected_q": 0.0}], experiment="e", round=1)[0]["reason"]
    'tree: parts at step 1, Q 0.75 against 0.00; chosen: u'
    """
    def reason(p: dict[str, Any]) -> str:
        if p.get("source") == "tree":
            return (f"tree: parts at step {p['step_index']}, Q {p['chosen_q']:.2f} against {p['rejected_q']:.2f}; "
                    f"chosen: {p['chosen_from']}")
        return f"first dead step {p['step_index']}; chosen: " + (
            "a rollout of the live prefix" if p["chosen_from"] == "rollout" else p["chosen_from"])

    return [{"trajectory_id": p["trajectory_id"], "experiment_id": experiment, "round": round, "purpose": "step_dpo",
             "selected": True, "rank": p["step_index"], "pair_id": f"{experiment}/r{round}/{p['trajectory_id']}/step",
             "reason": reason(p)} for p in sorted(step_pairs, key=lambda p: p["trajectory_id"])]


def _distinct_texts(group: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first trajectory of each completion text, in order."""
    seen: set[str] = set()
    return [t for t in group if not (t["completion"] in seen or seen.add(t["completion"]))]


def _ranked_by_problem(trajectories: list[dict[str, Any]],
                       scores: dict[str, float]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(problem_id, its trajectories) by problem id; highest score first, then sample order: deterministic."""
    by_problem: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in trajectories:
        by_problem[t["problem_id"]].append(t)
    return [(pid, sorted(by_problem[pid], key=lambda t: (-scores.get(t["trajectory_id"], 0.0), t["sample_index"])))
            for pid in sorted(by_problem)]
