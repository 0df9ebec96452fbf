"""Reward-model metrics for the `evaluate` stage: best-of-N, maj@N, pass@N, B-STaR, step P/R/F1, ProcessBench.

Plain Python over plain lists, so every number can be recomputed by hand from the store:

    .venv/bin/python -m pytest tests/unit/test_reward_eval.py components/reward_eval.py -q

Group metrics take one list per problem with its samples in sample order, read only the first `n`
of each, and average over problems. A problem with fewer than `n` samples is an error, not a
silently smaller N: otherwise best-of-16 on short groups would quietly be best-of-fewer.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence, TypeVar

from components.labeling import first_error

T = TypeVar("T")


def _first_n(groups: Sequence[Sequence[T]], n: int, metric: str) -> list[Sequence[T]]:
    """Each problem's first `n` samples; raises on bad `n`, no problems, or a problem that is too short.

    >>> _first_n([[1, 2, 3], [4, 5]], 2, "m")
    [[1, 2], [4, 5]]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{metric}: n must be a positive integer, got {n!r}")
    if not groups:
        raise ValueError(f"{metric}: no problems given (empty groups)")
    for i, g in enumerate(groups):
        if len(g) < n:
            raise ValueError(f"{metric}: problem {i} has {len(g)} samples, {metric} at n={n} needs {n}")
    return [g[:n] for g in groups]


def _top_index(samples: Sequence[tuple[float, bool]], problem: int, metric: str) -> int:
    """Index of the highest score, the earliest on ties; a NaN score raises (max() would misorder it).

    >>> _top_index([(0.2, False), (0.9, True), (0.9, False)], 0, "m")
    1
    """
    for j, (score, _) in enumerate(samples):
        if math.isnan(score):
            raise ValueError(f"{metric}: problem {problem} sample {j} has a NaN score")
    # max() keeps the first of equal keys, which is the earliest-sample tie rule.
    return max(range(len(samples)), key=lambda j: samples[j][0])


def best_of_n(groups: list[list[tuple[float, bool]]], n: int) -> float:
    """Accuracy of picking, per problem, the top-scored of its first `n` samples (ties -> earliest).

    `groups`: per problem, its samples in sample order as (reward score, verified correct).

    >>> best_of_n([[(0.1, False), (0.7, True), (0.9, False)], [(0.5, True), (0.5, False)]], 2)
    1.0
    >>> best_of_n([[(0.1, False), (0.7, True), (0.9, False)]], 3)
    0.0
    """
    picked = [g[_top_index(g, i, "best_of_n")][1] for i, g in enumerate(_first_n(groups, n, "best_of_n"))]
    return sum(picked) / len(picked)


def majority_at_n(groups: list[list[tuple[str | None, bool]]], n: int) -> float:
    """maj@n: per problem, the most common non-None answer among the first `n` (ties -> earliest).

    A problem counts as correct iff some sample with that answer is correct; no answer at all is wrong.

    >>> majority_at_n([[("3", False), ("4", True), ("4", True)], [(None, False), (None, False)]], 2)
    0.0
    >>> majority_at_n([[("3", False), ("4", True), ("4", True)], [(None, False), ("7", True)]], 3)
    Traceback (most recent call last):
    ValueError: majority_at_n: problem 1 has 2 samples, majority_at_n at n=3 needs 3
    """
    hits = []
    for g in _first_n(groups, n, "majority_at_n"):
        counts = Counter(a for a, _ in g if a is not None)
        if not counts:
            hits.append(False)
            continue
        top = max(counts.values())
        answer = next(a for a, _ in g if a is not None and counts[a] == top)
        hits.append(any(ok for a, ok in g if a == answer))
    return sum(hits) / len(hits)


def pass_at_n(groups: list[list[bool]], n: int) -> float:
    """pass@n: fraction of problems with any correct sample among the first `n`.

    >>> pass_at_n([[False, True], [False, False, True]], 2)
    0.5
    """
    return sum(any(g) for g in _first_n(groups, n, "pass_at_n")) / len(groups)


def distinct_correct(groups: list[list[tuple[str, bool]]], n: int) -> float:
    """B-STaR (Zeng et al. 2024) exploration: mean number of distinct correct completions per problem.

    Distinct by exact text among the first `n`; a collapsed policy repeats one correct answer, which
    pass@n cannot see but this can.

    >>> distinct_correct([[("a", True), ("a", True), ("b", True)], [("c", False), ("d", True), ("e", True)]], 3)
    2.0
    """
    firsts = _first_n(groups, n, "distinct_correct")
    return sum(len({text for text, ok in g if ok}) for g in firsts) / len(firsts)


def selection_accuracy(groups: list[list[tuple[float, bool]]], n: int) -> float:
    """B-STaR (Zeng et al. 2024) exploitation: how often the top-scored sample is correct, on mixed problems only.

    Only problems whose first `n` samples hold both a correct and an incorrect one count: elsewhere
    any pick scores the same, so the reward model's choice says nothing. NaN when none are mixed.

    >>> selection_accuracy([[(0.9, True), (0.1, False)], [(0.9, False), (0.8, True)], [(0.5, True), (0.2, True)]], 2)
    0.5
    >>> selection_accuracy([[(0.5, True), (0.2, True)]], 2)
    nan
    """
    picked = [g[_top_index(g, i, "selection_accuracy")][1]
              for i, g in enumerate(_first_n(groups, n, "selection_accuracy"))
              if any(ok for _, ok in g) and not all(ok for _, ok in g)]
    return sum(picked) / len(picked) if picked else float("nan")


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def step_prf(pred: list[float], gold: list[bool], threshold: float = 0.5, positive: bool = True) -> dict[str, float]:
    """Step-level precision, recall, F1 and accuracy of PRM step scores against oracle labels.

    A step is predicted correct iff its score >= `threshold`; `gold` is True for a correct step.
    `positive=True` scores the correct-step class, `positive=False` the erroneous-step class (error
    detection, the harder and more telling one since most steps are correct). Zero denominators give 0.0.

    >>> step_prf([0.9, 0.8, 0.2, 0.6], [True, False, False, True])
    {'precision': 0.6666666666666666, 'recall': 1.0, 'f1': 0.8, 'accuracy': 0.75, 'n': 4}
    >>> step_prf([0.9, 0.8, 0.2, 0.6], [True, False, False, True], positive=False)
    {'precision': 1.0, 'recall': 0.5, 'f1': 0.6666666666666666, 'accuracy': 0.75, 'n': 4}
    """
    if not pred:
        raise ValueError("step_prf: no steps given (empty pred)")
    if len(pred) != len(gold):
        raise ValueError(f"step_prf: {len(pred)} step scores but {len(gold)} gold labels")
    predicted = [(s >= threshold) == positive for s in pred]
    actual = [bool(g) == positive for g in gold]
    tp = sum(p and a for p, a in zip(predicted, actual))
    precision, recall = _ratio(tp, sum(predicted)), _ratio(tp, sum(actual))
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    accuracy = sum(p == a for p, a in zip(predicted, actual)) / len(pred)
    return {"precision": precision, "recall": recall, "f1": f1, "accuracy": accuracy, "n": len(pred)}


def step_auc(pred: list[float], gold: list[bool]) -> float:
    """P(a right step outscores a wrong one), ties counting half: the Mann-Whitney U statistic over all
    pairs, so the ranking quality best-of-N relies on, free of step_prf's threshold. NaN without both classes.

    >>> step_auc([0.9, 0.8, 0.1, 0.8], [True, True, False, False])
    0.875
    >>> step_auc([0.3, 0.3], [True, False]), step_auc([0.5], [True]) != step_auc([0.5], [True])
    (0.5, True)
    """
    if len(pred) != len(gold):
        raise ValueError(f"step_auc: {len(pred)} step scores but {len(gold)} gold labels")
    order = sorted(range(len(pred)), key=lambda i: pred[i])
    ranks, i = [0.0] * len(pred), 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and pred[order[j + 1]] == pred[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    n_pos = sum(bool(g) for g in gold)
    n_neg = len(gold) - n_pos
    if not n_pos or not n_neg:
        return float("nan")
    return (sum(r for r, g in zip(ranks, gold) if g) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def processbench(pred_steps: list[list[float]], gold_steps: list[list[bool]], threshold: float = 0.5) -> dict[str, float]:
    """ProcessBench (Zheng et al. 2024, https://arxiv.org/abs/2412.06559): does the PRM find the FIRST error?

    Per trajectory the predicted first error is the first step scored below `threshold` (-1 if none)
    and must equal the gold one exactly. Accuracy is reported separately on erroneous and all-correct
    trajectories, and F1 is their harmonic mean, so a PRM that flags nothing (or everything) scores 0.
    If one subset is empty the F1 is the other's accuracy.

    >>> processbench([[0.9, 0.2, 0.1], [0.9, 0.8], [0.9, 0.9]], [[True, False, False], [True, True], [False, True]])
    {'acc_erroneous': 0.5, 'acc_correct': 1.0, 'f1': 0.6666666666666666, 'n_erroneous': 2, 'n_correct': 1}
    """
    if not pred_steps:
        raise ValueError("processbench: no trajectories given (empty pred_steps)")
    if len(pred_steps) != len(gold_steps):
        raise ValueError(f"processbench: {len(pred_steps)} predicted trajectories but {len(gold_steps)} gold")
    hits: dict[bool, list[bool]] = {True: [], False: []}  # keyed by "has a gold error"
    for i, (pred, gold) in enumerate(zip(pred_steps, gold_steps)):
        if len(pred) != len(gold):
            raise ValueError(f"processbench: trajectory {i} has {len(pred)} step scores but {len(gold)} gold labels")
        want = first_error(gold)
        got = first_error([s >= threshold for s in pred])
        hits[want != -1].append(got == want)
    err, ok = hits[True], hits[False]
    acc_err, acc_ok = _ratio(sum(err), len(err)), _ratio(sum(ok), len(ok))
    if not err or not ok:
        f1 = acc_ok if not err else acc_err
    else:
        f1 = 2 * acc_err * acc_ok / (acc_err + acc_ok) if acc_err and acc_ok else 0.0
    return {"acc_erroneous": acc_err, "acc_correct": acc_ok, "f1": f1, "n_erroneous": len(err), "n_correct": len(ok)}


def disagreement_rate(scores: list[float], correct: list[bool], threshold: float = 0.5) -> float:
    """Reward-hacking monitor: fraction of samples where the reward model and the verifier disagree.

    A rising rate over rounds means the policy is finding what the reward model likes but the
    verifier rejects (or the reward model is falling behind the policy).

    >>> disagreement_rate([0.9, 0.9, 0.1, 0.5], [True, False, False, False])
    0.5
    """
    if not scores:
        raise ValueError("disagreement_rate: no scores given (empty scores)")
    if len(scores) != len(correct):
        raise ValueError(f"disagreement_rate: {len(scores)} scores but {len(correct)} correctness labels")
    return sum((s >= threshold) != bool(c) for s, c in zip(scores, correct)) / len(scores)


def repeated_step_rate(step_lists: list[list[str]]) -> float:
    """Fraction of trajectories with some step text appearing twice, a degenerate reward-hacking pattern.

    Steps compare by exact text (the domains' `split_steps` already strips them); a trajectory with no
    steps has no repeat.

    >>> repeated_step_rate([["a", "b", "a"], ["a", "b"], [], ["x", "x"]])
    0.5
    """
    if not step_lists:
        raise ValueError("repeated_step_rate: no trajectories given (empty step_lists)")
    return sum(len(set(steps)) < len(steps) for steps in step_lists) / len(step_lists)
