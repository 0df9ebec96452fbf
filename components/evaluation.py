"""Stage `evaluate`: held-out greedy accuracy and maj@k per difficulty level.

Evaluation trajectories are stored like any other (purpose='eval'), so every number here can be
recomputed from the store with SQL.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from components.domains.base import Domain, Problem
from components.generation import GeneratedBatch, generate
from components.models.backends import GenerationBackend
from components.verification import verify


def majority_answer(answers: list[str | None]) -> str | None:
    """Most common non-empty answer; ties go to the earliest sample (deterministic).

    >>> majority_answer(["3", None, "4", "4", "3"])
    '3'
    >>> majority_answer([None, None]) is None
    True
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def evaluate(
    domain: Domain, backend: GenerationBackend, problems: list[Problem], *, experiment: str, round: int,
    model_id: str, maj_k: int, temperature: float, max_new_tokens: int, seed: int,
) -> tuple[GeneratedBatch, list[dict[str, Any]], list[dict[str, Any]]]:
    """Returns (eval trajectories, their verifications, evaluation rows)."""
    kw = dict(experiment=experiment, round=round, purpose="eval", policy_model_id=model_id,
              top_p=1.0, max_new_tokens=max_new_tokens, split="test")
    greedy = generate(domain, backend, problems, n=1, temperature=0.0, seed=seed, **kw)
    sampled = generate(domain, backend, problems, n=maj_k, temperature=temperature, seed=seed + 1,
                       first_sample_index=1, **kw) if maj_k > 1 else GeneratedBatch([], [], [])
    batch = GeneratedBatch(greedy.problems, greedy.trajectories + sampled.trajectories, greedy.steps + sampled.steps)
    answers = {p.problem_id: p.answer for p in problems}
    vers = verify(batch.trajectories, answers, domain.verify, name=f"{domain.name}.verify", version="1")
    correct = {v["trajectory_id"]: bool(v["correct"]) for v in vers}

    per_level: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    samples_by_problem: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in sampled.trajectories:
        samples_by_problem[t["problem_id"]].append(t)
    level_of = {p.problem_id: p.level for p in problems}
    for t in greedy.trajectories:
        per_level[t["level"]]["greedy_acc"].append(float(correct[t["trajectory_id"]]))
    if maj_k > 1:
        for p in problems:
            group = sorted(samples_by_problem[p.problem_id], key=lambda t: t["sample_index"])
            maj = majority_answer([t["answer"] for t in group])
            # The majority answer is right iff a sample that gave it verified correct.
            ok = maj is not None and correct[next(t for t in group if t["answer"] == maj)["trajectory_id"]]
            per_level[level_of[p.problem_id]][f"maj_at_{maj_k}"].append(float(ok))
            per_level[level_of[p.problem_id]][f"pass_at_{maj_k}"].append(
                float(any(correct[t["trajectory_id"]] for t in group)))
    rows = []
    overall: dict[str, list[float]] = defaultdict(list)
    for level in sorted(per_level):
        for metric, vals in sorted(per_level[level].items()):
            overall[metric].extend(vals)
            rows.append({"experiment_id": experiment, "round": round, "model_id": model_id, "level": level,
                         "metric": metric, "value": sum(vals) / len(vals), "n": len(vals)})
    for metric, vals in sorted(overall.items()):
        rows.append({"experiment_id": experiment, "round": round, "model_id": model_id, "level": -1,
                     "metric": metric, "value": sum(vals) / len(vals), "n": len(vals)})
    return batch, vers, rows
