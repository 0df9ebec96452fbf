"""Unit tests for the `arith` domain: exact text format, determinism, test-set disjointness, oracle labels.

    .venv/bin/python -m pytest tests/unit/test_domain_arith.py -q
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import pytest

from components.domains import DOMAINS, Domain, Problem, get_domain
from components.domains.arith import ArithDomain, extract_answer, split_steps, verify
from tests.conftest import REPO


def arith(prompt: str) -> Problem:
    level = prompt.count("+") + prompt.count("-")
    return Problem.make("arith", level, prompt, str(eval(prompt)))


# --- format -----------------------------------------------------------------------------------

def test_reference_solution_exact_format():
    d = ArithDomain()
    assert d.reference_solution(arith("3+4-2+5\n")) == "3+4=7\n7-2=5\n5+5=10\n#### 10\n"
    assert d.reference_solution(arith("3+4\n")) == "3+4=7\n#### 7\n"
    assert d.reference_solution(arith("2-5+4\n")) == "2-5=-3\n-3+4=1\n#### 1\n"
    assert d.reference_solution(arith("0-9-9\n")) == "0-9=-9\n-9-9=-18\n#### -18\n"


def test_sampled_problems_have_the_documented_shape():
    d = ArithDomain(digits=1)
    for level in d.levels():
        for p in d.sample_problems(level, 50, seed=7):
            assert p.domain == "arith" and p.level == level
            assert p.prompt.endswith("\n") and p.prompt.count("\n") == 1
            body = p.prompt[:-1]
            assert all(c in "0123456789+-" for c in body) and body[0].isdigit()
            assert body.count("+") + body.count("-") == level
            assert p.answer == str(eval(body))
            assert p.problem_id == hashlib.sha256(f"arith\x1f{p.prompt}\x1f{p.answer}".encode()).hexdigest()[:16]


def test_digits_bound_operands():
    for digits, hi in [(1, 9), (2, 99)]:
        ops = [x for p in ArithDomain(digits=digits).sample_problems(4, 300, seed=1) for x in p.meta["operands"]]
        assert min(ops) >= 0 and max(ops) <= hi and max(ops) > hi // 10  # full range is used


# --- determinism and the held-out set -----------------------------------------------------------

def test_sampling_is_deterministic_and_seed_dependent():
    d = ArithDomain()
    state = random.getstate()
    a = d.sample_problems(3, 100, seed=5)
    assert random.getstate() == state  # never touches the global random state
    assert a == ArithDomain().sample_problems(3, 100, seed=5)
    assert a != d.sample_problems(3, 100, seed=6)
    assert d.sample_problems(3, 100, seed=5) != d.sample_problems(4, 100, seed=5)


def test_test_set_is_fixed_and_sized():
    d = ArithDomain(test_size=200)
    for level in d.levels():
        t = d.test_set(level)
        assert t == d.test_set(level) == ArithDomain(test_size=200).test_set(level)
        assert len({p.prompt for p in t}) == len(t)
        # level 1 has only 10*2*10 = 200 prompts; half stays available for training
        assert len(t) == (100 if level == 1 else 200)
    assert d.test_set(2) != ArithDomain(test_seed=99).test_set(2)
    d.test_set(2).clear()  # a returned list is a copy: the cached set stays intact
    assert len(d.test_set(2)) == 200


def test_test_set_identical_across_processes():
    code = ("from components.domains.arith import ArithDomain; d = ArithDomain();"
            "print([p.problem_id for lv in d.levels() for p in d.test_set(lv)][::37],"
            " [p.problem_id for p in d.sample_problems(4, 20, seed=3)])")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed}, cwd=REPO).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    d = ArithDomain()
    expected = [p.problem_id for lv in d.levels() for p in d.test_set(lv)][::37]
    assert repr(expected) in outs.pop()


@pytest.mark.parametrize("level", [1, 2, 3, 6])
def test_samples_never_hit_the_test_set(level):
    d = ArithDomain()
    test_prompts = {p.prompt for p in d.test_set(level)}
    sample = d.sample_problems(level, 1000, seed=11)
    assert len(sample) == 1000
    assert not test_prompts & {p.prompt for p in sample}


def test_samples_unique_while_the_space_allows():
    d = ArithDomain()
    assert len({p.prompt for p in d.sample_problems(3, 1000, seed=0)}) == 1000
    # level 1: 200 prompts, 100 held out -> exactly the other 100, then repeats
    hundred = d.sample_problems(1, 100, seed=0)
    assert len({p.prompt for p in hundred}) == 100
    more = d.sample_problems(1, 150, seed=0)
    assert len(more) == 150 and len({p.prompt for p in more}) == 100


def test_bad_levels_and_options_raise():
    with pytest.raises(ValueError, match="level 7"):
        ArithDomain(max_level=6).sample_problems(7, 1, seed=0)
    with pytest.raises(ValueError, match="level 0"):
        ArithDomain().test_set(0)
    with pytest.raises(ValueError, match="digits"):
        ArithDomain(digits=0)
    with pytest.raises(ValueError, match="max_level"):
        ArithDomain(max_level=0)


# --- steps, extraction, verification ------------------------------------------------------------

def test_split_steps():
    assert split_steps("3+4=7\n7-2=5\n#### 5\n") == ["3+4=7", "7-2=5", "#### 5"]
    assert split_steps("3+4=7\n\n  \n#### 7\n7+1=8\n#### 8\n") == ["3+4=7", "#### 7"]
    assert split_steps("3+4=7\n7-2=5") == ["3+4=7", "7-2=5"]
    assert split_steps("") == []


@pytest.mark.parametrize("text, expected", [
    ("3+4=7\n#### 7\n", "7"),
    ("2-5=-3\n#### -3\n", "-3"),
    ("#### 07", "7"),
    ("  ####   12  \n", "12"),
    ("3+4=7\n#### 7\n#### 9\nbabble 3+3", "7"),  # the first answer line wins, trailing text ignored
    ("3+4=7\n7-2=5\n", None),  # no answer line
    ("#### \n", None),
    ("#### 7 apples", None),
    ("#### 7.5", None),
    ("#### --3", None),
    ("the answer is 7", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_verify():
    completions = ["3+4=7\n#### 7\n", "3+4=8\n#### 8\n", "no answer", "#### -3\n", "#### 7\n#### 8\n"]
    assert verify(completions, ["7", "7", "7", "-3", "7"]) == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert ArithDomain().verify(["#### 07"], ["7"]) == [1.0]
    assert verify([], []) == []
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        verify(["#### 1", "#### 2"], ["1"])


# --- oracle step labels -------------------------------------------------------------------------

@pytest.mark.parametrize("completion, labels", [
    ("3+4=7\n7-2=5\n5+5=10\n#### 10\n", [True, True, True, True]),
    ("3+4=7\n7-2=6\n6+5=11\n#### 11\n", [True, False, False, False]),  # slip at step 2 carried forward
    ("3+4=8\n7-2=5\n5+5=10\n#### 10\n", [False, True, True, True]),  # later steps judged on true totals
    ("3+4=7\n7+2=9\n9+5=14\n#### 14\n", [True, False, False, False]),  # wrong operator
    ("3+4=7\n7-3=4\n5+5=10\n#### 10\n", [True, False, True, True]),  # wrong operand
    ("3+4=7\n7-2\n5+5=10\n#### 10\n", [True, False, True, True]),  # malformed line
    ("3+4=7\n#### 10\n", [True, True]),  # jumps to the right answer early
    ("3+4=7\n7-2=5\n5+5=10\n10+0=10\n#### 10\n", [True, True, True, False, True]),  # surplus equation
    ("3+4=7\n7-2=5\n5+5=10\n", [True, True, True]),  # no answer line: nothing to label there
    ("3+4=7\n7-2=5\n5+5=10\n#### ten\n", [True, True, True, False]),
    ("", []),
])
def test_oracle_labels_hand_written(completion, labels):
    d = ArithDomain()
    p = arith("3+4-2+5\n")
    got = d.oracle_step_labels(p, completion)
    assert got == labels
    assert len(got) == len(d.split_steps(completion))


def test_oracle_handles_negative_totals():
    d = ArithDomain()
    p = arith("2-5+4\n")
    assert d.oracle_step_labels(p, "2-5=-3\n-3+4=1\n#### 1\n") == [True, True, True]
    assert d.oracle_step_labels(p, "2-5=3\n3+4=7\n#### 7\n") == [False, False, False]


@pytest.mark.parametrize("digits", [1, 2])
def test_reference_is_correct_and_corruption_is_caught(digits):
    d = ArithDomain(digits=digits)
    rng = random.Random(0)
    for level in d.levels():
        for p in d.sample_problems(level, 20, seed=level) + d.test_set(level)[:5]:
            gold = d.reference_solution(p)
            assert d.verify([gold], [p.answer]) == [1.0]
            assert d.extract_answer(gold) == p.answer
            assert d.oracle_step_labels(p, gold) == [True] * (level + 1)
            steps = d.split_steps(gold)
            assert len(steps) == level + 1 and "".join(s + "\n" for s in steps) == gold
            k = rng.randrange(level + 1)  # corrupt one step's result (or the answer) by +-1
            lhs, sep, rhs = steps[k].rpartition(" " if k == level else "=")
            corrupted = [*steps[:k], f"{lhs}{sep}{int(rhs) + rng.choice([-1, 1])}", *steps[k + 1:]]
            labels = d.oracle_step_labels(p, "\n".join(corrupted) + "\n")
            assert labels == [i != k for i in range(level + 1)]
            assert d.verify(["\n".join(corrupted)], [p.answer]) == [0.0 if k == level else 1.0]


# --- registry -----------------------------------------------------------------------------------

def test_get_domain():
    d = get_domain("arith", max_level=3, digits=2)
    assert isinstance(d, ArithDomain) and isinstance(d, Domain)
    assert d.name == "arith" and d.levels() == [1, 2, 3] and d.digits == 2
    assert isinstance(get_domain("components.domains.arith:ArithDomain"), ArithDomain)
    assert set(DOMAINS) >= {"arith", "gsm8k"}
    with pytest.raises(ValueError, match=r"unknown domain 'nope'.*\['arith', 'gsm8k'"):
        get_domain("nope")
    with pytest.raises(ValueError, match="no attribute"):
        get_domain("components.domains.arith:Missing")


def test_problem_is_frozen_and_hashable():
    p = arith("3+4\n")
    with pytest.raises(AttributeError):
        p.answer = "8"  # type: ignore[misc]
    assert {p, arith("3+4\n")} == {p}


def test_check_steps_executes_each_step_against_the_problem():
    d = ArithDomain()
    assert d.check_steps("3+4-2\n", "3+4=7\n7-2=5\n#### 5\n") is True
    assert d.check_steps("3+4-2\n", "3+4=8\n8-3=5\n#### 5\n") is False      # two slips that cancel
    assert d.check_steps("3+4-2\n", "3+4=7\n6-1=5\n#### 5\n") is False      # does not continue from 7
    assert d.check_steps("3+4-2\n", "3+4=7\n7-2=5\n#### 6\n") is False      # answer is not the last result
    assert d.check_steps("3+4-2\n", "3+4=7\n7-2=5\n") is False               # no answer line
    assert d.check_steps("2+6-3+0\n", "2+6=8\n8-3=5\n#### 5\n") is False    # skipped the +0
    assert d.check_steps("2+6-3+0\n", "2+6=8\n8-3=5\n5+0=5\n#### 5\n") is True
    assert ArithDomain(format="rewrite").check_steps("7-2\n", "5\n#### 5\n") is None


def test_check_steps_agrees_with_the_oracle_labels():
    d = ArithDomain()
    rng = random.Random(0)
    for p in d.sample_problems(level=3, n=50, seed=1):
        good = d.reference_solution(p)
        lines = good.splitlines()
        k = rng.randrange(len(lines) - 1)
        bad = "\n".join(lines[:k] + [lines[k].replace("=", "=1", 1)] + lines[k + 1:]) + "\n"
        for c in (good, bad):
            assert d.check_steps(p.prompt, c) == all(d.oracle_step_labels(p, c)), (p.prompt, c)


def test_filter_drops_right_answers_with_wrong_steps():
    from components.filtering import rft_filter, step_rejects

    ts = [{"trajectory_id": t, "problem_id": "p", "completion": c, "sample_index": i}
          for i, (t, c) in enumerate([("a", "3+4=8\n8-3=5\n#### 5\n"), ("b", "3+4=7\n7-2=5\n#### 5\n")])]
    d = ArithDomain()
    rows = rft_filter(ts, {"a": True, "b": True}, {}, experiment="e", round=1, dedup=True, max_per_problem=4,
                      step_rejects=step_rejects(["a", "b"], checker={t["trajectory_id"]: d.check_steps(
                          "3+4-2\n", t["completion"]) for t in ts}))
    assert [(r["trajectory_id"], r["selected"], r["reason"]) for r in rows] == [
        ("a", False, "steps do not check"), ("b", True, "correct")]
