"""The store's named reads and its single schema declaration, on real DuckDB files written by real commits."""

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from components.compare import CompareError, experiment_rounds, mlflow_experiments
from components.export import ExportError, read_tables
from components.manifest import Manifest, StageOutputWriter
from components.store import SCHEMA, StageRunRef, Store, create_table_sql
from components.tables import DATA_TABLES, PARTS, SCHEMAS, TABLES, to_table


def _model(exp: str, round: int, role: str) -> dict:
    return {"model_id": f"{exp}/{role}/r{round}", "experiment_id": exp, "role": role, "round": round,
            "uri": f"/m/{exp}/{role}/r{round}", "sha256": "abc", "parent_model_id": None, "train_examples": 10 + round,
            "mlflow_run_id": None, "registered_name": None, "registered_version": None}


def _eval(exp: str, round: int, level: int, metric: str, value: float) -> dict:
    return {"experiment_id": exp, "round": round, "model_id": f"{exp}/policy/r{round}", "level": level,
            "metric": metric, "value": value, "n": 8}


def _problem(i: int) -> dict:
    return {"problem_id": f"p{i}", "domain": "arith", "level": 1, "prompt": f"{i}+1", "answer": str(i + 1),
            "meta_json": None, "split": "train"}


def _commit(store: Store, tmp: Path, ref: StageRunRef, tables: dict[str, list[dict]], total_s: float = 1.0) -> None:
    store.start_stage_run(ref, "dir", "{}", "h", 1)
    out = StageOutputWriter(tmp / ref.experiment / f"r{ref.round}" / ref.stage / f"a{ref.attempt}", ref.stage_run_id)
    for name, rows in tables.items():
        out.write_table(name, to_table(name, rows))
    m = Manifest(experiment=ref.experiment, round=ref.round, stage=ref.stage, attempt=ref.attempt, config_hash="h",
                 seed=1, code_version=None, inputs={}, timings={"total_s": total_s})
    store.commit(ref, out.finish(m))


@pytest.fixture
def store(tmp_path) -> Store:
    """Experiment `e`: round 0 trains a policy and evaluates it; round 1 trains policy and PRM, its
    evaluation is rerun (attempt 2 supersedes attempt 1). Experiment `d` has a round 0 policy only."""
    s = Store(tmp_path / "s")
    for exp in ("e", "d"):
        s.register_experiment(exp, "{}", "h", 1, "rft", None)
    _commit(s, tmp_path, StageRunRef("e", 0, "train_policy", 1), {"models": [_model("e", 0, "policy")]}, 2.0)
    _commit(s, tmp_path, StageRunRef("e", 0, "evaluate", 1), {"evaluations": [
        _eval("e", 0, -1, "greedy_acc", 0.5), _eval("e", 0, 1, "greedy_acc", 0.75),
        _eval("e", 0, 2, "greedy_acc", 0.25), _eval("e", 0, 1, "maj_at_4", 0.8)]}, 3.0)
    s.set_round_plan("e", 1, [2, 3], "L1 is solved")
    _commit(s, tmp_path, StageRunRef("e", 1, "train_policy", 1), {"models": [_model("e", 1, "policy")]}, 4.0)
    _commit(s, tmp_path, StageRunRef("e", 1, "train_reward", 1), {"models": [_model("e", 1, "prm")]}, 5.0)
    _commit(s, tmp_path, StageRunRef("e", 1, "evaluate", 1), {"evaluations": [_eval("e", 1, 2, "greedy_acc", 0.1)]})
    _commit(s, tmp_path, StageRunRef("e", 1, "evaluate", 2), {"evaluations": [
        _eval("e", 1, -1, "greedy_acc", 0.6), _eval("e", 1, 2, "greedy_acc", 0.5),
        _eval("e", 1, 3, "greedy_acc", 0.4)]}, 6.0)
    _commit(s, tmp_path, StageRunRef("d", 0, "train_policy", 1), {"models": [_model("d", 0, "policy")]})
    return s


def test_experiments_sorted_and_empty_without_a_store(store, tmp_path):
    assert store.experiments() == ["d", "e"]
    assert Store(tmp_path / "none").experiments() == []


def test_round_plan(store):
    assert store.round_plan("e", 1) == [2, 3]
    assert store.round_plan("e", 2) is None
    assert store.round_plan("d", 1) is None


def test_committed_model_is_the_whole_row_of_a_committed_run(store, tmp_path):
    m = store.committed_model("e", 1)
    assert m == {**_model("e", 1, "policy"), "stage_run_id": "e/r1/train_policy/a1"}
    assert store.committed_model("e", 1, role="prm")["model_id"] == "e/prm/r1"
    assert store.committed_model("e", 0, role="prm") is None
    assert store.committed_model("e", 2) is None
    # A model row whose stage run is not committed (a run still `running`) is not the round's model.
    with store.writer() as con:
        con.execute("INSERT INTO models VALUES ('e/orm/r1', 'e', 'orm', 1, 'u', 's', NULL, 1, NULL, NULL, NULL, "
                    "'e/r1/train_reward/a9')")
        con.execute("INSERT INTO stage_runs (stage_run_id, experiment_id, round, stage, attempt, status) "
                    "VALUES ('e/r1/train_reward/a9', 'e', 1, 'train_reward', 9, 'running')")
    assert store.committed_model("e", 1, role="orm") is None
    assert Store(tmp_path / "none").committed_model("e", 1) is None


def test_level_pass_rates_are_the_committed_greedy_accuracy_per_level(store):
    assert store.level_pass_rates("e", 0) == {1: 0.75, 2: 0.25}  # not level -1, not maj_at_4
    assert store.level_pass_rates("e", 1) == {2: 0.5, 3: 0.4}  # attempt 2's, not the superseded attempt 1's
    assert store.level_pass_rates("e", 2) == {}
    assert all(type(k) is int and type(v) is float for k, v in store.level_pass_rates("e", 0).items())


def _sample(i: int, problem: int, level: int, purpose: str = "train") -> dict:
    return {name: None for name in SCHEMAS["trajectories"].names if name != "stage_run_id"} | {
        "trajectory_id": f"t{i}", "experiment_id": "e", "round": 1, "purpose": purpose, "problem_id": f"p{problem}",
        "level": level, "sample_index": i, "prompt": "q", "completion": "c", "num_tokens": 3}


def _verdict(i: int, correct: bool | None) -> dict:
    return {"trajectory_id": f"t{i}", "verifier": "v", "verifier_version": "1", "correct": correct, "reward": None,
            "detail": None}


def test_level_solved_shares_count_problems_a_sample_got_right_by_the_committed_verdicts(store, tmp_path):
    samples = [_sample(0, 0, 2), _sample(1, 0, 2), _sample(2, 1, 2), _sample(3, 2, 3)]
    _commit(store, tmp_path, StageRunRef("e", 1, "generate", 1), {"trajectories": samples})
    _commit(store, tmp_path, StageRunRef("e", 1, "verify", 1), {"verifications": [_verdict(i, True) for i in range(4)]})
    assert store.level_solved_shares("e", 1) == {2: 1.0, 3: 1.0}
    # A rerun of verify supersedes the first verdicts: p0 is solved by its second sample alone, p2 not at all.
    _commit(store, tmp_path, StageRunRef("e", 1, "verify", 2),
            {"verifications": [_verdict(0, False), _verdict(1, True), _verdict(2, False), _verdict(3, None)]})
    assert store.level_solved_shares("e", 1) == {2: 0.5, 3: 0.0}
    # Verdicts and samples of an attempt that is not committed (one still running) are not the round's.
    with store.writer() as con:
        con.execute("INSERT INTO stage_runs (stage_run_id, experiment_id, round, stage, attempt, status) VALUES "
                    "('e/r1/verify/a9', 'e', 1, 'verify', 9, 'running'), "
                    "('e/r1/generate/a9', 'e', 1, 'generate', 9, 'running')")
        con.execute("INSERT INTO verifications (trajectory_id, verifier, verifier_version, correct, stage_run_id) "
                    "VALUES ('t2', 'v2', '1', true, 'e/r1/verify/a9')")
        con.execute("INSERT INTO trajectories (trajectory_id, experiment_id, round, purpose, problem_id, level, "
                    "sample_index, prompt, completion, num_tokens, stage_run_id) "
                    "VALUES ('t8', 'e', 1, 'train', 'p8', 4, 0, 'q', 'c', 3, 'e/r1/generate/a9')")
    assert store.level_solved_shares("e", 1) == {2: 0.5, 3: 0.0}
    # Nor are the evaluation's trajectories samples.
    _commit(store, tmp_path, StageRunRef("e", 1, "evaluate", 3), {"trajectories": [_sample(9, 5, 4, "eval")]})
    assert store.level_solved_shares("e", 1) == {2: 0.5, 3: 0.0}
    assert store.level_solved_shares("e", 0) == {} and Store(tmp_path / "none").level_solved_shares("e", 1) == {}


def test_evaluations_ordered_by_round_level_metric(store):
    rows = store.evaluations("e")
    assert [(r["round"], r["level"], r["metric"]) for r in rows] == [
        (0, -1, "greedy_acc"), (0, 1, "greedy_acc"), (0, 1, "maj_at_4"), (0, 2, "greedy_acc"),
        (1, -1, "greedy_acc"), (1, 2, "greedy_acc"), (1, 3, "greedy_acc")]
    assert set(rows[0]) == set(TABLES["evaluations"].names)
    assert store.evaluations("d") == []


def test_round_summary_one_round_or_all(store):
    all_rounds = store.round_summary("e")
    assert [r["round"] for r in all_rounds] == [0, 1]
    assert [r["greedy_acc"] for r in all_rounds] == [0.5, 0.6]
    one = store.round_summary("e", 1)
    assert one == [all_rounds[1]]
    assert one[0]["curriculum_levels"] == "[2, 3]"
    assert store.round_summary("e", 5) == []
    assert store.round_summary("d") == []  # no evaluation, no summary row


def test_stage_timings_of_committed_runs_in_start_order(store):
    assert store.stage_timings("e", 1) == [{"stage": "train_policy", "duration_s": 4.0},
                                           {"stage": "train_reward", "duration_s": 5.0},
                                           {"stage": "evaluate", "duration_s": 6.0}]
    assert store.stage_timings("e", 3) == []


def test_round_models_one_row_per_role(store):
    assert store.round_models("e", 1) == [
        {"model_id": "e/policy/r1", "role": "policy", "uri": "/m/e/policy/r1", "stage_run_id": "e/r1/train_policy/a1",
         "train_examples": 11},
        {"model_id": "e/prm/r1", "role": "prm", "uri": "/m/e/prm/r1", "stage_run_id": "e/r1/train_reward/a1",
         "train_examples": 11}]
    assert store.round_models("d", 1) == []


def test_reads_of_a_missing_store_are_empty(tmp_path):
    s = Store(tmp_path / "none")
    assert (s.round_plan("e", 1), s.level_pass_rates("e", 0), s.evaluations("e"), s.round_summary("e"),
            s.stage_timings("e", 0), s.round_models("e", 0)) == (None, {}, [], [], [], [])
    assert not s.path.exists()  # reading never creates the file


# -- one schema declaration -------------------------------------------------------------------------

def test_store_tables_are_the_declared_tables(tmp_path):
    s = Store(tmp_path / "s")
    s.init()
    duck = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE", "bool": "BOOLEAN",
            "timestamp[us]": "TIMESTAMP", "list<item: int32>": "INTEGER[]"}
    with s.reader() as con:
        for name, t in TABLES.items():
            got = [(r[0], r[1], r[2] == "YES") for r in con.execute(f"DESCRIBE {name}").fetchall()]
            # DuckLake has no PRIMARY KEY: key columns are NOT NULL, and commits check the keys they add.
            assert got == [(c.name, duck[str(c.type)], c.nullable and c.name not in t.key) for c in t.columns], name
    assert SCHEMA.count("CREATE TABLE") == len(TABLES) + 1  # and coevo_meta


def test_job_schemas_are_the_declared_columns_without_stage_run_id_and_parts_add_it():
    assert tuple(SCHEMAS) == tuple(PARTS) == DATA_TABLES
    for name in DATA_TABLES:
        assert SCHEMAS[name].names == [c for c in TABLES[name].names if c != "stage_run_id"]
        assert [f.type for f in SCHEMAS[name]] == [c.type for c in TABLES[name].columns if c.name != "stage_run_id"]
        assert all(f.nullable for f in SCHEMAS[name])
        extra = [pa.field("stage_run_id", pa.string())] if "stage_run_id" in TABLES[name].names else []
        assert list(PARTS[name]) == [*SCHEMAS[name], *extra], name


def test_commits_keep_every_declared_key_unique(tmp_path):
    # DuckLake enforces no PRIMARY KEY: the commit checks the keys it adds, against the table and within the part.
    from components.store import StoreError

    assert "PRIMARY KEY" not in SCHEMA
    s = Store(tmp_path / "s")
    _commit(s, tmp_path, StageRunRef("e", 1, "evaluate", 1), {"evaluations": [_eval("e", 1, -1, "greedy_acc", 0.5)]})
    with pytest.raises(StoreError, match=r"duplicate key \(experiment_id, round, level, metric\).*evaluations"):
        _commit(s, tmp_path, StageRunRef("e", 1, "train_policy", 1), {"evaluations": [_eval("e", 1, -1, "greedy_acc", 0.7)]})
    with pytest.raises(StoreError, match=r"duplicate key \(model_id\).*models"):
        _commit(s, tmp_path, StageRunRef("e", 2, "train_policy", 1), {"models": [_model("e", 2, "policy")] * 2})
    assert s.query("SELECT count(*) FROM evaluations")[1] == [(1,)] and s.query("SELECT count(*) FROM models")[1] == [(0,)]
    assert s.committed_run("e", 1, "train_policy") is None and s.committed_run("e", 2, "train_policy") is None


def test_a_commit_holds_its_rows_to_its_own_round_and_checks_keys_there(tmp_path):
    # The key check reads only the round's own files, which is sound because every row must belong to the
    # committing attempt's round: through its trajectory, its model or its columns. A row that does not is refused.
    from components.store import StoreError

    s = Store(tmp_path / "s")
    traj = {"trajectory_id": "t1", "experiment_id": "e", "round": 1, "purpose": "train", "problem_id": "p0",
            "level": 1, "policy_model_id": None, "sample_index": 0, "prompt": "1+1", "completion": "2",
            "answer": "2", "num_tokens": 1, "finish_reason": "stop", "temperature": 1.0, "top_p": 1.0,
            "max_new_tokens": 8, "seed": 1, "token_ids": None}
    step = {"trajectory_id": "t1", "step_index": 0, "text": "2"}
    _commit(s, tmp_path, StageRunRef("e", 1, "generate", 1), {"trajectories": [traj], "steps": [step]})
    verdict = {"trajectory_id": "t1", "verifier": "exact", "verifier_version": "1", "correct": True, "reward": 1.0,
               "detail": None}
    with pytest.raises(StoreError, match=r"verifications: every row of e/r2/verify/a1 must belong to experiment "
                                         r"'e', round 2; trajectory_id 't1' is not one of its trajectories"):
        _commit(s, tmp_path, StageRunRef("e", 2, "verify", 1), {"verifications": [verdict]})
    with pytest.raises(StoreError, match=r"model_inputs: .* model_id 'e/policy/r1' is not one of its models"):
        _commit(s, tmp_path, StageRunRef("e", 2, "train_policy", 1), {"model_inputs": [
            {"model_id": "e/policy/r1", "trajectory_id": "t1", "source_round": 1, "use": "new"}]})
    with pytest.raises(StoreError, match=r"evaluations: .* a row names \('e', 1\)"):
        _commit(s, tmp_path, StageRunRef("e", 2, "evaluate", 1), {"evaluations": [_eval("e", 1, -1, "greedy_acc", 1)]})
    _commit(s, tmp_path, StageRunRef("e", 1, "verify", 1), {"verifications": [verdict]})
    with pytest.raises(StoreError, match=r"duplicate key \(trajectory_id, step_index\) = \('t1', 0\) in steps"):
        _commit(s, tmp_path, StageRunRef("e", 1, "score", 1), {"steps": [step]})  # another stage of the round
    assert s.query("SELECT count(*) FROM verifications")[1] == [(1,)] and s.query("SELECT count(*) FROM steps")[1] == [(1,)]


def test_problems_are_shared_across_attempts(tmp_path):
    # Problems carry no stage_run_id: a rerun adds new problems and keeps the ones already drawn.
    s = Store(tmp_path / "s")
    _commit(s, tmp_path, StageRunRef("e", 1, "generate", 1), {"problems": [_problem(0), _problem(1)]})
    _commit(s, tmp_path, StageRunRef("e", 1, "generate", 2), {"problems": [_problem(1), _problem(2)]})
    assert [r[0] for r in s.query("SELECT problem_id FROM problems ORDER BY 1")[1]] == ["p0", "p1", "p2"]


# -- the callers: export by store, compare by MLflow --------------------------------------------------

def test_export_reads_known_experiments_from_the_store(store):
    tables = read_tables(store, "e")
    assert tables["evaluations"].num_rows == 7 and tables["models"].num_rows == 3
    with pytest.raises(ExportError, match="unknown experiment 'x'.*known: d, e"):
        read_tables(store, "x")


def test_mlflow_experiments_lists_experiments_with_a_parent_run(tmp_path):
    """On MLflow's real SQLite store, runs tagged as the tracker tags them."""
    from mlflow.tracking import MlflowClient

    from components.tracking import TAG_EXPERIMENT, TAG_ROUND

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert mlflow_experiments(client) == []
    for experiment, round, metrics in (("b", "all", {}), ("a", "all", {}), ("a", "1", {"evaluate/greedy_acc": 0.5})):
        exp = client.get_experiment_by_name(experiment) or client.get_experiment(client.create_experiment(experiment))
        run = client.create_run(exp.experiment_id, tags={TAG_EXPERIMENT: experiment, TAG_ROUND: round})
        for k, v in metrics.items():
            client.log_metric(run.info.run_id, k, v)
    assert mlflow_experiments(client) == ["a", "b"]
    with pytest.raises(CompareError, match="unknown experiment 'z' in MLflow; known: a, b"):
        experiment_rounds(client, "z", "evaluate/greedy_acc")
    assert experiment_rounds(client, "a", "evaluate/greedy_acc").values == {"all": {1: 0.5}}
