"""Group-relative advantages, as TRL's GRPOTrainer computes them, with the filter's group decisions.

    rows = group_advantages([{"trajectory_id": "a", "group_id": "p", "outcome": 1.0},
                             {"trajectory_id": "b", "group_id": "p", "outcome": 0.0}], scale="group")

A group is one problem's `samples_per_problem` rollouts. Its advantage is TRL 1.16's `sum_then_normalize`:
reward minus the group mean, divided by the group's sample standard deviation (Bessel's correction) plus
1e-4 under `scale="group"`, by the whole round's std under `"batch"`, not at all under `"none"` (Dr. GRPO).
The store keeps every term (`advantages`), and the same numbers come back from SQL over the stored rewards
(docs/grpo.md). A group whose rewards are all equal carries no signal and is dropped (DAPO's dynamic
sampling); past `max_groups`, the groups kept are a seeded sample.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any, Literal

EPS = 1e-4  # TRL's: advantages / (std + 1e-4)
Scale = Literal["group", "batch", "none"]


def _std(xs: list[float]) -> float | None:
    """The sample standard deviation (Bessel), None for fewer than two values.

    >>> _std([1.0, 0.0, 0.0, 1.0]), _std([1.0])
    (0.5773502691896257, None)
    """
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def group_advantages(rollouts: list[dict[str, Any]], scale: Scale = "group", max_groups: int | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """One row per rollout: `outcome` and optional `shaping` summed into `reward`, its group's size, mean and
    std, `advantage`, and whether the group trains (`kept`, `reason`).

    Each rollout is {"trajectory_id", "group_id", "outcome"[, "shaping"]}; a reward that is not a finite number
    is refused, naming the rollout.

    >>> rows = group_advantages([{"trajectory_id": t, "group_id": g, "outcome": r}
    ...                          for t, g, r in [("a", "p", 1.0), ("b", "p", 0.0), ("c", "q", 1.0), ("d", "q", 1.0)]])
    >>> [(r["trajectory_id"], round(r["advantage"], 4), r["kept"]) for r in rows]
    [('a', 0.707, True), ('b', -0.707, True), ('c', 0.0, False), ('d', 0.0, False)]
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rollouts:
        outcome, shaping = r["outcome"], r.get("shaping", 0.0)
        for name, v in (("outcome", outcome), ("shaping", shaping)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"rollout {r['trajectory_id']}: its {name} reward is {v!r}, expected a finite number")
        groups[r["group_id"]].append({**r, "shaping": float(shaping), "reward": float(outcome) + float(shaping)})
    every = [x["reward"] for g in groups.values() for x in g]
    batch_std = _std(every) or 0.0
    varied = sorted(g for g, xs in groups.items() if len({x["reward"] for x in xs}) > 1)
    capped = set(varied) if max_groups is None or len(varied) <= max_groups else set(
        random.Random(seed).sample(varied, max_groups))
    out = []
    for gid in sorted(groups):
        xs = groups[gid]
        rewards = [x["reward"] for x in xs]
        mean, std = sum(rewards) / len(rewards), _std(rewards)
        denom = {"group": (std or 0.0) + EPS, "batch": batch_std + EPS, "none": 1.0}[scale]
        if gid in capped:
            kept, reason = True, "rewards differ"
        elif gid in varied:
            kept, reason = False, f"over filter.max_groups={max_groups}"
        else:
            kept, reason = False, f"every reward is {rewards[0]:g}: no signal"
        for x in sorted(xs, key=lambda x: x["trajectory_id"]):
            out.append({"trajectory_id": x["trajectory_id"], "group_id": gid, "outcome": float(x["outcome"]),
                        "shaping": x["shaping"], "reward": x["reward"], "group_size": len(xs), "group_mean": mean,
                        "group_std": std, "advantage": (x["reward"] - mean) / denom, "kept": kept, "reason": reason})
    return out


def zero_variance_share(rows: list[dict[str, Any]]) -> float:
    """The share of groups whose rewards are all equal.

    >>> zero_variance_share([{"group_id": "p", "reason": "every reward is 1: no signal"},
    ...                      {"group_id": "q", "reason": "rewards differ"}])
    0.5
    """
    groups = {r["group_id"]: r["reason"].startswith("every reward") for r in rows}
    return sum(groups.values()) / max(len(groups), 1)
