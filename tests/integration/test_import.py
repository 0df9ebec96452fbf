"""`coevo import` as a user runs it: GSM8K's real model solutions (4 models x 1,319 test questions, each with
`is_correct`) into the store through the `import_trajectories` flow, re-verified, with their lineage.

    .venv/bin/python -m pytest tests/integration/test_import.py -q
"""

from __future__ import annotations

import json

import pytest
import yaml

from components.store import Store
from tests.conftest import SHARED, run_coevo

pytestmark = pytest.mark.slow

GSM8K = SHARED / "data" / "gsm8k"
MODELS = ["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    assert GSM8K.is_dir(), f"{GSM8K}: the shared GSM8K data is missing (CI has it)"
    w = tmp_path_factory.mktemp("import")
    (w / "gsm8k.yaml").write_text(yaml.safe_dump({
        "experiment": "unused", "workdir": str(w),
        "domain": {"name": "gsm8k", "options": {"train_path": str(GSM8K / "train.jsonl"),
                                                "test_path": str(GSM8K / "test.jsonl")}}}))
    return w


def _import(workdir, file, experiment, *extra):
    return run_coevo("import", str(file), "--config", str(workdir / "gsm8k.yaml"), "--experiment", experiment,
                     *extra, prefect_home=workdir / ".prefect")


@pytest.fixture(scope="module")
def imported(workdir):
    p = _import(workdir, GSM8K / "example_model_solutions.jsonl", "solutions", "--models", ",".join(MODELS),
                "--purpose", "eval")
    assert p.returncode == 0, p.stdout + p.stderr
    return p, Store(workdir / "coevo.duckdb")


def test_every_solution_is_stored_with_its_lineage(imported):
    p, store = imported
    assert store.rows("SELECT count(*) AS n FROM trajectories WHERE experiment_id='solutions' AND purpose='eval'"
                      )[0]["n"] == 4 * 1319
    src = store.rows("SELECT source_model, count(*) AS n, min(source_row) AS lo, max(source_row) AS hi, "
                     "count(DISTINCT trajectory_id) AS ids FROM trajectory_sources GROUP BY 1 ORDER BY 1")
    assert [r["source_model"] for r in src] == sorted(MODELS)
    assert all((r["n"], r["lo"], r["hi"], r["ids"]) == (1319, 1, 1319, 1319) for r in src)
    # Row 1 of the file is Janet's ducks; its 175b_verification solution is right, and says so.
    first = store.rows("SELECT t.prompt, t.completion, s.given_correct, s.original_completion, v.correct "
                       "FROM trajectory_sources s JOIN trajectories t USING (trajectory_id) "
                       "JOIN verifications v USING (trajectory_id) "
                       "WHERE s.source_row = 1 AND s.source_model = '175b_verification'")[0]
    assert first["prompt"].startswith("Janet") and first["given_correct"] is True and first["correct"] is True
    # Normalised to the domain's answer format, the text as written kept beside it.
    assert "<<" not in first["completion"] and "#### 18" in first["completion"]
    assert "A: 18" in first["original_completion"]
    assert "agreement=1" in p.stdout.replace(" ", "") or "agreement=0.9" in p.stdout.replace(" ", "")


def test_the_verifier_agrees_with_the_given_labels(imported):
    _, store = imported
    by_model = store.rows("SELECT s.source_model AS m, avg(CAST(v.correct = s.given_correct AS DOUBLE)) AS agree, "
                          "avg(CAST(s.given_correct AS DOUBLE)) AS given FROM trajectory_sources s "
                          "JOIN verifications v USING (trajectory_id) GROUP BY 1")
    assert len(by_model) == 4 and all(r["agree"] >= 0.97 for r in by_model), by_model
    # The four models differ as they should: the 175B verifier best, the 6B fine-tune worst.
    given = {r["m"]: r["given"] for r in by_model}
    assert given["175b_verification"] > given["175b_finetuning"] > given["6b_finetuning"]
    metrics = json.loads(store.committed_run("solutions", 0, "import")["metrics_json"])
    assert metrics["imported"] == 4 * 1319 and metrics["agreement"] >= 0.97


def test_test_problems_are_refused_for_training(workdir):
    p = _import(workdir, GSM8K / "example_model_solutions.jsonl", "leak", "--models", "6b_finetuning")
    assert p.returncode != 0 and "held-out" in p.stderr + p.stdout and "purpose: eval" in p.stderr + p.stdout
    assert Store(workdir / "coevo.duckdb").committed_run("leak", 0, "import") is None


def test_a_problem_not_in_the_dataset_names_its_row(workdir):
    rows = [{"question": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
                         "muffins for her friends every day with four. She sells the remainder at the farmers' market "
                         "daily for $2 per fresh duck egg. How much in dollars does she make every day at the "
                         "farmers' market?", "completion": "16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18", "correct": True},
            {"question": "How many moons does Neptune have?", "completion": "#### 16", "correct": True}]
    bad = workdir / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _import(workdir, bad, "bad", "--correct-field", "correct", "--purpose", "eval")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode != 0 and "bad.jsonl row 2" in out and "Neptune" in out, out[-2000:]
    assert Store(workdir / "coevo.duckdb").committed_run("bad", 0, "import") is None
