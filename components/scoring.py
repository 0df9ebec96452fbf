"""Stage `score`: give each trajectory its scores, and choose which trajectories get Monte Carlo labels.

With no reward model, the score is the verifier outcome (`scorer='outcome'`). A reward model adds
per-step rows (`aggregate='step'`) and min/last/mean aggregates (`step_index=-1`) with the same
shape, so the contract does not change.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any


def outcome_scores(verifications: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"trajectory_id": v["trajectory_id"], "scorer": "outcome", "model_id": None, "step_index": -1,
         "aggregate": "outcome", "value": 0.0 if v["reward"] is None else float(v["reward"])}
        for v in verifications
    ]


def step_score_rows(trajectory_ids: list[str], step_scores: list[list[float]], scorer: str,
                    model_id: str) -> list[dict[str, Any]]:
    """`scores` rows for per-step reward-model scores: one per step, then min/last/mean at step -1.

    >>> rows = step_score_rows(["t"], [[0.9, 0.2]], "prm", "e/prm/r1")
    >>> [(r["step_index"], r["aggregate"], r["value"]) for r in rows]
    [(0, 'step', 0.9), (1, 'step', 0.2), (-1, 'min', 0.2), (-1, 'last', 0.2), (-1, 'mean', 0.55)]
    """
    from components.rewards.prm import aggregate

    rows = []
    for tid, scores in zip(trajectory_ids, step_scores, strict=True):
        base = {"trajectory_id": tid, "scorer": scorer, "model_id": model_id}
        rows += [base | {"step_index": i, "aggregate": "step", "value": float(v)} for i, v in enumerate(scores)]
        rows += [base | {"step_index": -1, "aggregate": k, "value": round(v, 12)} for k, v in aggregate(scores).items()]
    return rows


def trajectory_score_rows(trajectory_ids: list[str], values: list[float], scorer: str,
                          model_id: str) -> list[dict[str, Any]]:
    """`scores` rows for a whole-trajectory reward (an ORM): step -1, aggregate 'outcome'."""
    return [{"trajectory_id": t, "scorer": scorer, "model_id": model_id, "step_index": -1, "aggregate": "outcome",
             "value": float(v)} for t, v in zip(trajectory_ids, values, strict=True)]


def choose_for_mc(trajectories: list[dict[str, Any]], correct: dict[str, bool | None], max_distinct: int | None,
                  seed: int) -> list[str]:
    """Trajectory ids to label with Monte Carlo rollouts.

    Distinct (problem, completion) texts are the unit of cost: duplicates share every prefix, so the
    rollouts of one serve all. A seeded sample of at most `max_distinct` texts, half from correct and
    half from incorrect trajectories where both have enough (a PRM learns errors from the incorrect
    ones and good steps from both); every trajectory with a chosen text is labelled.

    >>> ts = [{"trajectory_id": f"t{i}", "problem_id": "p", "completion": c} for i, c in enumerate("aabcd")]
    >>> ok = {"t0": True, "t1": True, "t2": True, "t3": False, "t4": False}
    >>> ids = choose_for_mc(ts, ok, 2, seed=0)
    >>> len({ts[int(t[1:])]["completion"] for t in ids}), sorted({ok[t] for t in ids}), ("t0" in ids) == ("t1" in ids)
    (2, [False, True], True)
    """
    texts: dict[tuple[str, str], list[str]] = defaultdict(list)
    for t in sorted(trajectories, key=lambda t: t["trajectory_id"]):
        texts[(t["problem_id"], t["completion"])].append(t["trajectory_id"])
    keys = sorted(texts)
    if max_distinct is not None and len(keys) > max_distinct:
        good = [k for k in keys if correct.get(texts[k][0])]
        bad = [k for k in keys if not correct.get(texts[k][0])]
        n_good = min(len(good), max(max_distinct // 2, max_distinct - len(bad)))
        rng = random.Random(seed)
        keys = rng.sample(good, n_good) + rng.sample(bad, min(len(bad), max_distinct - n_good))
    return sorted(tid for k in keys for tid in texts[k])


def plan_first_error(trajectories: list[dict[str, Any]], correct: dict[str, bool | None], max_searched: int | None,
                     seed: int, search_unsolved: bool = False) -> tuple[set[str], set[str]]:
    """(trajectory ids to label, problem ids whose root is alive) for `first_error` labels.

    A right answer labels itself. The binary search over a wrong one needs an alive root (OmegaPRM):
    a problem some sample of the round solved. A wrong answer to a problem none solved is labelled
    without a search (its final step only) unless `search_unsolved`. Both are free, so
    `max_searched` (a `choose_for_mc` sample of distinct texts) caps the searched ones alone.

    >>> ts = [{"trajectory_id": t, "problem_id": p, "completion": t} for t, p in
    ...       [("r", "p"), ("w", "p"), ("w2", "p"), ("u", "q")]]
    >>> ok = {"r": True, "w": False, "w2": False, "u": False}
    >>> plan_first_error(ts, ok, 1, seed=0) in [({"r", "u", "w"}, {"p"}), ({"r", "u", "w2"}, {"p"})]
    True
    >>> chosen, alive = plan_first_error(ts, ok, None, seed=0, search_unsolved=True)
    >>> sorted(chosen), sorted(alive)
    (['r', 'u', 'w', 'w2'], ['p', 'q'])
    """
    solved = {t["problem_id"] for t in trajectories if correct.get(t["trajectory_id"])}
    alive = {t["problem_id"] for t in trajectories} if search_unsolved else solved
    free = {t["trajectory_id"] for t in trajectories if correct.get(t["trajectory_id"]) or t["problem_id"] not in alive}
    searched = choose_for_mc([t for t in trajectories if t["trajectory_id"] not in free], correct, max_searched, seed)
    return free | set(searched), alive
