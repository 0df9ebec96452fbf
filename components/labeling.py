"""Step labels for the `score` stage: Monte Carlo rollouts (Math-Shepherd) and a domain's oracle.

    items = [{"trajectory_id": "t1", "problem_id": "p1", "prompt": "3+4-2\\n",
              "steps": ["3+4=7", "7-2=5", "#### 5"], "answer_ref": "5"}]
    rows, stats = mc_step_labels(ArithDomain(), get_backend("hf", policy_path), items, k=8,
                                 temperature=0.8, max_new_tokens=96, seed=0)
    rows += oracle_labels(ArithDomain(), {p.problem_id: p for p in problems}, items)

Math-Shepherd (Wang et al. 2024, https://arxiv.org/abs/2312.08935) values a step by completing the
solution from it k times: the soft label is the fraction of completions that reach the right answer,
the hard label is whether any does. Rows are `step_labels` rows: {"trajectory_id", "step_index",
"source", "value", "num_rollouts"}.
"""

from __future__ import annotations

from typing import Any

from components.domains.base import Domain, Problem
from components.models.backends import GenerationBackend


def mc_value(correct_flags: list[bool | float]) -> tuple[float, float]:
    """(soft, hard) Math-Shepherd value of a step from its rollouts' outcomes.

    >>> mc_value([True, False, False, True])
    (0.5, 1.0)
    >>> mc_value([0.0, 0.0])
    (0.0, 0.0)
    """
    if not correct_flags:
        raise ValueError("mc_value: no rollouts")
    hits = sum(1 for c in correct_flags if c)
    return hits / len(correct_flags), 1.0 if hits else 0.0


def _text(steps: list[str]) -> str:
    return "".join(s + "\n" for s in steps)


def _rows(tid: str, i: int, soft: float, hard: float, n: int) -> list[dict[str, Any]]:
    return [{"trajectory_id": tid, "step_index": i, "source": "mc_soft", "value": soft, "num_rollouts": n},
            {"trajectory_id": tid, "step_index": i, "source": "mc_hard", "value": hard, "num_rollouts": n}]


def mc_step_labels(domain: Domain, backend: GenerationBackend, items: list[dict[str, Any]], k: int, temperature: float,
                   max_new_tokens: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`mc_soft` and `mc_hard` rows for every step of every item, and rollout stats.

    Every non-final prefix of every trajectory goes to the backend in ONE `generate` call (n=k each),
    so the backend batches them all. Identical prefixes (same prompt, same steps so far, as when
    samples of one problem agree on their first steps) are rolled out once and share their label.
    The final step is labelled by the verifier on the trajectory itself: nothing is left to roll out.
    Items without a reference answer or without steps get no labels.
    """
    if k < 1:
        raise ValueError(f"mc_step_labels: k must be >= 1, got {k}")
    items = [it for it in items if it["answer_ref"] is not None and it["steps"]]
    slots: dict[tuple[str, str, str], int] = {}  # (prompt, steps so far, reference) -> rollout slot
    for it in items:
        for i in range(len(it["steps"]) - 1):
            slots.setdefault((it["prompt"], _text(it["steps"][:i + 1]), it["answer_ref"]), len(slots))
    samples = backend.generate([p + done for p, done, _ in slots], n=k, temperature=temperature, top_p=1.0,
                               max_new_tokens=max_new_tokens, seed=seed) if slots else []
    # Verify the solution text (steps so far + continuation), not the prompt: the prompt holds numbers too.
    texts = [done + s.text for (_, done, _), per in zip(slots, samples) for s in per]
    refs = [ref for (_, _, ref) in slots for _ in range(k)]
    outcomes = domain.verify(texts, refs) if texts else []
    values = [mc_value(outcomes[j * k:(j + 1) * k]) for j in range(len(slots))]
    finals = domain.verify([_text(it["steps"]) for it in items], [it["answer_ref"] for it in items]) if items else []

    rows: list[dict[str, Any]] = []
    for it, final in zip(items, finals):
        steps, tid = it["steps"], it["trajectory_id"]
        for i in range(len(steps) - 1):
            soft, hard = values[slots[(it["prompt"], _text(steps[:i + 1]), it["answer_ref"])]]
            rows += _rows(tid, i, soft, hard, k)
        rows += _rows(tid, len(steps) - 1, float(final or 0.0), float(final or 0.0), 0)
    stats = {
        "trajectories": len(items), "steps": sum(len(it["steps"]) for it in items), "unique_prefixes": len(slots),
        "rollouts": len(slots) * k, "generated_tokens": sum(s.num_tokens for per in samples for s in per),
    }
    return rows, stats


def oracle_labels(domain: Domain, problems_by_id: dict[str, Problem],
                  items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`oracle` rows (1.0 good, 0.0 bad) from `domain.oracle_step_labels`; [] for a domain without one."""
    rows = []
    for it in items:
        labels = domain.oracle_step_labels(problems_by_id[it["problem_id"]], _text(it["steps"]))
        if labels is None:
            return []
        if len(labels) != len(it["steps"]):
            raise ValueError(f"oracle_labels: {it['trajectory_id']} has {len(it['steps'])} steps but the oracle "
                             f"labelled {len(labels)}; the steps must come from domain.split_steps")
        rows += [{"trajectory_id": it["trajectory_id"], "step_index": i, "source": "oracle",
                  "value": 1.0 if ok else 0.0, "num_rollouts": 0} for i, ok in enumerate(labels)]
    return rows
