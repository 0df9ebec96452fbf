"""Unit tests for importing existing trajectories (`components.importing`), on the real `arith` domain
and on GSM8K's released model solutions (the subset in tests/data/gsm8k) with the real `gsm8k` domain.

    .venv/bin/python -m pytest tests/unit/test_importing.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.domains import get_domain
from components.importing import ImportSpec, match_and_verify, read_trajectories
from components.tables import to_table
from tests.conftest import GSM8K_DATA as DATA

GSM8K_MODELS = ["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"]
GSM8K_MIN_AGREEMENT = 0.97  # measured 1.000 overall and for each of the four models (5276 of 5276, full file)
GSM8K_QUESTIONS = 65  # tests/data/gsm8k/example_model_solutions.jsonl: one row a test question
GSM8K_CUT_OFF = 11  # solutions there with no answer line (all 11 of the full file's, kept on purpose)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_store_rows(result) -> None:
    """Every table's rows fit its Arrow schema, with exactly its columns."""
    for name, rows in result.tables().items():
        assert to_table(name, rows).num_rows == len(rows), name


@pytest.fixture(scope="module")
def arith():
    return get_domain("arith", max_level=2)


def wrong(domain, p) -> str:
    """The gold solution with a wrong final answer."""
    return domain.reference_solution(p).replace(f"#### {p.answer}", f"#### {int(p.answer) + 1}")


# --- simple layout ------------------------------------------------------------------------------

def test_simple_layout_rows_and_agreement(arith, tmp_path):
    p1, p2 = arith.test_set(1)[:2]
    q = arith.test_set(2)[0]
    rows = [
        {"question": p1.prompt.strip(), "completion": arith.reference_solution(p1), "correct": True},
        {"question": p1.prompt, "completion": wrong(arith, p1), "correct": 0},
        {"question": p2.prompt.strip(), "completion": wrong(arith, p2), "correct": 1},  # a wrong given label
        {"question": q.prompt.strip(), "completion": arith.reference_solution(q), "correct": None},
    ]
    spec = ImportSpec(correct_field="correct")
    trajs = read_trajectories(write_jsonl(tmp_path / "mine.jsonl", rows), spec)
    assert [(t.source_row, t.correct, t.source_model) for t in trajs] == [(1, True, None), (2, False, None),
                                                                        (3, True, None), (4, None, None)]
    r = match_and_verify(trajs, arith, "exp", 3)

    assert [t["problem_id"] for t in r.trajectories] == [p1.problem_id, p1.problem_id, p2.problem_id, q.problem_id]
    assert [t["sample_index"] for t in r.trajectories] == [0, 1, 0, 0]
    assert [p["problem_id"] for p in r.problems] == [p1.problem_id, p2.problem_id, q.problem_id]
    assert {p["split"] for p in r.problems} == {"test"} and r.by_split == {"test": 4}
    assert all(t["round"] == 3 and t["experiment_id"] == "exp" and t["purpose"] == "train" for t in r.trajectories)
    assert [t["prompt"] for t in r.trajectories] == [p1.prompt, p1.prompt, p2.prompt, q.prompt]
    assert r.trajectories[0]["completion"] == arith.reference_solution(p1)  # arith: no normalisation
    assert [t["answer"] for t in r.trajectories][::3] == [p1.answer, q.answer]
    assert [v["correct"] for v in r.verifications] == [True, False, False, True]
    assert {v["verifier"] for v in r.verifications} == {"arith.verify"}
    # Steps are the domain's: one a line, the answer line last.
    first = [s["text"] for s in r.steps if s["trajectory_id"] == r.trajectories[0]["trajectory_id"]]
    assert first == arith.split_steps(arith.reference_solution(p1))
    assert r.step_labels == []
    assert [(x["source_row"], x["given_correct"], x["original_completion"]) for x in r.lineage] == [
        (1, True, None), (2, False, None), (3, True, None), (4, None, None)]

    a = r.overall
    assert (a.imported, a.labelled, a.given_right, a.verifier_right, a.agree) == (4, 3, 2, 2, 2)
    assert a.rate == pytest.approx(2 / 3)
    assert r.confusion == {(True, True): 1, (False, False): 1, (True, False): 1, (None, True): 1}
    assert r.metrics()["agreement"] == pytest.approx(2 / 3)
    text = r.summary()
    assert "imported 4 trajectories on 3 problems (4 test)" in text and "66.7%" in text
    assert_store_rows(r)


def test_trajectory_ids_are_deterministic(arith, tmp_path):
    p = arith.test_set(1)[0]
    rows = [{"question": p.prompt, "completion": arith.reference_solution(p)}] * 2
    trajs = read_trajectories(write_jsonl(tmp_path / "a.jsonl", rows), ImportSpec())
    ids = [t["trajectory_id"] for t in match_and_verify(trajs, arith, "exp", 1).trajectories]
    assert len(set(ids)) == 2  # the same text on two rows: two trajectories
    assert ids == [t["trajectory_id"] for t in match_and_verify(trajs, arith, "exp", 1).trajectories]
    # The same file name elsewhere gives the same ids; another round or experiment does not.
    (tmp_path / "sub").mkdir()
    moved = read_trajectories(write_jsonl(tmp_path / "sub" / "a.jsonl", rows), ImportSpec())
    assert ids == [t["trajectory_id"] for t in match_and_verify(moved, arith, "exp", 1).trajectories]
    assert not set(ids) & {t["trajectory_id"] for t in match_and_verify(trajs, arith, "exp", 2).trajectories}
    assert not set(ids) & {t["trajectory_id"] for t in match_and_verify(trajs, arith, "other", 1).trajectories}
    # Importing the same file twice into one round would collide.
    with pytest.raises(ValueError, match="share an id"):
        match_and_verify(trajs + moved, arith, "exp", 1)


def test_parquet_reads_like_jsonl(arith, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = arith.test_set(2)[1]
    rows = [{"prompt": p.prompt, "text": arith.reference_solution(p), "ok": 1, "by": "m"},
            {"prompt": p.prompt, "text": wrong(arith, p), "ok": 0, "by": "m"}]
    spec = ImportSpec(prompt_field="prompt", completion_field="text", correct_field="ok", model_field="by")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    from_parquet = read_trajectories(tmp_path / "t.parquet", spec)
    from_jsonl = read_trajectories(write_jsonl(tmp_path / "t.jsonl", rows), spec)
    strip = [(t.question, t.completion, t.correct, t.source_row, t.source_model) for t in from_jsonl]
    assert [(t.question, t.completion, t.correct, t.source_row, t.source_model) for t in from_parquet] == strip
    r = match_and_verify(from_parquet, arith, "exp", 1)
    assert [v["correct"] for v in r.verifications] == [True, False] and r.overall.rate == 1.0
    assert {t["policy_model_id"] for t in r.trajectories} == {"external:m"}


# --- wide layout --------------------------------------------------------------------------------

def test_wide_layout_one_trajectory_per_model(arith, tmp_path):
    ps = arith.test_set(1)[:3]
    rows = [{"question": p.prompt.strip(), "gold": "ignored",
             "small": {"solution": wrong(arith, p), "is_correct": i == 0},  # row 1's label is wrong
             "big": {"solution": arith.reference_solution(p), "is_correct": True}} for i, p in enumerate(ps)]
    trajs = read_trajectories(write_jsonl(tmp_path / "wide.jsonl", rows), ImportSpec(models=["small", "big"]))
    assert [(t.source_row, t.source_model) for t in trajs] == [(1, "small"), (1, "big"), (2, "small"), (2, "big"),
                                                               (3, "small"), (3, "big")]
    r = match_and_verify(trajs, arith, "exp", 1)
    assert len(r.trajectories) == 6 and len(r.problems) == 3
    assert [t["policy_model_id"] for t in r.trajectories][:2] == ["external:small", "external:big"]
    assert [t["sample_index"] for t in r.trajectories] == [0, 1] * 3
    small, big = r.by_model["small"], r.by_model["big"]
    assert (small.imported, small.given_right, small.verifier_right, small.agree) == (3, 1, 0, 2)
    assert (big.imported, big.given_right, big.verifier_right, big.agree) == (3, 3, 3, 3)
    assert r.metrics()["agreement_small"] == pytest.approx(2 / 3) and r.metrics()["agreement_big"] == 1.0
    assert r.overall.agree == 5 and r.confusion == {(True, False): 1, (False, False): 2, (True, True): 3}
    assert "small" in r.summary() and "big" in r.summary()
    assert_store_rows(r)


# --- errors name the row ------------------------------------------------------------------------

def test_missing_problem_names_file_row_and_question(arith, tmp_path):
    p = arith.test_set(1)[0]
    good = {"question": p.prompt, "completion": arith.reference_solution(p)}
    rows = [good, good, {"question": "9+9+9+9+9+9+9", "completion": "#### 63"}, good]
    trajs = read_trajectories(write_jsonl(tmp_path / "some.jsonl", rows), ImportSpec())
    with pytest.raises(ValueError, match=r"1 of 4 trajectories .* some\.jsonl row 3: '9\+9\+9\+9\+9\+9\+9'"):
        match_and_verify(trajs, arith, "exp", 1)

    many = [{"question": f"not a problem {i}", "completion": "x"} for i in range(8)]
    trajs = read_trajectories(write_jsonl(tmp_path / "many.jsonl", many), ImportSpec())
    with pytest.raises(ValueError, match=r"8 of 8 .*row 5: 'not a problem 4' \(and 3 more\)") as e:
        match_and_verify(trajs, arith, "exp", 1)
    assert "row 6" not in str(e.value)


def test_missing_field_names_row(tmp_path):
    rows = [{"question": "1+2", "completion": "#### 3"}, {"question": "1+2", "answer": "#### 3"}]
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2: missing field 'completion'"):
        read_trajectories(write_jsonl(tmp_path / "bad.jsonl", rows), ImportSpec())
    with pytest.raises(ValueError, match=r"row 1: missing field 'correct'"):
        read_trajectories(tmp_path / "bad.jsonl", ImportSpec(correct_field="correct"))
    wide = [{"question": "1+2", "m": {"solution": "#### 3", "is_correct": True}}, {"question": "1+2", "m": {"text": ""}}]
    with pytest.raises(ValueError, match=r"row 2, 'm': missing field 'solution'"):
        read_trajectories(write_jsonl(tmp_path / "wide.jsonl", wide), ImportSpec(models=["m"]))
    with pytest.raises(ValueError, match=r"row 1: missing field 'n'"):
        read_trajectories(tmp_path / "wide.jsonl", ImportSpec(models=["m", "n"]))
    labels = [{"question": "1+2", "completion": "#### 3", "correct": "yes"}]
    with pytest.raises(ValueError, match=r"row 1: field 'correct' must be a bool or 0/1"):
        read_trajectories(write_jsonl(tmp_path / "lab.jsonl", labels), ImportSpec(correct_field="correct"))
    (tmp_path / "broken.jsonl").write_text('{"question": "1+2", "completion": "#### 3"}\n\n{"question": \n')
    with pytest.raises(ValueError, match=r"row 3 is not valid JSON"):
        read_trajectories(tmp_path / "broken.jsonl", ImportSpec())


# --- step labels --------------------------------------------------------------------------------

def test_step_labels_become_step_label_rows(arith, tmp_path):
    p = arith.test_set(2)[0]
    slip = arith.reference_solution(p).splitlines()
    first_total = slip[0].rsplit("=", 1)[1]
    slip[0] = slip[0].rsplit("=", 1)[0] + f"={int(first_total) + 1}"  # a wrong first step
    completion = "\n".join(slip) + "\n"
    oracle = arith.oracle_step_labels(p, completion)
    assert oracle[0] is False and len(oracle) == 3
    rows = [{"question": p.prompt, "completion": completion, "steps_ok": [int(x) for x in oracle]},
            {"question": p.prompt, "completion": arith.reference_solution(p), "steps_ok": None}]
    spec = ImportSpec(step_labels_field="steps_ok")
    r = match_and_verify(read_trajectories(write_jsonl(tmp_path / "s.jsonl", rows), spec), arith, "exp", 1)
    tid = r.trajectories[0]["trajectory_id"]
    assert [(s["trajectory_id"], s["step_index"], s["value"], s["source"]) for s in r.step_labels] == [
        (tid, k, 1.0 if ok else 0.0, "given") for k, ok in enumerate(oracle)]
    assert len(r.steps) == 6
    assert_store_rows(r)

    short = [{"question": p.prompt, "completion": completion, "steps_ok": [True, True]}]
    trajs = read_trajectories(write_jsonl(tmp_path / "short.jsonl", short), spec)
    with pytest.raises(ValueError, match=r"row 1: 2 step labels but the arith domain splits .* into 3 steps"):
        match_and_verify(trajs, arith, "exp", 1)


# --- the real GSM8K model solutions --------------------------------------------------------------

@pytest.fixture(scope="module")
def gsm8k():
    assert DATA.is_dir(), f"no GSM8K data at {DATA}: it ships with the repo, in tests/data/gsm8k"
    from components.domains.gsm8k import Gsm8kDomain

    return Gsm8kDomain(DATA / "train.jsonl", DATA / "test.jsonl")


def test_gsm8k_example_model_solutions(gsm8k):
    trajs = read_trajectories(DATA / "example_model_solutions.jsonl", ImportSpec(models=GSM8K_MODELS))
    n = 4 * GSM8K_QUESTIONS
    assert len(trajs) == n
    r = match_and_verify(trajs, gsm8k, "exp", 1)  # raises if any question is not in the dataset
    print("\n" + r.summary())

    assert len(r.trajectories) == n and len(r.problems) == GSM8K_QUESTIONS and r.by_split == {"test": n}
    assert len({t["trajectory_id"] for t in r.trajectories}) == n
    assert r.overall.labelled == n and r.overall.rate >= GSM8K_MIN_AGREEMENT
    assert set(r.by_model) == set(GSM8K_MODELS)
    for model, a in r.by_model.items():
        assert a.imported == GSM8K_QUESTIONS and a.rate >= GSM8K_MIN_AGREEMENT, model
    # Normalised to the dataset's format: annotations gone, the 'A:' line now the '####' answer step,
    # and the file's text kept in the lineage.
    tid = r.trajectories[0]["trajectory_id"]
    assert r.trajectories[0]["completion"] == (
        "Janet eats 3 ducks eggs for breakfast every morning and she sells the rest so she has 16 - 3 = 13 ducks eggs left\n"
        "She has 13 ducks eggs and she sells 2 each day so she makes 13 * 2 = $26\n#### 26\n")
    assert [s["text"] for s in r.steps if s["trajectory_id"] == tid][-1] == "#### 26"
    assert r.lineage[0]["original_completion"].endswith("$<<13*2=26>>26\nA: 26")
    assert r.lineage[0]["source_row"] == 1 and r.lineage[0]["source_model"] == "6b_finetuning"
    ends = sum(t["completion"].rstrip().splitlines()[-1].startswith("#### ") for t in r.trajectories)
    assert ends == n - GSM8K_CUT_OFF  # all but the truncated ones end in an answer line
    assert not any("<<" in t["completion"] and ">>" in t["completion"] for t in r.trajectories)
    assert_store_rows(r)
