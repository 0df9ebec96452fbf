"""The store's commit: one transaction per manifest, supersede on rerun, nothing half-written."""

import json
from pathlib import Path

import duckdb
import pytest

from components.manifest import Manifest, ManifestError, StageOutputWriter, verify_manifest
from components.store import StageRunRef, Store, StoreError
from components.tables import to_table


def _traj(i: int, round: int = 1) -> dict:
    return {"trajectory_id": f"t{round}-{i}", "experiment_id": "e", "round": round, "purpose": "train",
            "problem_id": f"p{i}", "level": 1, "policy_model_id": "e/policy/r0", "sample_index": 0,
            "prompt": "1+1\n", "completion": "1+1=2\n#### 2\n", "answer": "2", "num_tokens": 13,
            "finish_reason": "stop", "temperature": 0.8, "top_p": 1.0, "max_new_tokens": 32, "seed": 7}


def _job(tmp: Path, ref: StageRunRef, n: int) -> Path:
    out = StageOutputWriter(tmp / f"r{ref.round}" / ref.stage / f"a{ref.attempt}")
    out.write_table("trajectories", to_table("trajectories", [_traj(i, ref.round) for i in range(n)]))
    m = Manifest(experiment=ref.experiment, round=ref.round, stage=ref.stage, attempt=ref.attempt,
                 config_hash="h", seed=1, code_version=None, inputs={}, metrics={"n": n}, timings={"total_s": 1.0})
    return out.finish(m)


def _start(store: Store, ref: StageRunRef) -> None:
    store.start_stage_run(ref, "dir", "{}", "h", 1)


def _count(store: Store, sql: str) -> int:
    return store.query(sql)[1][0][0]


def test_commit_ingests_and_rerun_supersedes(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    a1 = StageRunRef("e", 1, "generate", 1)
    _start(store, a1)
    store.commit(a1, _job(tmp_path, a1, 5))
    assert _count(store, "SELECT count(*) FROM trajectories") == 5
    a2 = StageRunRef("e", 1, "generate", 2)
    _start(store, a2)
    store.commit(a2, _job(tmp_path, a2, 3))
    # Rows of the superseded attempt are replaced, never duplicated; its stage_run is kept for audit.
    assert _count(store, "SELECT count(*) FROM trajectories") == 3
    statuses = dict(store.query("SELECT stage_run_id, status FROM stage_runs")[1])
    assert statuses == {"e/r1/generate/a1": "superseded", "e/r1/generate/a2": "committed"}
    assert store.committed_run("e", 1, "generate")["attempt"] == 2
    assert store.next_attempt("e", 1, "generate") == 3


def test_corrupt_part_commits_nothing(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    ref = StageRunRef("e", 1, "generate", 1)
    _start(store, ref)
    mpath = _job(tmp_path, ref, 4)
    part = next(mpath.parent.glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256 .* does not match"):
        store.commit(ref, mpath)
    assert _count(store, "SELECT count(*) FROM trajectories") == 0
    assert store.committed_run("e", 1, "generate") is None


def test_manifest_row_count_mismatch_is_refused(tmp_path):
    ref = StageRunRef("e", 1, "generate", 1)
    mpath = _job(tmp_path, ref, 2)
    body = json.loads(mpath.read_text())
    body["outputs"][0]["rows"] = 3
    mpath.write_text(json.dumps(body))
    with pytest.raises(ManifestError, match="has 2 rows, the manifest says 3"):
        verify_manifest(mpath)


def test_failed_insert_rolls_back_everything(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    a1 = StageRunRef("e", 1, "generate", 1)
    _start(store, a1)
    store.commit(a1, _job(tmp_path, a1, 2))
    # A second experiment's job that reuses a trajectory id violates the primary key mid-commit.
    b1 = StageRunRef("e", 1, "verify", 1)
    _start(store, b1)
    out = StageOutputWriter(tmp_path / "r1" / "verify" / "a1")
    out.write_table("trajectories", to_table("trajectories", [_traj(0), _traj(7)]))
    mpath = out.finish(Manifest("e", 1, "verify", 1, "h", 1, None, {}))
    with pytest.raises(StoreError, match="nothing committed"):
        store.commit(b1, mpath)
    assert _count(store, "SELECT count(*) FROM trajectories") == 2
    assert store.committed_run("e", 1, "verify") is None


def test_query_is_read_only(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.init()
    for sql in ["DELETE FROM trajectories", "  insert into problems values (1)", "DROP TABLE models",
                "CREATE TABLE x (a INT)", "ATTACH 'x.db'"]:
        with pytest.raises(StoreError, match="read-only"):
            store.query(sql)
    # Even a write hidden behind a comment or CTE is refused by DuckDB's read-only connection.
    with pytest.raises(StoreError, match="read-only|Cannot execute"):
        store.query("WITH x AS (SELECT 1) DELETE FROM trajectories")
    assert store.query("SELECT count(*) FROM trajectories")[1] == [(0,)]


def test_bad_sql_reports_duckdb_error_with_query(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.init()
    with pytest.raises(StoreError, match=r"(?s)Catalog Error.*nope.*query: SELECT \* FROM nope"):
        store.query("SELECT * FROM nope")


def test_reader_waits_for_the_writer_then_fails_clearly(tmp_path):
    store = Store(tmp_path / "s.duckdb", lock_timeout_s=0.5)
    store.init()
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c",
                               f"import duckdb,time; c=duckdb.connect({str(store.path)!r}); print('x',flush=True); time.sleep(5)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        with pytest.raises(StoreError, match="locked by another process"):
            store.query("SELECT 1")
    finally:
        holder.kill()
        holder.wait()
    assert store.query("SELECT 1")[1] == [(1,)]


def test_attempt_dirs_are_never_overwritten(tmp_path):
    ref = StageRunRef("e", 1, "generate", 1)
    _job(tmp_path, ref, 1)
    with pytest.raises(ManifestError, match="never overwritten"):
        StageOutputWriter(tmp_path / "r1" / "generate" / "a1")


def test_schema_has_the_design_tables(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.init()
    con = duckdb.connect(str(store.path), read_only=True)
    names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    con.close()
    for t in ["experiments", "stage_runs", "problems", "trajectories", "steps", "verifications", "step_labels",
              "scores", "selections", "models", "evaluations", "v_round_summary", "v_trajectory_scores",
              "v_lineage", "v_stage_timings", "v_prm_calibration", "model_inputs"]:
        assert t in names


def test_prm_calibration_view_pairs_step_scores_with_labels(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.init()
    con = duckdb.connect(str(store.path))
    con.execute("INSERT INTO trajectories (trajectory_id, experiment_id, round, purpose, problem_id, level, "
                "sample_index, prompt, completion, num_tokens, stage_run_id) "
                "VALUES ('t', 'e', 1, 'train', 'p', 2, 0, '3+4-2\n', '3+4=7\n7-2=5\n#### 5\n', 12, 'x')")
    con.execute("INSERT INTO scores VALUES ('t', 'prm', 'e/prm/r0', 0, 'step', 0.93, 'x'), "
                "('t', 'prm', 'e/prm/r0', 1, 'step', 0.12, 'x'), ('t', 'prm', 'e/prm/r0', -1, 'min', 0.12, 'x'), "
                "('t', 'prm', 'e/prm/r0', 2, 'step', 1.0, 'x')")
    con.execute("INSERT INTO step_labels VALUES ('t', 0, 'mc_soft', 0.75, 4, 'x'), ('t', 0, 'oracle', 1, NULL, 'x'), "
                "('t', 1, 'mc_soft', 0.25, 4, 'x'), ('t', 1, 'mc_hard', 1, 4, 'x')")
    con.close()
    _, rows = store.query("SELECT step_index, score, score_bin, mc_soft, mc_hard, oracle FROM v_prm_calibration "
                          "ORDER BY step_index")
    assert rows == [(0, 0.93, 9, 0.75, None, 1.0), (1, 0.12, 1, 0.25, 1.0, None), (2, 1.0, 9, None, None, None)]



def test_a_store_from_before_the_bootstrap_stage_names_round_0s_training_bootstrap(tmp_path):
    store = Store(tmp_path / "coevo.duckdb")
    store.start_stage_run(StageRunRef("old", 0, "train_policy", 1), "r0/train_policy/a1", "{}", "h", 0)
    store.start_stage_run(StageRunRef("old", 1, "train_policy", 1), "r1/train_policy/a1", "{}", "h", 0)
    store.init()  # any write connection applies the migration
    got = {(r["round"], r["stage"], r["stage_run_id"]) for r in store.stage_runs("old")}
    assert got == {(0, "bootstrap", "old/r0/train_policy/a1"), (1, "train_policy", "old/r1/train_policy/a1")}
    assert store.next_attempt("old", 0, "bootstrap") == 2
