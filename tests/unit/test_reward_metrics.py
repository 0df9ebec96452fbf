"""`evaluation.reward_metrics` on a hand-built fixture: every expected number is worked out by hand below.

    .venv/bin/python -m pytest tests/unit/test_reward_metrics.py -q

Fixture: 3 problems over 2 levels, each with a greedy trajectory (sample_index 0) and 4 samples
(sample_index 1..4). PRM score of a trajectory for best-of-N = min of its step scores. A step is
predicted correct iff its PRM score >= 0.5 (the default threshold everywhere).

    tid   pid lvl idx answer ok  completion  prm steps     min   orm   steps (repeat?)
    p1_0  p1  1   0   "4"    T   g1          [.9, .95]     .9    .99
    p1_1  p1  1   1   "4"    T   c4a         [.8, .3]      .3    .2    ["a", "a"]  repeat
    p1_2  p1  1   2   "5"    F   c5          [.7, .6]      .6    .7
    p1_3  p1  1   3   "5"    F   c5b         [.4]          .4    .9    (absent from `steps`)
    p1_4  p1  1   4   "4"    T   c4b         [.9, .8]      .8    .5
    p2_0  p2  1   0   "8"    F   g2          [.95]         .95   .95
    p2_1  p2  1   1   "7"    T   x7          [.9]          .9    .6
    p2_2  p2  1   2   "7"    T   x7          [.2, .9]      .2    .8    ["b", "b"]  repeat
    p2_3  p2  1   3   "7"    T   x7c         [.85, .9]     .85   .4
    p2_4  p2  1   4   "7"    T   x7d         [.1]          .1    .1
    p3_0  p3  2   0   "12"   T   g3          [.9, .9]      .9    .9
    p3_1  p3  2   1   "13"   F   y13         [.7]          .7    .3
    p3_2  p3  2   2   "14"   F   y14         [.6, .2]      .2    .6    ["c", "c"]  repeat
    p3_3  p3  2   3   None   F   y13b        [.3]          .3    .1
    p3_4  p3  2   4   "12"   T   y12         [.9, .5]      .5    .2    ["d", "d"]  repeat

The greedy trajectories have the top PRM and ORM score of their problem, and p1_0/p3_0 are correct
while p2_0 is wrong, so counting them in best-of-N would flip prm_bon_at_2 on every problem.
"""

from __future__ import annotations

import pytest

from components.evaluation import reward_metrics

EXP, ROUND, MODEL = "exp-rm", 3, "policy-r3"

# tid, pid, level, sample_index, answer, correct, completion, prm step scores, orm score
TABLE = [
    ("p1_0", "p1", 1, 0, "4", True, "g1", [0.9, 0.95], 0.99),
    ("p1_1", "p1", 1, 1, "4", True, "c4a", [0.8, 0.3], 0.2),
    ("p1_2", "p1", 1, 2, "5", False, "c5", [0.7, 0.6], 0.7),
    ("p1_3", "p1", 1, 3, "5", False, "c5b", [0.4], 0.9),
    ("p1_4", "p1", 1, 4, "4", True, "c4b", [0.9, 0.8], 0.5),
    ("p2_0", "p2", 1, 0, "8", False, "g2", [0.95], 0.95),
    ("p2_1", "p2", 1, 1, "7", True, "x7", [0.9], 0.6),
    ("p2_2", "p2", 1, 2, "7", True, "x7", [0.2, 0.9], 0.8),
    ("p2_3", "p2", 1, 3, "7", True, "x7c", [0.85, 0.9], 0.4),
    ("p2_4", "p2", 1, 4, "7", True, "x7d", [0.1], 0.1),
    ("p3_0", "p3", 2, 0, "12", True, "g3", [0.9, 0.9], 0.9),
    ("p3_1", "p3", 2, 1, "13", False, "y13", [0.7], 0.3),
    ("p3_2", "p3", 2, 2, "14", False, "y14", [0.6, 0.2], 0.6),
    ("p3_3", "p3", 2, 3, None, False, "y13b", [0.3], 0.1),
    ("p3_4", "p3", 2, 4, "12", True, "y12", [0.9, 0.5], 0.2),
]

# Oracle step labels (True = correct step). p1_3's has the wrong length (2 labels, 1 PRM score) and
# p2_4's is empty, so both are left out of the step metrics; the trajectories not listed are unlabelled.
ORACLE = {
    "p1_0": [True, True],
    "p1_1": [True, False],
    "p1_2": [True, False],
    "p1_3": [False, True],  # length mismatch -> ignored
    "p1_4": [True, True],
    "p2_0": [False],
    "p2_2": [True, True],
    "p2_4": [],  # empty -> ignored
    "p3_1": [False],
    "p3_2": [True, False],
    "p3_4": [True, False],
}

REPEATS = {"p1_1": ["a", "a"], "p2_2": ["b", "b"], "p3_2": ["c", "c"], "p3_4": ["d", "d"]}


def _trajectories(table=TABLE):
    # Shuffled order (reversed) so that reward_metrics must sort samples by sample_index itself.
    return [{"trajectory_id": tid, "problem_id": pid, "level": lvl, "sample_index": idx, "answer": ans,
             "completion": comp} for tid, pid, lvl, idx, ans, _, comp, _, _ in reversed(table)]


def _inputs(table=TABLE):
    correct = {r[0]: r[5] for r in table}
    prm = {r[0]: list(r[7]) for r in table}
    orm = {r[0]: r[8] for r in table}
    steps = {r[0]: REPEATS.get(r[0], [f"{r[0]} step {i}" for i in range(len(r[7]))]) for r in table}
    del steps["p1_3"]  # a trajectory with no steps recorded counts as "no repeat"
    oracle = {t: v for t, v in ORACLE.items() if t in correct}
    return correct, prm, orm, oracle, steps


def _run(best_of_n=(2, 4), table=TABLE, **over):
    correct, prm, orm, oracle, steps = _inputs(table)
    kw = dict(prm_steps=prm, orm_scores=orm, oracle=oracle, steps=steps)
    kw.update(over)
    return reward_metrics(_trajectories(table), correct, best_of_n=list(best_of_n), experiment=EXP,
                          round=ROUND, model_id=MODEL, **kw)


def _by_key(rows):
    out = {}
    for r in rows:
        key = (r["level"], r["metric"])
        assert key not in out, f"duplicate row for {key}"
        out[key] = r
    return out


@pytest.fixture(scope="module")
def rows():
    return _by_key(_run())


def _check(rows, level, metric, value, n):
    r = rows[(level, metric)]
    assert r["value"] == pytest.approx(value), (level, metric, r)
    assert r["n"] == n, (level, metric, r)


# --- best-of-N family, per level and overall ----------------------------------------------------
#
# Per-problem values, samples 1..4 only (greedy excluded):
#
# prm_bon_at_2  p1: s1 .3(T) vs s2 .6(F) -> s2 -> 0    p2: s1 .9(T) vs s2 .2 -> s1 -> 1
#               p3: s1 .7(F) vs s2 .2 -> s1 -> 0
#   L1 = (0+1)/2 = .5, L2 = 0, overall = (0+1+0)/3 = 1/3
#   (had greedy counted: p1 -> g .9 T = 1, p2 -> g .95 F = 0, p3 -> g .9 T = 1, overall 2/3)
# prm_bon_at_4  p1: .3 .6 .4 .8 -> s4 (T) = 1   p2: .9 .2 .85 .1 -> s1 (T) = 1
#               p3: .7 .2 .3 .5 -> s1 (F) = 0
#   L1 = 1, L2 = 0, overall = 2/3
# orm_bon_at_4  p1: .2 .7 .9 .5 -> s3 (F) = 0   p2: .6 .8 .4 .1 -> s2 (T) = 1
#               p3: .3 .6 .1 .2 -> s2 (F) = 0
#   L1 = .5, L2 = 0, overall = 1/3   (had greedy counted, p1's first 4 = g,s1,s2,s3 -> g .99 T = 1)
# orm_bon_at_2  p1: .2 .7 -> s2 F = 0   p2: .6 .8 -> s2 T = 1   p3: .3 .6 -> s2 F = 0
#   L1 = .5, L2 = 0, overall = 1/3
# maj_at_4      p1: 4 5 5 4 -> tie 2:2, earliest "4" (T) = 1   p2: 7 7 7 7 -> "7" = 1
#               p3: 13 14 None 12 -> all count 1, earliest "13" (F) = 0
#   L1 = 1, L2 = 0, overall = 2/3
# maj_at_2      p1: 4 5 -> "4" = 1   p2: 7 7 = 1   p3: 13 14 -> "13" = 0  => L1 1, L2 0, overall 2/3
# pass_at_4     p1 1, p2 1, p3 1 (s4)   => L1 1, L2 1, overall 1
# pass_at_2     p1 1, p2 1, p3 0        => L1 1, L2 0, overall 2/3
# distinct_correct_at_4  p1 {c4a, c4b} = 2, p2 {x7, x7c, x7d} = 3 (x7 twice), p3 {y12} = 1
#   L1 = (2+3)/2 = 2.5, L2 = 1, overall = 6/3 = 2
# distinct_correct_at_2  p1 {c4a} = 1, p2 {x7} = 1, p3 {} = 0  => L1 1, L2 0, overall 2/3
# prm_selection_acc_at_4  mixed problems only: p1 (mixed) -> s4 T = 1; p2 all correct -> NaN (dropped);
#               p3 (mixed) -> s1 F = 0   => L1 1 (n=1), L2 0 (n=1), overall 1/2 (n=2)
# prm_selection_acc_at_2  p1 first 2 mixed -> s2 F = 0; p2 all correct -> NaN; p3 first 2 all wrong -> NaN
#   => L1 0 (n=1), no L2 row, overall 0 (n=1)

GROUP_EXPECTED = {
    # metric: {level: (value, n)}
    "prm_bon_at_2": {1: (0.5, 2), 2: (0.0, 1), -1: (1 / 3, 3)},
    "prm_bon_at_4": {1: (1.0, 2), 2: (0.0, 1), -1: (2 / 3, 3)},
    "orm_bon_at_2": {1: (0.5, 2), 2: (0.0, 1), -1: (1 / 3, 3)},
    "orm_bon_at_4": {1: (0.5, 2), 2: (0.0, 1), -1: (1 / 3, 3)},
    "maj_at_2": {1: (1.0, 2), 2: (0.0, 1), -1: (2 / 3, 3)},
    "maj_at_4": {1: (1.0, 2), 2: (0.0, 1), -1: (2 / 3, 3)},
    "pass_at_2": {1: (1.0, 2), 2: (0.0, 1), -1: (2 / 3, 3)},
    "pass_at_4": {1: (1.0, 2), 2: (1.0, 1), -1: (1.0, 3)},
    "distinct_correct_at_2": {1: (1.0, 2), 2: (0.0, 1), -1: (2 / 3, 3)},
    "distinct_correct_at_4": {1: (2.5, 2), 2: (1.0, 1), -1: (2.0, 3)},
    "prm_selection_acc_at_2": {1: (0.0, 1), -1: (0.0, 1)},
    "prm_selection_acc_at_4": {1: (1.0, 1), 2: (0.0, 1), -1: (0.5, 2)},
}


@pytest.mark.parametrize("metric", sorted(GROUP_EXPECTED))
def test_group_metrics_per_level_and_overall(rows, metric):
    for level, (value, n) in GROUP_EXPECTED[metric].items():
        _check(rows, level, metric, value, n)
    present = {lvl for lvl, m in rows if m == metric}
    assert present == set(GROUP_EXPECTED[metric]), metric


def test_selection_acc_level_with_no_mixed_problem_has_no_row(rows):
    # At N=2 level 2's only problem (p3) has two wrong samples: undefined, so no row at all.
    assert (2, "prm_selection_acc_at_2") not in rows


def test_greedy_sample_is_not_counted_in_best_of_n(rows):
    # With greedy counted, prm_bon_at_2 would be 2/3 overall and orm_bon_at_4 at level 1 would be 1.0.
    assert rows[(-1, "prm_bon_at_2")]["value"] == pytest.approx(1 / 3)
    assert rows[(1, "orm_bon_at_4")]["value"] == pytest.approx(0.5)
    # Dropping the greedy trajectories changes no best-of-N / maj / pass / B-STaR number.
    sampled_only = _by_key(_run(table=[r for r in TABLE if r[3] > 0]))
    for metric, per_level in GROUP_EXPECTED.items():
        for level, (value, n) in per_level.items():
            _check(sampled_only, level, metric, value, n)


def test_samples_are_ordered_by_sample_index_not_input_order():
    # Same data, trajectories given in table order rather than reversed: same numbers.
    correct, prm, orm, oracle, steps = _inputs()
    trajs = list(reversed(_trajectories()))
    got = _by_key(reward_metrics(trajs, correct, best_of_n=[2, 4], experiment=EXP, round=ROUND, model_id=MODEL,
                                 prm_steps=prm, orm_scores=orm, oracle=oracle, steps=steps))
    for metric, per_level in GROUP_EXPECTED.items():
        for level, (value, n) in per_level.items():
            _check(got, level, metric, value, n)


# --- step level against the oracle --------------------------------------------------------------
#
# Labelled trajectories (p1_3: length mismatch, p2_4: empty -> left out). (pred >= .5, gold) per step:
#
# Level 1, 11 steps:
#   p1_0 (T,T)(T,T)   p1_1 (T,T)(F,F)   p1_2 (T,T)(T,F)   p1_4 (T,T)(T,T)   p2_0 (T,F)   p2_2 (F,T)(T,T)
#   correct class: TP = 7, predicted T = 9, gold T = 8 -> P 7/9, R 7/8, F1 = 2*7/(9+8) = 14/17
#   error class:   TP = 1 (p1_1 step 2), predicted F = 2, gold F = 3 -> P 1/2, R 1/3, F1 = 2*1/(2+3) = 2/5
# Level 2, 5 steps:
#   p3_1 (T,F)   p3_2 (T,T)(F,F)   p3_4 (T,T)(T,F)
#   correct class: TP = 2, predicted T = 4, gold T = 2 -> P 1/2, R 1, F1 = 4/6 = 2/3
#   error class:   TP = 1, predicted F = 1, gold F = 3 -> P 1, R 1/3, F1 = 2/4 = 1/2
# Pooled (level -1), 16 steps:
#   correct class: TP = 9, predicted T = 13, gold T = 10 -> P 9/13, R 9/10, F1 = 18/23 (~.7826)
#       (mean of per-level F1s would be (14/17 + 2/3)/2 ~ .7451; of P (7/9+1/2)/2 ~ .6389)
#   error class:   TP = 2, predicted F = 3, gold F = 6 -> P 2/3, R 1/3, F1 = 4/9 (~.4444)
#       (mean of per-level error F1s would be (2/5 + 1/2)/2 = .45)
#
# ProcessBench (first step < .5 vs first gold False; -1 = none):
#   L1: p1_0 gold -1 pred -1 hit (correct subset)   p1_1 gold 1 pred 1 hit (erroneous)
#       p1_2 gold 1 pred -1 miss (err)              p1_4 gold -1 pred -1 hit (correct)
#       p2_0 gold 0 pred -1 miss (err)              p2_2 gold -1 pred 0 miss (correct)
#       acc_err 1/3, acc_correct 2/3, F1 = 2*(1/3)(2/3)/(1/3+2/3) = 4/9
#   L2: p3_1 gold 0 pred -1 miss   p3_2 gold 1 pred 1 hit   p3_4 gold 1 pred -1 miss (all erroneous)
#       acc_err 1/3, no all-correct trajectory -> F1 = acc_err = 1/3
#   pooled: erroneous 2 hits / 6 = 1/3, correct 2 / 3 = 2/3 -> F1 = 4/9
#       (mean of per-level F1s would be (4/9 + 1/3)/2 = 7/18)

STEP_EXPECTED = {
    "prm_step_precision": {1: 7 / 9, 2: 1 / 2, -1: 9 / 13},
    "prm_step_recall": {1: 7 / 8, 2: 1.0, -1: 9 / 10},
    "prm_step_f1": {1: 14 / 17, 2: 2 / 3, -1: 18 / 23},
    "prm_error_precision": {1: 1 / 2, 2: 1.0, -1: 2 / 3},
    "prm_error_recall": {1: 1 / 3, 2: 1 / 3, -1: 1 / 3},
    "prm_error_f1": {1: 2 / 5, 2: 1 / 2, -1: 4 / 9},
    "processbench_f1": {1: 4 / 9, 2: 1 / 3, -1: 4 / 9},
    "first_error_acc_erroneous": {1: 1 / 3, 2: 1 / 3, -1: 1 / 3},
}


@pytest.mark.parametrize("metric", sorted(STEP_EXPECTED))
def test_step_metrics_per_level_and_pooled(rows, metric):
    # One ratio per level (n=1), and level -1 is one ratio over all steps (n=1).
    for level, value in STEP_EXPECTED[metric].items():
        _check(rows, level, metric, value, 1)


def test_first_error_acc_correct_pooled(rows):
    _check(rows, 1, "first_error_acc_correct", 2 / 3, 1)
    _check(rows, -1, "first_error_acc_correct", 2 / 3, 1)


@pytest.mark.parametrize("metric", ["prm_step_precision", "prm_step_recall", "prm_step_f1", "prm_error_f1",
                                    "processbench_f1"])
def test_overall_step_metric_is_pooled_not_mean_of_levels(rows, metric):
    per_level_mean = (rows[(1, metric)]["value"] + rows[(2, metric)]["value"]) / 2
    assert rows[(-1, metric)]["value"] != pytest.approx(per_level_mean)
    assert rows[(-1, metric)]["value"] == pytest.approx(STEP_EXPECTED[metric][-1])


def test_unusable_oracle_labels_are_ignored():
    # Dropping p1_3 (length mismatch) and p2_4 (empty) from the oracle changes nothing.
    correct, prm, orm, oracle, steps = _inputs()
    oracle = {t: v for t, v in oracle.items() if t not in ("p1_3", "p2_4")}
    got = _by_key(reward_metrics(_trajectories(), correct, best_of_n=[2, 4], experiment=EXP, round=ROUND,
                                 model_id=MODEL, prm_steps=prm, orm_scores=orm, oracle=oracle, steps=steps))
    for metric, per_level in STEP_EXPECTED.items():
        for level, value in per_level.items():
            _check(got, level, metric, value, 1)


# --- reward-hacking monitors --------------------------------------------------------------------
#
# prm_verifier_disagreement: one value per PRM-scored trajectory (greedy included: it is every
# trajectory in prm_steps), 1 iff (min step score >= .5) != correct.
#   p1: g .9/T 0, s1 .3/T 1, s2 .6/F 1, s3 .4/F 0, s4 .8/T 0 -> 2
#   p2: g .95/F 1, s1 .9/T 0, s2 .2/T 1, s3 .85/T 0, s4 .1/T 1 -> 3
#   p3: g .9/T 0, s1 .7/F 1, s2 .2/F 0, s3 .3/F 0, s4 .5/T 0 (.5 >= .5) -> 1
#   L1 = 5/10 = .5 (n=10), L2 = 1/5 = .2 (n=5), overall = 6/15 = .4 (n=15)
# eval_repeated_step_rate: one value per PRM-scored trajectory, 1 iff a step text repeats.
#   repeats: p1_1, p2_2 (L1), p3_2, p3_4 (L2); p1_3 has no steps recorded -> 0
#   L1 = 2/10 = .2, L2 = 2/5 = .4, overall = 4/15


def test_prm_verifier_disagreement(rows):
    _check(rows, 1, "prm_verifier_disagreement", 0.5, 10)
    _check(rows, 2, "prm_verifier_disagreement", 0.2, 5)
    _check(rows, -1, "prm_verifier_disagreement", 0.4, 15)


def test_eval_repeated_step_rate(rows):
    _check(rows, 1, "eval_repeated_step_rate", 0.2, 10)
    _check(rows, 2, "eval_repeated_step_rate", 0.4, 5)
    _check(rows, -1, "eval_repeated_step_rate", 4 / 15, 15)


# --- row shape, metric set, optional inputs -----------------------------------------------------


def test_rows_have_the_evaluations_columns(rows):
    assert rows
    for r in rows.values():
        assert set(r) == {"experiment_id", "round", "model_id", "level", "metric", "value", "n"}
        assert (r["experiment_id"], r["round"], r["model_id"]) == (EXP, ROUND, MODEL)
        assert r["level"] in (1, 2, -1)
        assert isinstance(r["n"], int) and r["n"] >= 1
        assert r["value"] == r["value"]  # never NaN


def test_exactly_the_expected_metrics(rows):
    expected = {(lvl, m) for m, d in GROUP_EXPECTED.items() for lvl in d}
    expected |= {(lvl, m) for m, d in STEP_EXPECTED.items() for lvl in d}
    expected |= {(lvl, m) for m in ("prm_verifier_disagreement", "eval_repeated_step_rate") for lvl in (1, 2, -1)}
    expected |= {(lvl, "first_error_acc_correct") for lvl in (1, -1)}
    # Level 2 has no all-correct labelled trajectory, so its first_error_acc_correct is undefined; the
    # code currently writes 0.0 for it. Neither presence nor absence of that row is pinned here.
    assert set(rows) - {(2, "first_error_acc_correct")} == expected


def test_without_reward_models_only_policy_metrics():
    got = _by_key(_run(prm_steps=None, orm_scores=None, oracle=None, steps=None))
    assert {m for _, m in got} == {f"{k}_at_{n}" for k in ("maj", "pass", "distinct_correct") for n in (2, 4)}
    for metric in ("maj_at_4", "pass_at_4", "distinct_correct_at_4"):
        for level, (value, n) in GROUP_EXPECTED[metric].items():
            _check(got, level, metric, value, n)


def test_orm_only_has_no_prm_metrics():
    got = _by_key(_run(prm_steps=None, oracle=None, steps=None))
    assert not any(m.startswith(("prm_", "processbench", "first_error", "eval_repeated")) for _, m in got)
    for level, (value, n) in GROUP_EXPECTED["orm_bon_at_4"].items():
        _check(got, level, "orm_bon_at_4", value, n)


# --- too few samples ----------------------------------------------------------------------------


def test_problem_with_fewer_samples_than_n_raises_naming_it():
    short = [r for r in TABLE if r[0] != "p3_4"]  # p3 keeps samples 1..3
    with pytest.raises(ValueError, match=r"problem p3 has 3 samples, best-of-4 needs 4"):
        _run(best_of_n=(2, 4), table=short)
    # N=2 and N=3 are fine with 3 samples.
    _run(best_of_n=(2, 3), table=short)


def test_problem_with_only_a_greedy_sample_raises_naming_it():
    # p3 has its greedy trajectory but no samples at all: 0 < N, so this must not silently drop p3
    # from the average (overall prm_bon_at_4 would become 2/2 = 1.0 instead of an error).
    greedy_only = [r for r in TABLE if r[1] != "p3" or r[3] == 0]
    with pytest.raises(ValueError, match=r"p3"):
        _run(best_of_n=(4,), table=greedy_only)
