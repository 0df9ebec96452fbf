"""`coevo import` as a user runs it: GSM8K's real model solutions (4 models x 65 test questions, each with
`is_correct`) into the store through the `import_trajectories` flow, re-verified, with their lineage.

    .venv/bin/python -m pytest tests/integration/test_import.py -q
"""

from __future__ import annotations

import json

import pytest
import yaml

from components.store import Store
from tests.conftest import GSM8K_DATA as GSM8K
from tests.conftest import run_coevo

pytestmark = pytest.mark.slow

MODELS = ["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"]
QUESTIONS = 65  # rows of tests/data/gsm8k/example_model_solutions.jsonl, one a test question


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    assert GSM8K.is_dir(), f"{GSM8K}: the GSM8K subset that ships with the repo is missing"
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
    return p, Store(workdir / "store")


def test_every_solution_is_stored_with_its_lineage(imported):
    p, store = imported
    assert store.rows("SELECT count(*) AS n FROM trajectories WHERE experiment_id='solutions' AND purpose='eval'"
                      )[0]["n"] == 4 * QUESTIONS
    src = store.rows("SELECT source_model, count(*) AS n, min(source_row) AS lo, max(source_row) AS hi, "
                     "count(DISTINCT trajectory_id) AS ids FROM trajectory_sources GROUP BY 1 ORDER BY 1")
    assert [r["source_model"] for r in src] == sorted(MODELS)
    assert all((r["n"], r["lo"], r["hi"], r["ids"]) == (QUESTIONS, 1, QUESTIONS, QUESTIONS) for r in src)
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
    assert metrics["imported"] == 4 * QUESTIONS and metrics["agreement"] >= 0.97


def test_test_problems_are_refused_for_training(workdir):
    p = _import(workdir, GSM8K / "example_model_solutions.jsonl", "leak", "--models", "6b_finetuning")
    assert p.returncode != 0 and "held-out" in p.stderr + p.stdout and "purpose: eval" in p.stderr + p.stdout
    assert Store(workdir / "store").committed_run("leak", 0, "import") is None


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
    assert Store(workdir / "store").committed_run("bad", 0, "import") is None


# -- imports inside a training experiment: round 0 runs `import`, the PRM, ORM and policy train on them ------

def _arith_rows(seed: int, n: int):
    import random

    rng = random.Random(seed)
    for _ in range(n):
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        yield f"{a}+{b}-{c}", f"{a}+{b}={a + b}\n{a + b}-{c}={a + b - c}\n#### {a + b - c}", a + b - c


@pytest.fixture(scope="module")
def trained_on_imports(prefect_server, tmp_path_factory):
    """A jsonl arithmetic dataset, 10 imported trajectories with given labels (on 5 problems: one right, one
    wrong from step 2 on), and one `coevo` round on a ~20k-parameter model whose config lists the import."""
    from flows.evolution import self_evolution

    from components.config import load_config

    w = tmp_path_factory.mktemp("imports-train")
    train = list(_arith_rows(0, 300))
    test = [r for r in _arith_rows(1, 60) if r[0] not in {q for q, _, _ in train}]
    for name, rows in (("train", train), ("test", test)):
        (w / f"{name}.jsonl").write_text("".join(json.dumps({"question": q, "answer": s}) + "\n" for q, s, _ in rows))
    traj = []
    for i, (q, s, ans) in enumerate(x for x in train[:5] for _ in range(2)):
        if i % 2:  # wrong from step 2 on
            first = s.splitlines()[0]
            s, labels = f"{first}\n{first.split('=')[1]}-0={ans + 1}\n#### {ans + 1}", [1, 0, 0]
        else:
            labels = [1, 1, 1]
        traj.append({"question": q, "completion": s, "correct": not i % 2, "step_labels": labels})
    (w / "mine.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traj))
    config = {
        "experiment": "with-imports", "seed": 0, "rounds": 1, "recipe": "coevo", "workdir": str(w),
        "domain": {"name": "jsonl", "options": {"train": str(w / "train.jsonl"), "test": str(w / "test.jsonl"),
                                                "test_size": 8}},
        "policy": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                            "max_position_embeddings": 128}},
        "bootstrap": {"problems_per_level": 40, "steps": 20, "batch_size": 32, "learning_rate": 3.0e-3},
        "generate": {"problems_per_level": 4, "samples_per_problem": 2, "max_new_tokens": 32},
        "score": {"reward_model": "prm", "mc_rollouts": 2, "mc_max_trajectories": 4, "mc_max_new_tokens": 24},
        "train_reward": {"enabled": True, "steps": 4, "batch_size": 8, "orm": True, "orm_steps": 4},
        "filter": {"max_per_problem": 2},
        "train_policy": {"steps": 4, "epochs": None, "batch_size": 8, "replay_ratio": 100.0},
        "evaluate": {"problems_per_level": 2, "maj_k": 1, "max_new_tokens": 32},
        "curriculum": {"low": 0.0, "high": 1.0, "max_levels": 1},
        "imports": [{"path": str(w / "mine.jsonl"), "correct_field": "correct", "step_labels_field": "step_labels"}],
    }
    path = w / "with-imports.yaml"
    path.write_text(yaml.safe_dump(config))
    self_evolution(config_path=str(path))
    cfg = load_config(path)
    return cfg, Store.for_config(cfg)


def test_round_zero_imports_after_the_bootstrap(trained_on_imports):
    cfg, store = trained_on_imports
    runs = [r["stage"] for r in sorted(store.stage_runs(cfg.experiment), key=lambda r: r["started_at"]) if r["round"] == 0]
    assert runs == ["bootstrap", "import", "evaluate"]
    sel = dict(store.query("SELECT selected, count(*) FROM selections s JOIN trajectory_sources USING (trajectory_id) "
                           "WHERE s.purpose = 'policy_sft' GROUP BY 1")[1])
    assert sel == {True: 5, False: 5}  # the verified-correct ones join round 0's SFT data


def test_the_reward_models_and_the_policy_train_on_the_imports(trained_on_imports):
    cfg, store = trained_on_imports
    uses = dict(store.query(
        "SELECT mi.model_id, count(*) FROM model_inputs mi JOIN trajectory_sources USING (trajectory_id) "
        "GROUP BY 1")[1])
    # The PRM: every imported trajectory with its given step labels; the ORM: all 10 verdicts; the policy:
    # the 5 verified-correct ones, replayed (replay_ratio covers the whole round-0 pool).
    assert uses.get(f"{cfg.experiment}/prm/r1/a1") == 10 and uses.get(f"{cfg.experiment}/orm/r1/a1") == 10
    spec = json.loads(store.committed_run(cfg.experiment, 1, "train_policy")["spec_json"])
    assert any(i["stage"] == "import" and i["round"] == 0 for i in spec["inputs"])
    n_policy = uses.get(f"{cfg.experiment}/policy/r1/a1", 0)
    tp = json.loads(store.committed_run(cfg.experiment, 1, "train_policy")["metrics_json"])
    assert n_policy == (5 if tp["examples"] else 0)
