"""Stage `evaluate`: held-out greedy accuracy and maj@k per difficulty level.

Evaluation trajectories are stored like any other (purpose='eval'), so every number here can be
recomputed from the store with SQL.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from components.domains.base import Domain, Problem, step_verdicts
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
    model_id: str, maj_k: int, temperature: float, max_new_tokens: int, seed: int, n_samples: int | None = None,
) -> tuple[GeneratedBatch, list[dict[str, Any]], list[dict[str, Any]]]:
    """Returns (eval trajectories, their verifications, evaluation rows).

    `n_samples` (default `maj_k`) samples per problem are drawn; maj@k and pass@k read the first `maj_k`,
    and the rest serve best-of-N (`reward_metrics`)."""
    n_samples = max(maj_k, n_samples or 0)
    kw = dict(experiment=experiment, round=round, purpose="eval", policy_model_id=model_id,
              top_p=1.0, max_new_tokens=max_new_tokens, split="test")
    greedy = generate(domain, backend, problems, n=1, temperature=0.0, seed=seed, **kw)
    sampled = generate(domain, backend, problems, n=n_samples, temperature=temperature, seed=seed + 1,
                       first_sample_index=1, **kw) if n_samples > 1 else GeneratedBatch([], [], [])
    batch = GeneratedBatch(greedy.problems, greedy.trajectories + sampled.trajectories, greedy.steps + sampled.steps)
    answers = {p.problem_id: p.answer for p in problems}
    vers = verify(batch.trajectories, answers, domain.verify, name=f"{domain.name}.verify", version="1")
    correct = {v["trajectory_id"]: bool(v["correct"]) for v in vers}
    return batch, vers, outcome_rows(domain, problems, batch.trajectories, correct, maj_k=maj_k,
                                     experiment=experiment, round=round, model_id=model_id)


def outcome_rows(domain: Domain, problems: list[Problem], trajectories: list[dict[str, Any]], correct: dict[str, bool],
                 *, maj_k: int, experiment: str, round: int, model_id: str,
                 turns: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`evaluations` rows of held-out trajectories: greedy accuracy (sample 0) and, with `maj_k` > 1, maj@k and
    pass@k over samples 1..maj_k of each problem. `turns`: an environment's episodes' rows, which its step checker
    reads."""
    per_level: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    samples_by_problem: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in trajectories:
        if t["sample_index"] > 0:
            samples_by_problem[t["problem_id"]].append(t)
    level_of = {p.problem_id: p.level for p in problems}
    greedy = [t for t in trajectories if t["sample_index"] == 0]
    verdicts = step_verdicts(domain, greedy, turns)
    for t in greedy:
        right = correct[t["trajectory_id"]]
        per_level[t["level"]]["greedy_acc"].append(float(right))
        # Where the domain has a step checker: right answers whose worked steps also check out (the skipped
        # operations and cancelling slips an outcome verifier lets through), for evaluation only.
        sound = verdicts[t["trajectory_id"]]
        if sound is not None:
            per_level[t["level"]]["greedy_sound_acc"].append(float(right and sound))
            if right:
                per_level[t["level"]]["greedy_unsound_rate"].append(float(not sound))
    if maj_k > 1:
        for p in problems:
            group = sorted(samples_by_problem[p.problem_id], key=lambda t: t["sample_index"])[:maj_k]
            maj = majority_answer([t["answer"] for t in group])
            # The majority answer is right iff a sample that gave it verified correct.
            ok = maj is not None and correct[next(t for t in group if t["answer"] == maj)["trajectory_id"]]
            per_level[level_of[p.problem_id]][f"maj_at_{maj_k}"].append(float(ok))
            per_level[level_of[p.problem_id]][f"pass_at_{maj_k}"].append(
                float(any(correct[t["trajectory_id"]] for t in group)))
    return _rows(per_level, experiment, round, model_id)


def _rows(per_level: dict[int, dict[str, list[float]]], experiment: str, round: int,
          model_id: str, pooled: dict[str, list[float]] | None = None) -> list[dict[str, Any]]:
    """`evaluations` rows: the mean of each metric's per-item values per level, and over all levels
    (level -1). NaN items (a metric undefined for that problem) are left out of the mean. `pooled`
    gives level -1 values computed over all levels at once (ratios such as F1 do not average)."""
    rows = []
    overall: dict[str, list[float]] = defaultdict(list)
    for level in sorted(per_level):
        for metric, vals in sorted(per_level[level].items()):
            overall[metric].extend(vals)
    overall.update(pooled or {})
    for level, metrics in [*sorted(per_level.items()), (-1, overall)]:
        for metric, vals in sorted(metrics.items()):
            vals = [v for v in vals if v == v]
            if vals:
                rows.append({"experiment_id": experiment, "round": round, "model_id": model_id, "level": level,
                             "metric": metric, "value": sum(vals) / len(vals), "n": len(vals)})
    return rows


def reward_metrics(
    trajectories: list[dict[str, Any]], correct: dict[str, bool], *, best_of_n: list[int], experiment: str,
    round: int, model_id: str, prm_steps: dict[str, list[float]] | None = None,
    orm_scores: dict[str, float] | None = None, oracle: dict[str, list[bool]] | None = None,
    steps: dict[str, list[str]] | None = None, implicit_scores: dict[str, float] | None = None,
    confidence_scores: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Reward-model metrics on held-out samples, as `evaluations` rows per level and overall.

    - `maj_at_N`, `pass_at_N`, and `prm_bon_at_N` / `orm_bon_at_N` / `implicit_bon_at_N` /
      `confidence_bon_at_N`: best-of-N picks the top reward among a problem's first N samples (PRM: the weakest
      step, `min`, as in Lightman et al. 2023; `implicit_scores` and `confidence_scores`, the sampler's own
      weakest step as DeepConf ranks traces, are already one value per trajectory);
    - B-STaR (Zeng et al. 2024) exploration and exploitation: `distinct_correct_at_N` and
      `prm_selection_acc_at_N` (on problems with both right and wrong samples);
    - step level against the oracle: `prm_step_*` (the correct-step class), `prm_error_*` (the
      erroneous-step class), and ProcessBench's first-error accuracies and F1 (Zheng et al. 2024);
    - the reward-hacking monitor: `prm_verifier_disagreement` and `*_repeated_step_rate`.
    """
    from components import reward_eval as re_

    per_level: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in trajectories:
        groups[t["problem_id"]]  # every problem is checked against N, even one with its greedy answer only
        if t["sample_index"] > 0:  # index 0 is the greedy answer
            groups[t["problem_id"]].append(t)
    level_of_problem = {t["problem_id"]: t["level"] for t in trajectories}
    prm_min = {tid: min(v) if v else 0.0 for tid, v in (prm_steps or {}).items()}
    for pid, group in sorted(groups.items()):
        group.sort(key=lambda t: t["sample_index"])
        m = per_level[level_of_problem[pid]]
        ok = [bool(correct[t["trajectory_id"]]) for t in group]
        for n in best_of_n:
            if len(group) < n:
                raise ValueError(f"reward_metrics: problem {pid} has {len(group)} samples, best-of-{n} needs {n}")
            m[f"maj_at_{n}"].append(re_.majority_at_n([[(t["answer"], o) for t, o in zip(group, ok)]], n))
            m[f"pass_at_{n}"].append(re_.pass_at_n([ok], n))
            m[f"distinct_correct_at_{n}"].append(re_.distinct_correct([[(t["completion"], o) for t, o in zip(group, ok)]], n))
            for name, scores in (("prm", prm_min if prm_steps else None), ("orm", orm_scores),
                                 ("implicit", implicit_scores), ("confidence", confidence_scores)):
                if scores is not None:
                    g = [[(scores[t["trajectory_id"]], o) for t, o in zip(group, ok)]]
                    m[f"{name}_bon_at_{n}"].append(re_.best_of_n(g, n))
                    if name == "prm":
                        m[f"prm_selection_acc_at_{n}"].append(re_.selection_accuracy(g, n))
    level_of = {t["trajectory_id"]: t["level"] for t in trajectories}
    pooled: dict[str, list[float]] = defaultdict(list)
    labelled = [t for t in sorted(prm_steps or {}) if oracle and oracle.get(t) and len(oracle[t]) == len(prm_steps[t])]
    if labelled:
        _step_metrics(pooled, [prm_steps[t] for t in labelled], [oracle[t] for t in labelled])
    if prm_steps:
        by_level: dict[int, list[str]] = defaultdict(list)
        for tid in sorted(prm_steps):
            by_level[level_of[tid]].append(tid)
        for level, tids in by_level.items():
            per_level[level]["prm_verifier_disagreement"] += [
                float(re_.disagreement_rate([prm_min[t]], [bool(correct[t])])) for t in tids]
            mine = [t for t in labelled if level_of[t] == level]
            _step_metrics(per_level[level], [prm_steps[t] for t in mine], [oracle[t] for t in mine])
            if steps:
                per_level[level]["eval_repeated_step_rate"] += [re_.repeated_step_rate([steps.get(t, [])]) for t in tids]
    return _rows(per_level, experiment, round, model_id, pooled)


def _step_metrics(m: dict[str, list[float]], pred: list[list[float]], gold: list[list[bool]]) -> None:
    """Step-level P/R/F1 and ProcessBench numbers: ratios over all the steps given, one value each."""
    from components import reward_eval as re_

    if not pred:
        return
    flat_p, flat_g = [v for p in pred for v in p], [v for g in gold for v in g]
    for prefix, positive in (("prm_step", True), ("prm_error", False)):
        prf = re_.step_prf(flat_p, flat_g, positive=positive)
        for k in ("precision", "recall", "f1"):
            m[f"{prefix}_{k}"].append(prf[k])
    pb = re_.processbench(pred, gold)
    m["processbench_f1"].append(pb["f1"])
    m["first_error_acc_erroneous"].append(pb["acc_erroneous"])
    m["first_error_acc_correct"].append(pb["acc_correct"])
