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
    steps_ok: dict[str, bool | None] | None = None,
) -> list[dict[str, Any]]:
    """Rows for `selections` with purpose `policy_sft`.

    >>> ts = [{"trajectory_id": t, "problem_id": "p", "completion": c, "sample_index": i}
    ...       for i, (t, c) in enumerate([("a", "x"), ("b", "x"), ("c", "y"), ("d", "z")])]
    >>> rows = rft_filter(ts, {"a": True, "b": True, "c": False, "d": True}, {}, experiment="e", round=1,
    ...                   dedup=True, max_per_problem=4)
    >>> [(r["trajectory_id"], r["selected"], r["reason"]) for r in rows]
    [('a', True, 'correct'), ('b', False, 'duplicate'), ('c', False, 'incorrect'), ('d', True, 'correct')]
    """
    by_problem: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in trajectories:
        by_problem[t["problem_id"]].append(t)
    rows = []
    for pid in sorted(by_problem):
        # Highest score first, then sample order: deterministic ranking.
        group = sorted(by_problem[pid], key=lambda t: (-scores.get(t["trajectory_id"], 0.0), t["sample_index"]))
        seen: set[str] = set()
        rank = 0
        for t in group:
            tid = t["trajectory_id"]
            ok = correct.get(tid)
            if ok is None:
                reason, keep = "unverified", False
            elif not ok:
                reason, keep = "incorrect", False
            elif steps_ok is not None and steps_ok.get(tid) is False:
                reason, keep = "steps do not check", False
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
