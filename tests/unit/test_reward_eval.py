"""Reward-model metrics on hand-computed cases: ties, first-n windows, edge cases and error messages.

    .venv/bin/python -m pytest tests/unit/test_reward_eval.py components/reward_eval.py -q
"""

from __future__ import annotations

import math

import pytest

from components.labeling import first_error
from components.reward_eval import (
    best_of_n,
    disagreement_rate,
    distinct_correct,
    majority_at_n,
    pass_at_n,
    processbench,
    repeated_step_rate,
    selection_accuracy,
    step_prf,
)

# --- best_of_n ---------------------------------------------------------------------------------


def test_best_of_n_reads_only_the_first_n_samples():
    # The top score overall (0.99, correct) is sample 2; among the first 2 the top is 0.6 (wrong).
    groups = [[(0.1, True), (0.6, False), (0.99, True)]]
    assert best_of_n(groups, 2) == 0.0
    assert best_of_n(groups, 3) == 1.0


def test_best_of_n_tie_goes_to_earliest_sample():
    assert best_of_n([[(0.5, False), (0.5, True)]], 2) == 0.0
    assert best_of_n([[(0.5, True), (0.5, False)]], 2) == 1.0


def test_best_of_n_averages_over_problems():
    groups = [[(0.2, False), (0.8, True)], [(0.9, False), (0.1, True)], [(0.3, True), (0.3, False)], [(-1.0, True), (-2.0, False)]]
    assert best_of_n(groups, 2) == pytest.approx(3 / 4)


def test_best_of_n_n_equals_one_is_first_sample():
    assert best_of_n([[(0.0, True), (1.0, False)], [(0.9, False), (1.0, True)]], 1) == 0.5


def test_best_of_n_short_problem_names_its_index():
    with pytest.raises(ValueError, match=r"problem 1 has 2 samples.*n=3"):
        best_of_n([[(0.1, True)] * 3, [(0.1, True)] * 2, [(0.1, True)] * 3], 3)


def test_best_of_n_empty_problem_names_its_index():
    with pytest.raises(ValueError, match=r"problem 0 has 0 samples"):
        best_of_n([[]], 1)


def test_best_of_n_empty_groups_and_bad_n():
    with pytest.raises(ValueError, match="empty groups"):
        best_of_n([], 1)
    with pytest.raises(ValueError, match="n must be a positive integer, got 0"):
        best_of_n([[(0.1, True)]], 0)


def test_best_of_n_nan_score_names_problem_and_sample():
    with pytest.raises(ValueError, match=r"problem 0 sample 1 has a NaN score"):
        best_of_n([[(0.1, True), (float("nan"), False)]], 2)


# --- majority_at_n -----------------------------------------------------------------------------


def test_majority_at_n_most_common_answer():
    # "4" x2 beats "3" x1; one "4" sample is verified correct.
    assert majority_at_n([[("3", False), ("4", False), ("4", True)]], 3) == 1.0
    # "3" wins on count; the correct "4" is outvoted.
    assert majority_at_n([[("3", False), ("3", False), ("4", True)]], 3) == 0.0


def test_majority_at_n_tie_goes_to_earliest_answer():
    assert majority_at_n([[("3", False), ("4", True), ("4", True), ("3", False)]], 4) == 0.0
    assert majority_at_n([[("4", True), ("3", False), ("3", False), ("4", True)]], 4) == 1.0


def test_majority_at_n_ignores_none_answers_and_no_answer_is_wrong():
    # None x2 does not outvote "7" x1.
    assert majority_at_n([[(None, False), (None, False), ("7", True)]], 3) == 1.0
    assert majority_at_n([[(None, False), (None, False), ("7", True)]], 2) == 0.0


def test_majority_at_n_reads_only_the_first_n():
    groups = [[("3", False), ("4", True), ("4", True)]]
    assert majority_at_n(groups, 2) == 0.0  # "3" and "4" tie in the first 2; "3" is earlier
    assert majority_at_n(groups, 3) == 1.0


def test_majority_at_n_averages_and_raises():
    assert majority_at_n([[("1", True)], [("2", False)]], 1) == 0.5
    with pytest.raises(ValueError, match=r"majority_at_n: problem 1 has 1 samples"):
        majority_at_n([[("1", True), ("1", True)], [("2", False)]], 2)
    with pytest.raises(ValueError, match="empty groups"):
        majority_at_n([], 1)


# --- pass_at_n ---------------------------------------------------------------------------------


def test_pass_at_n_any_correct_among_first_n():
    groups = [[False, False, True], [True, False, False], [False, False, False]]
    assert pass_at_n(groups, 2) == pytest.approx(1 / 3)
    assert pass_at_n(groups, 3) == pytest.approx(2 / 3)


def test_pass_at_n_raises():
    with pytest.raises(ValueError, match=r"pass_at_n: problem 0 has 1 samples"):
        pass_at_n([[True]], 2)
    with pytest.raises(ValueError, match="empty groups"):
        pass_at_n([], 1)


# --- distinct_correct --------------------------------------------------------------------------


def test_distinct_correct_counts_unique_correct_texts():
    groups = [
        [("a", True), ("a", True), ("b", True), ("c", False)],  # a, b
        [("x", False), ("x", False), ("y", False), ("z", True)],  # z
    ]
    assert distinct_correct(groups, 4) == 1.5
    # First 2: {a} and {} -> mean 0.5; "b" and "z" are past the window.
    assert distinct_correct(groups, 2) == 0.5


def test_distinct_correct_same_text_wrong_and_right_counts_once():
    assert distinct_correct([[("a", False), ("a", True), ("a", True)]], 3) == 1.0


def test_distinct_correct_raises():
    with pytest.raises(ValueError, match=r"distinct_correct: problem 0 has 1 samples"):
        distinct_correct([[("a", True)]], 2)


# --- selection_accuracy ------------------------------------------------------------------------


def test_selection_accuracy_only_mixed_problems_count():
    groups = [
        [(0.9, True), (0.1, False)],  # mixed, picks right
        [(0.9, False), (0.2, True)],  # mixed, picks wrong
        [(0.5, True), (0.4, True)],  # all right: left out
        [(0.5, False), (0.6, False)],  # all wrong: left out
        [(0.3, True), (0.7, False)],  # mixed, picks wrong
    ]
    assert selection_accuracy(groups, 2) == pytest.approx(1 / 3)


def test_selection_accuracy_reads_only_the_first_n():
    # Over all 3 samples it is mixed and the top (0.9) is right; the first 2 are all wrong -> not mixed.
    groups = [[(0.1, False), (0.2, False), (0.9, True)]]
    assert selection_accuracy(groups, 3) == 1.0
    assert math.isnan(selection_accuracy(groups, 2))
    # Mixed in the first 2, and the top there (0.5, wrong) differs from the overall top (0.9, right).
    assert selection_accuracy([[(0.5, False), (0.1, True), (0.9, True)]], 2) == 0.0


def test_selection_accuracy_tie_goes_to_earliest():
    assert selection_accuracy([[(0.5, False), (0.5, True)]], 2) == 0.0


def test_selection_accuracy_raises():
    with pytest.raises(ValueError, match=r"selection_accuracy: problem 0 has 1 samples"):
        selection_accuracy([[(0.5, True)]], 2)


# --- step_prf ----------------------------------------------------------------------------------


def test_step_prf_correct_class():
    # predicted correct: T T F T F ; gold: T F F T T  -> TP=2, FP=1, FN=1, TN=1
    m = step_prf([0.9, 0.6, 0.1, 0.5, 0.49], [True, False, False, True, True])
    assert m["precision"] == pytest.approx(2 / 3)
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 / 3)
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["n"] == 5


def test_step_prf_error_class():
    # Same steps, erroneous class: predicted err F F T F T ; gold err F T T F F -> TP=1, FP=1, FN=1
    m = step_prf([0.9, 0.6, 0.1, 0.5, 0.49], [True, False, False, True, True], positive=False)
    assert m["precision"] == pytest.approx(1 / 2)
    assert m["recall"] == pytest.approx(1 / 2)
    assert m["f1"] == pytest.approx(1 / 2)
    assert m["accuracy"] == pytest.approx(3 / 5)


def test_step_prf_threshold_is_inclusive_and_movable():
    assert step_prf([0.5], [True])["precision"] == 1.0
    m = step_prf([0.5, 0.8], [False, True], threshold=0.7)
    assert (m["precision"], m["recall"], m["accuracy"]) == (1.0, 1.0, 1.0)


def test_step_prf_zero_denominators_give_zero():
    # No step predicted or gold erroneous: error-class precision and recall both have 0 denominators.
    m = step_prf([0.9, 0.8], [True, True], positive=False)
    assert (m["precision"], m["recall"], m["f1"], m["accuracy"]) == (0.0, 0.0, 0.0, 1.0)
    # Everything predicted wrong, everything right: correct class has TP=0.
    m = step_prf([0.1, 0.2], [True, True])
    assert (m["precision"], m["recall"], m["f1"], m["accuracy"]) == (0.0, 0.0, 0.0, 0.0)


def test_step_prf_raises():
    with pytest.raises(ValueError, match="empty pred"):
        step_prf([], [])
    with pytest.raises(ValueError, match="2 step scores but 3 gold labels"):
        step_prf([0.1, 0.2], [True, True, False])


# --- first_error (components.labeling; processbench's first error) ------------------------------


def test_first_error():
    assert first_error([True, False, True, False]) == 1
    assert first_error([False]) == 0
    assert first_error([True, True, True]) == -1
    assert first_error([]) == -1


# --- processbench ------------------------------------------------------------------------------


def test_processbench_hand_computed():
    pred = [
        [0.9, 0.3, 0.2],  # first pred error 1, gold 1 -> hit
        [0.2, 0.9, 0.9],  # first pred error 0, gold 2 -> miss (too early)
        [0.9, 0.9, 0.9],  # no pred error, gold 1 -> miss
        [0.9, 0.8],  # no pred error, gold -1 -> hit
        [0.9, 0.1],  # pred error 1, gold -1 -> miss
    ]
    gold = [
        [True, False, False],
        [True, True, False],
        [True, False, True],
        [True, True],
        [True, True],
    ]
    m = processbench(pred, gold)
    assert m["n_erroneous"] == 3 and m["n_correct"] == 2
    assert m["acc_erroneous"] == pytest.approx(1 / 3)
    assert m["acc_correct"] == pytest.approx(1 / 2)
    assert m["f1"] == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))


def test_processbench_later_errors_do_not_matter_only_the_first():
    # Gold first error at 1; the PRM flags 1 but misses the later one at 2: still a hit.
    m = processbench([[0.9, 0.1, 0.9]], [[True, False, False]])
    assert m["acc_erroneous"] == 1.0


def test_processbench_threshold():
    m = processbench([[0.9, 0.6]], [[True, False]], threshold=0.7)
    assert m["acc_erroneous"] == 1.0
    assert processbench([[0.9, 0.6]], [[True, False]])["acc_erroneous"] == 0.0


def test_processbench_f1_zero_if_either_accuracy_is_zero():
    # A PRM that never flags anything: perfect on correct ones, 0 on erroneous ones -> F1 0.
    m = processbench([[0.9, 0.9], [0.9, 0.9]], [[True, False], [True, True]])
    assert (m["acc_erroneous"], m["acc_correct"], m["f1"]) == (0.0, 1.0, 0.0)


def test_processbench_one_empty_subset_uses_the_other():
    m = processbench([[0.9, 0.1], [0.9, 0.9]], [[True, False], [True, False]])
    assert (m["n_correct"], m["acc_correct"], m["acc_erroneous"], m["f1"]) == (0, 0.0, 0.5, 0.5)
    m = processbench([[0.9], [0.1]], [[True], [True]])
    assert (m["n_erroneous"], m["acc_correct"], m["f1"]) == (0, 0.5, 0.5)


def test_processbench_raises():
    with pytest.raises(ValueError, match=r"trajectory 1 has 1 step scores but 2 gold labels"):
        processbench([[0.9], [0.9]], [[True], [True, False]])
    with pytest.raises(ValueError, match="2 predicted trajectories but 1 gold"):
        processbench([[0.9], [0.9]], [[True]])
    with pytest.raises(ValueError, match="empty pred_steps"):
        processbench([], [])


# --- disagreement_rate -------------------------------------------------------------------------


def test_disagreement_rate():
    # 0.5 >= 0.5 says correct, verifier says wrong -> disagree; 0.49 vs wrong -> agree.
    assert disagreement_rate([0.5, 0.49, 0.9, 0.1], [False, False, True, True]) == 0.5
    assert disagreement_rate([0.6], [True], threshold=0.7) == 1.0


def test_disagreement_rate_raises():
    with pytest.raises(ValueError, match="empty scores"):
        disagreement_rate([], [])
    with pytest.raises(ValueError, match="2 scores but 1 correctness labels"):
        disagreement_rate([0.1, 0.2], [True])


# --- repeated_step_rate ------------------------------------------------------------------------


def test_repeated_step_rate():
    steps = [
        ["2+3=5", "5*2=10", "2+3=5"],  # repeat, not adjacent
        ["2+3=5", "5*2=10"],
        ["x", "x"],
        [],  # no steps: no repeat
    ]
    assert repeated_step_rate(steps) == 0.5
    assert repeated_step_rate([[]]) == 0.0


def test_repeated_step_rate_is_exact_text():
    assert repeated_step_rate([["a=1", "a = 1"]]) == 0.0


def test_repeated_step_rate_raises():
    with pytest.raises(ValueError, match="empty step_lists"):
        repeated_step_rate([])
