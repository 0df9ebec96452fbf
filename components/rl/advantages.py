"""Group-relative advantages, as TRL's GRPOTrainer computes them, with the filter's group decisions.

    rows = group_advantages([{"trajectory_id": "a", "group_id": "p", "outcome": 1.0},
                             {"trajectory_id": "b", "group_id": "p", "outcome": 0.0}], scale="group")

A group is one problem's `samples_per_problem` rollouts. Its advantage is TRL 1.16's `sum_then_normalize`:
reward minus the group mean, divided by the group's sample standard deviation (Bessel's correction) plus
1e-4 under `scale="group"`, by the whole round's std under `"batch"`, not at all under `"none"` (Dr. GRPO).
The store keeps every term (`advantages`), and the same numbers come back from SQL over the stored rewards
(docs/grpo.md). A group whose rewards are all equal carries no signal and is dropped (DAPO's dynamic
sampling); past `max_groups`, the groups kept are a seeded sample.

With step-level credit (`step_advantages`), each step of a rollout gets its own
advantage, after DeepSeekMath's process supervision with GRPO (Shao et al. 2024, section 4.1.3): every step's
process reward is normalised by the mean and std of all step rewards in its group, and a token's advantage is
its rollout's plus `weight` times the sum of the normalised rewards of its step and the steps after it.
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


def _finite(v: Any) -> bool:
    """A reward: a finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def group_advantages(rollouts: list[dict[str, Any]], scale: Scale = "group", max_groups: int | None = None,
                     seed: int = 0, process_varied: frozenset[str] | set[str] = frozenset()) -> list[dict[str, Any]]:
    """One row per rollout: `outcome` and optional `shaping` summed into `reward`, its group's size, mean and
    std, `advantage`, and whether the group trains (`kept`, `reason`). A group in `process_varied` (its step
    rewards differ: step-level credit) has a signal even where its rewards are all equal.

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
            if not _finite(v):
                raise ValueError(f"rollout {r['trajectory_id']}: its {name} reward is {v!r}, expected a finite number")
        groups[r["group_id"]].append({**r, "shaping": float(shaping), "reward": float(outcome) + float(shaping)})
    every = [x["reward"] for g in groups.values() for x in g]
    batch_std = _std(every) or 0.0
    differ = {g for g, xs in groups.items() if len({x["reward"] for x in xs}) > 1}
    varied = sorted(differ | (set(process_varied) & set(groups)))
    capped = set(varied) if max_groups is None or len(varied) <= max_groups else set(
        random.Random(seed).sample(varied, max_groups))
    out = []
    for gid in sorted(groups):
        xs = groups[gid]
        rewards = [x["reward"] for x in xs]
        mean, std = sum(rewards) / len(rewards), _std(rewards)
        denom = {"group": (std or 0.0) + EPS, "batch": batch_std + EPS, "none": 1.0}[scale]
        if gid in capped:
            kept, reason = True, "rewards differ" if gid in differ else "process rewards differ"
        elif gid in varied:
            kept, reason = False, f"over filter.max_groups={max_groups}"
        else:
            kept, reason = False, f"every reward is {rewards[0]:g}: no signal"
        for x in sorted(xs, key=lambda x: x["trajectory_id"]):
            out.append({"trajectory_id": x["trajectory_id"], "group_id": gid, "outcome": float(x["outcome"]),
                        "shaping": x["shaping"], "reward": x["reward"], "group_size": len(xs), "group_mean": mean,
                        "group_std": std, "advantage": (x["reward"] - mean) / denom, "kept": kept, "reason": reason})
    return out


def process_normalised(rows: list[dict[str, Any]], process: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each rollout's step rewards, normalised by the mean and sample std of every step reward in its group
    (`rows` are group_advantages' rows; `process` maps a rollout to its step rewards in order). A group with
    fewer than two step rewards, or all equal, normalises to 0.

    >>> rows = [{"trajectory_id": "a", "group_id": "p"}, {"trajectory_id": "b", "group_id": "p"}]
    >>> {t: [round(v, 3) for v in vs] for t, vs in process_normalised(rows, {"a": [1.0, 1.0], "b": [0.0]}).items()}
    {'a': [0.577, 0.577], 'b': [-1.155]}
    """
    for tid, values in process.items():
        bad = [v for v in values if not _finite(v)]
        if bad:
            raise ValueError(f"rollout {tid}: a step reward is {bad[0]!r}, expected a finite number")
    members: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        members[r["group_id"]].append(r["trajectory_id"])
    out: dict[str, list[float]] = {}
    for tids in members.values():
        every = [v for t in tids for v in process.get(t, [])]
        mean, std = (sum(every) / len(every) if every else 0.0), _std(every)
        for t in tids:
            out[t] = [(v - mean) / (std + EPS) if std else 0.0 for v in process.get(t, [])]
    return out


def process_varied_groups(rows: list[dict[str, Any]], process: dict[str, list[float]]) -> set[str]:
    """The groups whose step rewards are not all equal.

    >>> process_varied_groups([{"trajectory_id": "a", "group_id": "p"}, {"trajectory_id": "b", "group_id": "q"}],
    ...                       {"a": [0.5, 0.9], "b": [0.5]})
    {'p'}
    """
    values: dict[str, set[float]] = defaultdict(set)
    for r in rows:
        values[r["group_id"]].update(process.get(r["trajectory_id"], []))
    return {g for g, vs in values.items() if len(vs) > 1}


def step_advantages(rows: list[dict[str, Any]], process: dict[str, list[float]], weight: float) -> list[dict[str, Any]]:
    """One row per step of every rollout in `process`: its rollout's row, with `turn_index` the step's index,
    `process` its step reward, `process_return` the sum of the normalised step rewards from it to the end, and
    `advantage` the rollout's plus `weight` x `process_return`.

    >>> rows = [{"trajectory_id": "a", "group_id": "p", "advantage": 0.5},
    ...         {"trajectory_id": "b", "group_id": "p", "advantage": -0.5}]
    >>> [(r["trajectory_id"], r["turn_index"], round(r["advantage"], 3))
    ...  for r in step_advantages(rows, {"a": [1.0, 1.0], "b": [0.0]}, 0.5)]
    [('a', 0, 1.077), ('a', 1, 0.789), ('b', 0, -1.077)]
    """
    norm = process_normalised(rows, process)
    out = []
    for r in rows:
        tid = r["trajectory_id"]
        values = process.get(tid, [])
        ret = 0.0
        tail = []
        for k in reversed(range(len(values))):
            ret += norm[tid][k]
            tail.append(r | {"turn_index": k, "process": float(values[k]),
                             "process_return": ret, "advantage": r["advantage"] + weight * ret})
        out += reversed(tail)
    return out


def zero_variance_share(rows: list[dict[str, Any]]) -> float:
    """The share of groups whose rewards are all equal (a group std under 1e-6, as `v_rl_round` counts them, or a
    group of one).

    >>> zero_variance_share([{"group_id": "p", "group_std": 0.0}, {"group_id": "q", "group_std": 0.5}])
    0.5
    """
    groups = {r["group_id"]: (r["group_std"] or 0.0) < 1e-6 for r in rows}
    return sum(groups.values()) / max(len(groups), 1)
