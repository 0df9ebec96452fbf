"""Unit tests for the `gsm8k` domain on real GSM8K rows: the subset shipped in tests/data/gsm8k.

    .venv/bin/python -m pytest tests/unit/test_domain_gsm8k.py -q
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from components.domains import Domain, get_domain
from components.domains.gsm8k import Gsm8kDomain, extract_answer, split_steps, verify
from tests.conftest import GSM8K_DATA as DATA

TEST_ROWS = 65  # tests/data/gsm8k/test.jsonl: 8 a level, plus 9 rows with a cut-off model solution (its README)


@pytest.fixture(scope="module")
def gsm8k() -> Gsm8kDomain:
    return Gsm8kDomain(DATA / "train.jsonl", DATA / "test.jsonl")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- loading ------------------------------------------------------------------------------------

def test_first_train_problem_exact(gsm8k):
    natalia = [p for p in gsm8k.sample_problems(2, 10**4, seed=0) if p.prompt.startswith("Natalia sold clips")][0]
    assert natalia.prompt == (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?\n")
    assert natalia.answer == "72" and natalia.level == 2 and natalia.domain == "gsm8k"
    assert gsm8k.reference_solution(natalia) == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n"
        "#### 72\n")


def test_levels_and_sizes(gsm8k):
    assert gsm8k.levels() == [2, 3, 4, 5, 6, 7, 8]  # every GSM8K solution has at least two lines of work
    assert sum(len(gsm8k.test_set(lv)) for lv in gsm8k.levels()) == TEST_ROWS
    assert isinstance(gsm8k, Domain) and gsm8k.name == "gsm8k"


def test_reference_solutions_verify_and_have_level_plus_one_steps(gsm8k):
    for lv in gsm8k.levels():
        probs = gsm8k.test_set(lv) + gsm8k.sample_problems(lv, 50, seed=1)
        refs = [gsm8k.reference_solution(p) for p in probs]
        assert gsm8k.verify(refs, [p.answer for p in probs]) == [1.0] * len(probs)
        for p, r in zip(probs, refs):
            assert "<<" not in r and ">>" not in r and r.endswith("\n")
            assert p.level == lv and "," not in p.answer
            if lv < 8:
                assert len(gsm8k.split_steps(r)) == lv + 1
            assert gsm8k.split_steps(r)[-1].startswith("####")


def test_test_set_fixed_and_disjoint_from_samples(gsm8k):
    for lv in gsm8k.levels():
        t = gsm8k.test_set(lv)
        assert t == gsm8k.test_set(lv)
        test_prompts = {p.prompt for p in t}
        sample = gsm8k.sample_problems(lv, 200, seed=3)
        assert len(sample) == 200 and not test_prompts & {p.prompt for p in sample}


def test_sampling_deterministic_unique_then_repeats(gsm8k):
    state = random.getstate()
    a = gsm8k.sample_problems(4, 100, seed=9)
    assert random.getstate() == state
    assert a == gsm8k.sample_problems(4, 100, seed=9) != gsm8k.sample_problems(4, 100, seed=10)
    assert len({p.problem_id for p in a}) == 100
    pool = len({p.problem_id for p in gsm8k.sample_problems(8, 10**4, seed=0)})
    assert pool < 10**4  # level 8 is small: the pool is used up, then repeated
    assert len({p.problem_id for p in gsm8k.sample_problems(8, pool, seed=0)}) == pool


def test_test_size_per_level():
    d = Gsm8kDomain(DATA / "train.jsonl", DATA / "test.jsonl", test_size=5)
    full = Gsm8kDomain(DATA / "train.jsonl", DATA / "test.jsonl")
    for lv in d.levels():
        assert d.test_set(lv) == full.test_set(lv)[:5]


def test_commas_clipping_and_overlap(tmp_path):
    def lines(n: int, final: str) -> str:
        return "".join(f"step {i} <<{i}+1={i + 1}>>{i + 1}\n" for i in range(n)) + f"#### {final}"

    shared = {"question": "Q shared?", "answer": lines(2, "2")}
    train = [{"question": "Q long A?", "answer": lines(12, "1,234")},
             {"question": "  Q one?  ", "answer": "It is <<2*3=6>>6.\n#### -6"}, shared]
    test = [{"question": "Q long B?", "answer": lines(9, "5")}, shared, {"question": "Q t1?", "answer": "x\n#### 1"}]
    d = Gsm8kDomain(write_jsonl(tmp_path / "train.jsonl", train), write_jsonl(tmp_path / "test.jsonl", test))
    assert d.levels() == [1, 8]  # level 2 only had the shared question, which is held out
    (long_a,) = d.sample_problems(8, 1, seed=0)
    assert (long_a.prompt, long_a.answer, long_a.level) == ("Q long A?\n", "1234", 8)
    assert d.reference_solution(long_a).startswith("step 0 1\nstep 1 2\n")
    assert d.sample_problems(1, 2, seed=0)[0] == d.sample_problems(1, 2, seed=0)[1]  # pool of one, repeated
    (one,) = d.sample_problems(1, 1, seed=0)
    assert (one.prompt, one.answer, one.level) == ("Q one?\n", "-6", 1)
    assert d.reference_solution(one) == "It is 6.\n#### -6\n"
    assert [p.prompt for p in d.test_set(8)] == ["Q long B?\n"]
    assert d.verify([d.reference_solution(long_a)], [long_a.answer]) == [1.0]


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Gsm8kDomain(DATA / "train.jsonl", missing)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Gsm8kDomain(missing, DATA / "test.jsonl")


@pytest.mark.parametrize("bad_row", [{"question": "Q2"}, {"answer": "#### 3"}, {"question": "Q2", "answer": "3"}])
def test_bad_row_names_file_and_row(tmp_path, bad_row):
    good = {"question": "Q1", "answer": "x\n#### 1"}
    path = write_jsonl(tmp_path / "test.jsonl", [good, bad_row, good])
    with pytest.raises(ValueError, match=r"test\.jsonl: row 2"):
        Gsm8kDomain(DATA / "train.jsonl", path)


def test_get_domain_builds_gsm8k():
    d = get_domain("gsm8k", train_path=str(DATA / "train.jsonl"), test_path=str(DATA / "test.jsonl"), test_size=3)
    assert isinstance(d, Gsm8kDomain) and all(len(d.test_set(lv)) == 3 for lv in d.levels())


# --- steps, extraction, verification ------------------------------------------------------------

def test_split_steps():
    assert split_steps("a = 1\n\nb = 2\n#### 2\ntrailing") == ["a = 1", "b = 2", "#### 2"]
    assert split_steps("a\nA: 18") == ["a", "A: 18"]


@pytest.mark.parametrize("text, expected", [
    ("x\n#### 72", "72"),
    ("x\n#### 1,234,567\n", "1234567"),
    ("#### $18.50 per day", "18.50"),
    ("#### -5", "-5"),
    ("#### 3\nthen #### 4", "4"),  # the last '####' wins
    ("#### 3\nmore babble 99", "3"),  # trailing text after the answer is ignored
    ("so 16 - 3 = 13 eggs\nA: 13", "13"),  # fallback: last number
    ("costs 16-3", "3"),  # a minus after a digit is an operator, not a sign
    ("The answer is -7.", "-7"),
    ("####\nno number after the marker 5", "5"),
    ("no numbers at all", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_verify():
    assert verify(["#### 5", "#### 5.0", "#### 5.0000001", "#### 5.01", "A: 1,000", "nothing"],
                  ["5", "5", "5", "5", "1000", "5"]) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert verify(["#### 1000"], ["1,000"]) == [1.0]
    with pytest.raises(ValueError, match="1 completions but 2 references"):
        verify(["#### 1"], ["1", "2"])


def test_oracle_is_none(gsm8k):
    p = gsm8k.test_set(2)[0]
    assert gsm8k.oracle_step_labels(p, gsm8k.reference_solution(p)) is None


def test_agrees_with_labelled_model_solutions(gsm8k):
    """Real model solutions ('A: <n>' style, 11 truncated) with human is_correct labels; measured 5276/5276 on
    the full file."""
    answers = {p.prompt: p.answer for lv in gsm8k.levels() for p in gsm8k.test_set(lv)}
    completions, refs, labels = [], [], []
    for line in (DATA / "example_model_solutions.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"):
            completions.append(row[key]["solution"])
            refs.append(answers[row["question"].strip() + "\n"])
            labels.append(row[key]["is_correct"])
    got = gsm8k.verify(completions, refs)
    agree = sum((g == 1.0) == lab for g, lab in zip(got, labels))
    assert len(labels) == 4 * TEST_ROWS
    assert agree / len(labels) >= 0.95, f"{agree}/{len(labels)} agree"
