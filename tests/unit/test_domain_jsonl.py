"""Unit tests for the `jsonl` domain and its answer checkers, on real files written to tmp_path and
on real GSM8K rows (the subset shipped in tests/data/gsm8k).

    .venv/bin/python -m pytest -q tests/unit/test_domain_jsonl.py components/domains/jsonl.py components/domains/checkers.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from components.domains import Domain, get_domain
from components.domains.checkers import CHECKERS, get_checker, math_equal, math_parse_reference
from components.domains.jsonl import JsonlDomain
from tests.conftest import GSM8K_DATA as GSM8K

GSM8K_TRAIN, GSM8K_TEST = 600, 65  # rows in tests/data/gsm8k (its README says which)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arith_rows(n: int, offset: int = 0) -> list[dict]:
    """Distinct GSM8K-style rows: two lines of work, then '#### answer'."""
    return [{"question": f"What is {i} + {i + 1} + 1?",
             "answer": f"{i} + {i + 1} = {2 * i + 1}\n{2 * i + 1} + 1 = {2 * i + 2}\n#### {2 * i + 2}"}
            for i in range(offset, offset + n)]


# --- GSM8K through the generic domain ----------------------------------------------------------

@pytest.fixture(scope="module")
def gsm8k() -> JsonlDomain:
    assert GSM8K.is_dir(), f"{GSM8K} is absent: it ships with the repo, in tests/data/gsm8k"
    return get_domain("jsonl", train=str(GSM8K / "train.jsonl"), test=str(GSM8K / "test.jsonl"), answer_field="answer")


def test_gsm8k_sizes_and_levels_from_solution_length(gsm8k):
    assert isinstance(gsm8k, Domain) and gsm8k.name == "jsonl"
    assert gsm8k.levels() == [2, 3, 4, 5, 6, 7, 8]  # every GSM8K solution has at least two lines of work
    assert sum(len(gsm8k.test_set(lv)) for lv in gsm8k.levels()) == GSM8K_TEST
    train = [p for lv in gsm8k.levels() for p in gsm8k.sample_problems(lv, 10**4, seed=0)]
    assert len({p.problem_id for p in train}) == GSM8K_TRAIN
    natalia = next(p for p in train if p.prompt.startswith("Natalia sold clips"))
    assert natalia.answer == "72" and natalia.level == 2 and natalia.prompt.endswith("May?\n")
    assert gsm8k.reference_solution(natalia).endswith("altogether in April and May.\n#### 72\n")
    for lv in gsm8k.levels():
        probs = gsm8k.test_set(lv)[:30] + gsm8k.sample_problems(lv, 30, seed=1)
        refs = [gsm8k.reference_solution(p) for p in probs]
        assert gsm8k.verify(refs, [p.answer for p in probs]) == [1.0] * len(probs)
        steps = [gsm8k.split_steps(r) for r in refs]
        assert all(s[-1].startswith("####") for s in steps)
        # the level is the number of lines of work before the answer line, clamped to 8
        assert all(len(s) - 1 == lv if lv < 8 else len(s) - 1 >= 8 for s in steps)


def test_split_steps_stop_at_the_answer_step(tmp_path):
    d = JsonlDomain(train=write_jsonl(tmp_path / "t.jsonl", arith_rows(10)))
    assert d.split_steps("1 + 2 = 3\n\n 3 + 1 = 4 \n#### 4\nbabble\n#### 5") == ["1 + 2 = 3", "3 + 1 = 4", "#### 4"]
    assert d.split_steps("so $\\boxed{4}$.\nmore") == ["so $\\boxed{4}$."]
    paragraphs = JsonlDomain(train=tmp_path / "t.jsonl", step_separator="\n\n")
    assert paragraphs.split_steps("a\nb\n\nc\n\n#### 4\n\nd") == ["a\nb", "c", "#### 4"]


def test_gsm8k_find_problem(gsm8k):
    p = gsm8k.test_set(2)[0]
    assert gsm8k.find_problem("  " + p.prompt.strip() + "\n") == p
    assert gsm8k.find_problem("Not a GSM8K question at all?") is None


# --- MATH-like answers through `math` ----------------------------------------------------------

MATH_ROWS = [
    {"problem": "Compute $\\frac{3}{6}$.", "level": "Level 3",
     "solution": "We divide top and bottom by 3.\nSo the answer is $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Simplify $2x + 3x$.", "level": "Level 1", "solution": "Collect terms: $\\boxed{5x}$."},
    {"problem": "What is $\\sqrt{18}$?", "level": "Level 3", "solution": "$\\sqrt{18} = \\boxed{3\\sqrt{2}}$"},
]


@pytest.fixture
def math_domain(tmp_path) -> JsonlDomain:
    train = write_jsonl(tmp_path / "math_train.jsonl", MATH_ROWS)
    test = write_jsonl(tmp_path / "math_test.jsonl", [
        {"problem": "Compute $\\frac{4}{8}$.", "level": "Level 3", "solution": "Divide by 4: $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Simplify $x + x$.", "level": 1, "solution": "$\\boxed{2x}$"},
    ])
    return JsonlDomain(train=train, test=test, question_field="problem", answer_field="solution",
                       checker="math", level_field="level")


def test_math_boxed_answers_levels_and_equivalence(math_domain):
    assert math_domain.levels() == [1, 3]  # "Level 3" strings and plain ints
    p = math_domain.test_set(3)[0]
    assert p.answer == "\\frac{1}{2}" and p.prompt == "Compute $\\frac{4}{8}$.\n"
    completions = ["Dividing, we get $\\boxed{0.5}$.", "#### \\frac{2}{4}", "The answer is $\\frac{2}{4}$.",
                   "$\\boxed{\\frac{1}{3}}$", "one half"]
    assert math_domain.verify(completions, [p.answer] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert math_domain.extract_answer(completions[0]) == "0.5"
    assert math_domain.extract_answer("no marker, just 0.5") is None
    sqrt = math_domain.find_problem("What is $\\sqrt{18}$?")
    assert sqrt.answer == "3\\sqrt{2}" and math_domain.verify(["\\boxed{\\sqrt{18}}"], [sqrt.answer]) == [1.0]


def test_math_reference_solutions_are_the_worked_solutions(math_domain):
    p = math_domain.find_problem("Compute $\\frac{3}{6}$.")
    ref = math_domain.reference_solution(p)
    assert ref == MATH_ROWS[0]["solution"] + "\n"  # already ends in a boxed answer: nothing added
    assert math_domain.split_steps(ref) == ["We divide top and bottom by 3.", "So the answer is $\\boxed{\\frac{1}{2}}$."]
    probs = [math_domain.find_problem(r["problem"]) for r in MATH_ROWS]
    assert math_domain.verify([math_domain.reference_solution(q) for q in probs], [q.answer for q in probs]) == [1.0] * 3


def test_math_falls_back_to_sympy_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError):
        import math_verify  # noqa: F401
    assert math_equal("0.5", "\\frac{1}{2}") and math_equal("\\dfrac{2}{4}", "0.5") and math_equal("2x", "x*2")
    assert math_equal("3\\sqrt{2}", "\\sqrt{18}") and not math_equal("2", "3")
    assert math_parse_reference("$\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"


# --- numeric and exact checkers ----------------------------------------------------------------

@pytest.mark.parametrize("completion, score", [
    ("So she has 18 eggs.\nA: 18", 1.0), ("18 - 2 = 16\n#### 18", 1.0), ("#### 18.0", 1.0),
    ("The answer is 18.", 1.0), ("$\\boxed{18}$", 1.0), ("A: 17", 0.0), ("#### 18.01", 0.0),
    ("12 + 6 = 18", 1.0),  # no marker: the last number
    ("A: 18 eggs, 3 left", 1.0),  # after a marker, the first number
    ("no number", 0.0),
])
def test_numeric_checker(completion, score):
    assert get_checker("numeric").verify([completion], ["18"]) == [score]


def test_numeric_checker_commas_and_tolerance():
    c = get_checker("numeric")
    assert c.verify(["#### 1,200", "#### 1200.0000001", "#### 1201"], ["1200"] * 3) == [1.0, 1.0, 0.0]
    assert c.parse_reference(" 1,200 ") == "1200" and c.parse_reference(7) == "7"
    for bad in ["seven", "", None, True, "1/2"]:
        with pytest.raises(ValueError, match="expected a number"):
            c.parse_reference(bad)


def test_exact_checker_in_a_domain(tmp_path):
    rows = [{"q": f"Capital number {i}?", "a": f"City {i}"} for i in range(20)]
    d = JsonlDomain(train=write_jsonl(tmp_path / "capitals.jsonl", rows), question_field="q", answer_field="a",
                    checker="exact", test_fraction=0.25)
    assert d.levels() == [1]  # no level field, no worked solution: one level
    p = d.test_set(1)[0]
    assert d.reference_solution(p) == f"#### {p.answer}\n" and d.verify([d.reference_solution(p)], [p.answer]) == [1.0]
    assert d.verify(["thinking\n#### City 3 \n", "#### city 3", "\\boxed{City 3}", "so:\nCity 3\n", "City 4"],
                    ["City 3"] * 5) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert get_checker("exact").extract("#### a\nnote\n#### b\nmore") == "b"


def test_unknown_checker_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match=r"unknown checker 'fuzzy'.*\['exact', 'math', 'numeric'\]"):
        get_checker("fuzzy")
    with pytest.raises(ValueError, match="unknown checker 'fuzzy'"):
        JsonlDomain(train=write_jsonl(tmp_path / "t.jsonl", arith_rows(5)), checker="fuzzy")
    assert sorted(CHECKERS) == ["exact", "math", "numeric"]


# --- file formats ------------------------------------------------------------------------------

def test_parquet_with_numeric_answers_and_template(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(lo: int, hi: int):
        return pa.Table.from_pylist([{"text": f"{i} apples and {i} more?", "n": 2 * i,
                                      "work": f"{i} + {i} = {2 * i}\nSo {2 * i} apples.", "difficulty": 1 + i % 3}
                                     for i in range(lo, hi)])

    pq.write_table(table(0, 12), tmp_path / "train.parquet")
    pq.write_table(table(100, 106), tmp_path / "test.parquet")
    d = JsonlDomain(train=tmp_path / "train.parquet", test=tmp_path / "test.parquet", question_field="text",
                    answer_field="n", solution_field="work", level_field="difficulty",
                    prompt_template="Question: {question}\nAnswer:\n", name="apples")
    assert d.levels() == [1, 2, 3]
    p = d.test_set(2)[0]
    assert p.prompt == "Question: 100 apples and 100 more?\nAnswer:\n" and p.answer == "200" and p.domain == "apples"
    # the solution's last number is the answer, so nothing is added; level_field wins over its length
    assert d.reference_solution(p) == "100 + 100 = 200\nSo 200 apples.\n" and p.level == 2
    assert d.find_problem("100 apples and 100 more?") == p == d.find_problem(p.prompt)
    other = JsonlDomain(train=tmp_path / "train.parquet", test=tmp_path / "test.parquet", question_field="text",
                        answer_field="n", solution_field="work", level_field="difficulty")
    assert other.test_set(2)[0].problem_id != p.problem_id  # `name` keeps two datasets' ids apart


def test_solution_without_an_answer_line_gets_one(tmp_path):
    rows = [{"question": f"Name {i}?", "answer": f"Item {i}", "why": f"Look it up.\nIt is listed as number {i}."}
            for i in range(10)]
    d = JsonlDomain(train=write_jsonl(tmp_path / "names.jsonl", rows), solution_field="why", checker="exact")
    p = d.find_problem("Name 3?")
    assert d.reference_solution(p) == "Look it up.\nIt is listed as number 3.\n#### Item 3\n"
    assert p.level == 2 and d.split_steps(d.reference_solution(p))[-1] == "#### Item 3"


def test_save_to_disk_dataset_dict_and_dataset(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(arith_rows(8)),
                               "validation": datasets.Dataset.from_list(arith_rows(3, offset=50))})
    dd.save_to_disk(str(tmp_path / "dd"))
    d = JsonlDomain(train=tmp_path / "dd", test_split="validation")  # the dict's split serves as the test set
    assert d.levels() == [2]
    assert [p.answer for p in d.test_set(2)] == ["102", "104", "106"]
    assert len(d.sample_problems(2, 8, seed=0)) == 8 and {p.answer for p in d.sample_problems(2, 8, seed=0)} == {
        str(2 * i + 2) for i in range(8)}
    with pytest.raises(ValueError, match=r"no split 'test'.*\['train', 'validation'\]"):
        JsonlDomain(train=tmp_path / "dd", test=tmp_path / "dd")

    datasets.Dataset.from_list(arith_rows(3, offset=50)).save_to_disk(str(tmp_path / "ds"))
    d = JsonlDomain(train=tmp_path / "dd", test=tmp_path / "ds")
    assert [p.answer for p in d.test_set(2)] == ["102", "104", "106"]


def test_train_questions_in_the_test_file_are_dropped(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", arith_rows(6))
    test = write_jsonl(tmp_path / "test.jsonl", arith_rows(2, offset=4))
    d = JsonlDomain(train=train, test=test)
    train_answers = {p.answer for p in d.sample_problems(2, 100, seed=0)}
    assert train_answers == {"2", "4", "6", "8"} and {p.answer for p in d.test_set(2)} == {"10", "12"}


# --- seeded split ------------------------------------------------------------------------------

def test_seeded_split_deterministic_disjoint_and_order_free(tmp_path):
    rows = arith_rows(200)
    a = JsonlDomain(train=write_jsonl(tmp_path / "a.jsonl", rows))
    b = JsonlDomain(train=write_jsonl(tmp_path / "a.jsonl", rows))
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    c = JsonlDomain(train=write_jsonl(tmp_path / "c.jsonl", shuffled))
    other_seed = JsonlDomain(train=tmp_path / "a.jsonl", split_seed=1)

    test_ids = {p.problem_id for p in a.test_set(2)}
    train_ids = {p.problem_id for p in a.sample_problems(2, 10**4, seed=0)}
    assert len(test_ids) == 20 and len(train_ids) == 180 and not test_ids & train_ids
    assert {p.problem_id for p in b.test_set(2)} == test_ids
    assert {p.problem_id for p in c.test_set(2)} == test_ids  # content decides, not file order
    assert {p.problem_id for p in other_seed.test_set(2)} != test_ids
    assert all(p.meta["split"] == "test" for p in a.test_set(2))
    assert len(JsonlDomain(train=tmp_path / "a.jsonl", test_fraction=0.25).test_set(2)) == 50


# --- bad input: file, 1-based row and field in every message -------------------------------------

@pytest.mark.parametrize("rows, options, pattern", [
    ([{"question": "ok?", "answer": "#### 1"}, {"answer": "#### 2"}], {}, r"row 2: field 'question'"),
    ([{"question": "ok?", "answer": "#### 1"}, {"question": "q?", "answer": "#### 2"}, {"question": "x?"}], {},
     r"row 3: field 'answer'"),
    ([{"question": "ok?", "answer": "#### 1"}, {"question": "q?", "answer": "#### two"}], {},
     r"row 2: field 'answer': checker 'numeric' cannot parse the answer '#### two'"),
    ([{"question": "q?", "answer": "\\boxed{}"}], {"checker": "math"}, r"row 1: field 'answer': checker 'math'"),
    ([{"question": "q?", "answer": ""}], {"checker": "exact"}, r"row 1: field 'answer': checker 'exact'"),
    ([{"question": "q?", "answer": "#### 1", "level": "Level 2"}, {"question": "r?", "answer": "#### 1", "level": "Level ?"}],
     {"level_field": "level"}, r"row 2: field 'level': expected an integer level.*'Level \?'"),
    ([{"question": "q?", "answer": "#### 1", "level": 2.5}], {"level_field": "level"}, r"row 1: field 'level'"),
    ([{"question": "q?", "answer": "Answer: 1"}, {"question": "r?", "answer": "1"}], {"answer_pattern": r"Answer: (\d+)"},
     r"row 2: field 'answer': answer_pattern"),
    ([{"question": "q?", "answer": "#### 1"}], {"solution_field": "solution"}, r"row 1: field 'solution'"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, rows, options, pattern):
    path = write_jsonl(tmp_path / "bad_rows.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad_rows\.jsonl: " + pattern):
        JsonlDomain(train=path, **options)


def test_bad_row_in_test_parquet_names_that_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q?", "answer": "3"}, {"question": "r?", "answer": "n/a"}]),
                   tmp_path / "held_out.parquet")
    with pytest.raises(ValueError, match=r"held_out\.parquet: row 2: field 'answer'.*'n/a'"):
        JsonlDomain(train=write_jsonl(tmp_path / "t.jsonl", arith_rows(3)), test=tmp_path / "held_out.parquet")


def test_missing_files_and_bad_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlDomain(train=tmp_path / "nope.jsonl")
    train = write_jsonl(tmp_path / "t.jsonl", arith_rows(5))
    with pytest.raises(FileNotFoundError, match="missing_test.parquet"):
        JsonlDomain(train=train, test=tmp_path / "missing_test.parquet")
    (tmp_path / "t.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"t\.csv: unsupported file type"):
        JsonlDomain(train=tmp_path / "t.csv")
    with pytest.raises(ValueError, match="test_fraction"):
        JsonlDomain(train=train, test_fraction=1.0)
    with pytest.raises(ValueError, match="prompt_template"):
        JsonlDomain(train=train, prompt_template="{problem}\n")
    with pytest.raises(ValueError, match="needs a group"):
        JsonlDomain(train=train, answer_pattern=r"#### \d+")


def test_no_oracle_and_verify_length_check(tmp_path):
    d = JsonlDomain(train=write_jsonl(tmp_path / "t.jsonl", arith_rows(10)))
    p = d.sample_problems(2, 1, seed=0)[0]
    assert d.oracle_step_labels(p, d.reference_solution(p)) is None and d.check_steps(p.prompt, "x") is None
    with pytest.raises(ValueError, match="1 completions but 2 references"):
        d.verify(["#### 1"], ["1", "2"])
