"""The coevo recipe's plain parts on hand-built fixtures: which trajectories get Monte Carlo labels,
PRM examples with consensus filtering, PRM score rows, PRM-ranked selection, DPO pairing, and
how a judge ranks the right answers against the step checker.

    .venv/bin/python -m pytest tests/unit/test_coevo_filtering.py -q
"""

from __future__ import annotations

import pytest

from components.filtering import dpo_pairs, judge_ranking, rft_filter
from components.labeling import prm_examples
from components.scoring import choose_for_mc, step_score_rows


def _t(tid: str, completion: str, i: int, problem: str = "p") -> dict:
    return {"trajectory_id": tid, "problem_id": problem, "completion": completion, "sample_index": i,
            "prompt": f"{problem}\n"}


# Problem p: a, b right (b twice), c, d wrong; problem q: e right, f wrong, g unverified.
TRAJS = [_t("a", "A", 0), _t("b", "B", 1), _t("b2", "B", 2), _t("c", "C", 3), _t("d", "D", 4),
         _t("e", "E", 0, "q"), _t("f", "F", 1, "q"), _t("g", "G", 2, "q")]
CORRECT = {"a": True, "b": True, "b2": True, "c": False, "d": False, "e": True, "f": False, "g": None}
PRM_MIN = {"a": 0.40, "b": 0.90, "b2": 0.90, "c": 0.70, "d": 0.05, "e": 0.30, "f": 0.80, "g": 0.99}


def test_prm_ranked_selection_is_exact():
    rows = rft_filter(TRAJS, CORRECT, PRM_MIN, experiment="x", round=2, dedup=True, max_per_problem=1)
    got = {r["trajectory_id"]: (r["selected"], r["rank"], r["reason"]) for r in rows}
    assert got == {
        "b": (True, 0, "correct"),                       # the best PRM score among right answers
        "b2": (False, None, "duplicate"),                # same text as b
        "a": (False, None, "over max_per_problem=1"),    # right, but ranked below b
        "c": (False, None, "incorrect"), "d": (False, None, "incorrect"),
        "e": (True, 0, "correct"), "f": (False, None, "incorrect"), "g": (False, None, "unverified"),
    }
    assert {r["purpose"] for r in rows} == {"policy_sft"}


def test_dpo_pairs_are_exact():
    rows = dpo_pairs(TRAJS, CORRECT, PRM_MIN, experiment="x", round=2, max_pairs_per_problem=2)
    got = [(r["pair_id"], r["purpose"], r["trajectory_id"], r["rank"]) for r in rows]
    assert got == [
        # p: chosen by descending PRM among distinct right texts (b, then a); rejected ascending among wrong (d, then c)
        ("x/r2/p/0", "dpo_chosen", "b", 0), ("x/r2/p/0", "dpo_rejected", "d", 0),
        ("x/r2/p/1", "dpo_chosen", "a", 1), ("x/r2/p/1", "dpo_rejected", "c", 1),
        # q: the unverified g is never a side
        ("x/r2/q/0", "dpo_chosen", "e", 0), ("x/r2/q/0", "dpo_rejected", "f", 0),
    ]
    assert all(r["selected"] for r in rows)
    # A chosen side must also pass the SFT filter's other checks (e.g. its steps check out).
    rows = dpo_pairs(TRAJS, CORRECT, PRM_MIN, experiment="x", round=2, max_pairs_per_problem=1,
                     eligible={"a": True, "b": False, "b2": False, "e": False})
    assert [(r["purpose"], r["trajectory_id"]) for r in rows] == [("dpo_chosen", "a"), ("dpo_rejected", "d")]


def test_problem_without_a_wrong_sample_gives_no_pair():
    trajs = [_t("a", "A", 0), _t("b", "B", 1)]
    assert dpo_pairs(trajs, {"a": True, "b": True}, {}, experiment="x", round=1, max_pairs_per_problem=1) == []


def test_an_empty_wrong_answer_is_never_a_rejected_side():
    trajs = [_t("a", "A", 0), _t("empty", "", 1), _t("c", "C", 2)]  # EOS at once: nothing for DPO to push down
    rows = dpo_pairs(trajs, {"a": True, "empty": False, "c": False}, {"empty": 0.0, "c": 0.5}, experiment="x",
                     round=1, max_pairs_per_problem=1)
    assert [(r["purpose"], r["trajectory_id"]) for r in rows] == [("dpo_chosen", "a"), ("dpo_rejected", "c")]


def test_choose_for_mc_balances_outcomes_and_keeps_duplicates_together():
    trajs = [_t(f"r{i}", f"R{i}", i) for i in range(10)] + [_t(f"w{i}", f"W{i}", 10 + i) for i in range(3)]
    trajs.append(_t("r0-dup", "R0", 20))
    correct = {t["trajectory_id"]: t["trajectory_id"].startswith("r") for t in trajs}
    chosen = choose_for_mc(trajs, correct, max_distinct=6, seed=1)
    texts = {t["completion"] for t in trajs if t["trajectory_id"] in chosen}
    assert len(texts) == 6
    assert sum(t.startswith("W") for t in texts) == 3          # every wrong text (only 3 exist)
    assert ("r0" in chosen) == ("r0-dup" in chosen)             # one text's duplicates share its rollouts
    assert chosen == choose_for_mc(trajs, correct, max_distinct=6, seed=1)
    assert len(choose_for_mc(trajs, correct, max_distinct=None, seed=0)) == len(trajs)


def test_prm_examples_threshold_consensus_and_dedup():
    items = [{"trajectory_id": "a", "prompt": "p", "steps": ["s0", "s1", "s2"]},
             {"trajectory_id": "a2", "prompt": "p", "steps": ["s0", "s1", "s2"]},      # same text as a
             {"trajectory_id": "b", "prompt": "p", "steps": ["s0", "t1"]},
             {"trajectory_id": "c", "prompt": "p", "steps": ["u0"]}]                   # no labels: skipped
    soft = {"a": [0.75, 0.25, 0.0], "a2": [0.75, 0.25, 0.0], "b": [0.75, 1.0]}
    labels = {t: {i: {"mc_soft": v, "mc_hard": float(v > 0)} for i, v in enumerate(vs)} for t, vs in soft.items()}
    ex, dec = prm_examples(items, labels, source="mc_soft", soft_threshold=0.5)
    assert [(e["trajectory_id"], e["labels"]) for e in ex] == [("a", [True, False, False]), ("b", [True, True])]
    assert [(d["trajectory_id"], d["selected"], d["reason"]) for d in dec] == [
        ("a", True, "mc labels"), ("a2", False, "duplicate"), ("b", True, "mc labels")]
    ex, _ = prm_examples(items, labels, source="mc_hard")
    assert ex[0]["labels"] == [True, True, False]
    # The previous PRM puts a's first error at step 1 too (kept), b's at step 0 (dropped).
    ex, dec = prm_examples(items, labels, source="mc_soft", prior_scores={"a": [0.9, 0.2, 0.6], "b": [0.1, 0.9]},
                           consensus=True)
    assert [e["trajectory_id"] for e in ex] == ["a"]
    assert dec[-1]["reason"] == "consensus: mc first error -1, prm 0"
    with pytest.raises(ValueError, match="mc_hard, mc_soft, tree_hard, tree_soft or given"):
        prm_examples(items, labels, source="oracle")
    # Imported step labels (source 'given') are hard labels, named as given in the decision.
    given = {"g": {0: {"given": 1.0}, 1: {"given": 0.0}}}
    ex, dec = prm_examples([{"trajectory_id": "g", "prompt": "q", "steps": ["x", "y"]}], given, source="given")
    assert ex[0]["labels"] == [True, False] and dec == [{"trajectory_id": "g", "selected": True,
                                                         "reason": "given labels"}]


def test_step_score_rows_carry_the_model_and_aggregates():
    rows = step_score_rows(["t1", "t2"], [[0.5, 1.0], []], "prm", "x/prm/r1")
    assert {r["model_id"] for r in rows} == {"x/prm/r1"}
    t1 = {(r["step_index"], r["aggregate"]): r["value"] for r in rows if r["trajectory_id"] == "t1"}
    assert t1 == {(0, "step"): 0.5, (1, "step"): 1.0, (-1, "min"): 0.5, (-1, "last"): 1.0, (-1, "mean"): 0.75}
    assert {(r["step_index"], r["aggregate"]) for r in rows if r["trajectory_id"] == "t2"} == {
        (-1, "min"), (-1, "last"), (-1, "mean")}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_judge_ranking_matches_counting_every_pair_and_every_threshold(seed):
    """The AUC against all (unsound, sound) pairs, ties half; the hindsight catch against every threshold
    that drops at most 5% of the sound answers. Scores on a coarse grid, so ties are common."""
    import random

    rng = random.Random(seed)
    ids = [f"t{i}" for i in range(300)]
    checker = {t: rng.random() < 0.7 for t in ids} | {"no-verdict": None}
    weakest = {t: round(rng.betavariate(4 if checker[t] else 1.5, 2), 1) for t in ids} | {"no-verdict": 0.0}
    good = [weakest[t] for t in ids if checker[t]]
    bad = [weakest[t] for t in ids if not checker[t]]
    pairs = [(u < g) + 0.5 * (u == g) for u in bad for g in good]
    best = max(sum(u < th for u in bad) / len(bad) for th in {*good, *bad, 2.0}
               if sum(g < th for g in good) <= 0.05 * len(good))
    got = judge_ranking(weakest, checker)
    assert got["judge_auc"] == pytest.approx(sum(pairs) / len(pairs))
    assert got["judge_hindsight_catch"] == pytest.approx(best)
    assert 0.5 < got["judge_auc"] < 1.0 and 0.0 < best < 1.0  # the draw is neither trivial nor perfect


def test_judge_ranking_needs_both_kinds_of_right_answer():
    assert judge_ranking({"a": 0.2, "b": 0.9}, {"a": True, "b": True}) == {}
    assert judge_ranking({"a": 0.2}, {"a": False, "b": True}) == {}  # the sound one was never judged
