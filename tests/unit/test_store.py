"""The store's commit: one transaction per manifest, supersede on rerun, nothing half-written."""

import json
import re
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from components.manifest import Manifest, ManifestError, StageOutputWriter, sha256_file, verify_manifest
from components.store import StageRunRef, Store, StoreError
from components.tables import to_table


def _traj(i: int, round: int = 1) -> dict:
    return {"trajectory_id": f"t{round}-{i}", "experiment_id": "e", "round": round, "purpose": "train",
            "problem_id": f"p{i}", "level": 1, "policy_model_id": "e/policy/r0", "sample_index": 0,
            "prompt": "1+1\n", "completion": "1+1=2\n#### 2\n", "answer": "2", "num_tokens": 13,
            "finish_reason": "stop", "temperature": 0.8, "top_p": 1.0, "max_new_tokens": 32, "seed": 7,
            "token_ids": None}


def _job(tmp: Path, ref: StageRunRef, n: int) -> Path:
    out = StageOutputWriter(tmp / f"r{ref.round}" / ref.stage / f"a{ref.attempt}", ref.stage_run_id)
    out.write_table("trajectories", to_table("trajectories", [_traj(i, ref.round) for i in range(n)]))
    m = Manifest(experiment=ref.experiment, round=ref.round, stage=ref.stage, attempt=ref.attempt,
                 config_hash="h", seed=1, code_version=None, inputs={}, metrics={"n": n}, timings={"total_s": 1.0})
    return out.finish(m)


def _start(store: Store, ref: StageRunRef) -> None:
    store.start_stage_run(ref, "dir", "{}", "h", 1)


def _count(store: Store, sql: str) -> int:
    return store.query(sql)[1][0][0]


def test_commit_ingests_and_rerun_supersedes(tmp_path):
    store = Store(tmp_path / "s")
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
    a3 = StageRunRef("e", 1, "generate", 3)  # a rerun of the rerun: only a2 is committed, a1 stays superseded
    _start(store, a3)
    store.commit(a3, _job(tmp_path, a3, 4))
    assert _count(store, "SELECT count(*) FROM trajectories WHERE stage_run_id = 'e/r1/generate/a3'") == 4
    assert _count(store, "SELECT count(*) FROM trajectories") == 4
    assert sorted(store.query("SELECT status, count(*) FROM stage_runs GROUP BY ALL")[1]) == [
        ("committed", 1), ("superseded", 2)]


def test_a_commit_of_an_attempt_never_started_is_refused_with_nothing_written(tmp_path):
    store = Store(tmp_path / "s")
    a1 = StageRunRef("e", 1, "generate", 1)
    _commit(store, tmp_path, a1, n=2)
    files = sorted((tmp_path / "s" / "data").rglob("*.parquet"))
    b1 = StageRunRef("e", 2, "generate", 1)
    with pytest.raises(StoreError, match="stage run e/r2/generate/a1 was never started"):
        store.commit(b1, _job(tmp_path, b1, 3))
    assert _count(store, "SELECT count(*) FROM trajectories") == 2
    assert sorted((tmp_path / "s" / "data").rglob("*.parquet")) == files  # its copies removed


def _commit(store: Store, tmp: Path, ref: StageRunRef, n: int = 0, later: tuple[str, ...] = ()) -> None:
    _start(store, ref)
    store.commit(ref, _job(tmp, ref, n), later_stages=later)


def _stale(store: Store) -> set[str]:
    return {r[0] for r in store.query("SELECT stage_run_id FROM stage_runs WHERE stale AND status = 'committed'")[1]}


def test_a_rerun_marks_what_the_old_attempt_fed_stale_in_its_own_commit(tmp_path):
    store = Store(tmp_path / "s")
    for round, stage in [(0, "bootstrap"), (1, "generate"), (1, "verify"), (1, "evaluate"), (2, "generate")]:
        _commit(store, tmp_path, StageRunRef("e", round, stage, 1), later=("evaluate",) if stage == "verify" else ())
    _commit(store, tmp_path / "other", StageRunRef("other", 2, "generate", 1))
    assert _stale(store) == set(), "a first commit supersedes nothing and marks nothing"
    _commit(store, tmp_path, StageRunRef("e", 1, "verify", 2), later=("evaluate",))
    # The round's later stages and every later round; not earlier stages, round 0, or another experiment.
    assert _stale(store) == {"e/r1/evaluate/a1", "e/r2/generate/a1"}
    assert store.stale_stages("e", 2) == ["generate"] and store.stale_stages("e", 1) == ["evaluate"]
    # Recomputing a stale stage clears its own mark.
    _commit(store, tmp_path, StageRunRef("e", 1, "evaluate", 2))
    assert _stale(store) == {"e/r2/generate/a1"}


def test_a_rerun_whose_commit_fails_marks_nothing_stale(tmp_path):
    store = Store(tmp_path / "s")
    _commit(store, tmp_path, StageRunRef("e", 1, "generate", 1), n=2)
    _commit(store, tmp_path, StageRunRef("e", 2, "generate", 1), n=2)
    a2 = StageRunRef("e", 1, "generate", 2)
    _start(store, a2)
    out = StageOutputWriter(tmp_path / "r1" / "generate" / "a2", a2.stage_run_id)
    out.write_table("trajectories", to_table("trajectories", [_traj(0), _traj(0)]))  # a duplicate key mid-commit
    with pytest.raises(StoreError, match="nothing committed"):
        store.commit(a2, out.finish(Manifest("e", 1, "generate", 2, "h", 1, None, {})), later_stages=("verify",))
    assert _stale(store) == set()
    assert store.committed_run("e", 1, "generate")["attempt"] == 1


def test_content_hashes_read_model_ids_without_their_attempt(tmp_path):
    store = Store(tmp_path / "s")
    a1 = StageRunRef("e", 1, "generate", 1)
    _commit(store, tmp_path, a1, n=2)
    before = store.table_hashes("e")
    with store.writer() as con:  # the same rows, as a rerun's attempt would have sampled them
        con.execute("UPDATE trajectories SET policy_model_id = 'e/policy/r0/a3'")
    assert store.table_hashes("e") == before
    with store.writer() as con:
        con.execute("UPDATE trajectories SET policy_model_id = 'e/policy/r1/a3'")
    assert store.table_hashes("e")["trajectories"] != before["trajectories"]


def test_corrupt_part_commits_nothing(tmp_path):
    store = Store(tmp_path / "s")
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
    store = Store(tmp_path / "s")
    a1 = StageRunRef("e", 1, "generate", 1)
    _start(store, a1)
    store.commit(a1, _job(tmp_path, a1, 2))
    # A second experiment's job that reuses a trajectory id violates the primary key mid-commit.
    b1 = StageRunRef("e", 1, "verify", 1)
    _start(store, b1)
    out = StageOutputWriter(tmp_path / "r1" / "verify" / "a1", b1.stage_run_id)
    out.write_table("trajectories", to_table("trajectories", [_traj(0), _traj(7)]))
    mpath = out.finish(Manifest("e", 1, "verify", 1, "h", 1, None, {}))
    with pytest.raises(StoreError, match="nothing committed"):
        store.commit(b1, mpath)
    assert _count(store, "SELECT count(*) FROM trajectories") == 2
    assert store.committed_run("e", 1, "verify") is None


def _files(store: Store, table: str) -> list[Path]:
    return sorted((store.path / "data" / "main" / table).glob("*.parquet"))


def test_a_part_is_taken_in_as_its_own_file_and_a_failed_commit_leaves_no_copy(tmp_path):
    store = Store(tmp_path / "s")
    a1 = StageRunRef("e", 1, "generate", 1)
    _start(store, a1)
    mpath = _job(tmp_path, a1, 3)
    store.commit(a1, mpath)
    # The store's file is the job's part byte for byte: copied, not rewritten, with its attempt's id in it.
    (kept,) = _files(store, "trajectories")
    assert kept.name.startswith("coevo-") and kept.read_bytes() == next(mpath.parent.glob("part-*")).read_bytes()
    assert store.query("SELECT DISTINCT stage_run_id, count(*) OVER () FROM trajectories")[1] == [(a1.stage_run_id, 3)]
    # A job of two parts whose second repeats a key of the first: the first was copied in, then the commit failed.
    b1 = StageRunRef("e", 2, "generate", 1)
    _start(store, b1)
    out = StageOutputWriter(tmp_path / "r2" / "generate" / "a1", b1.stage_run_id)
    out.write_table("trajectories", to_table("trajectories", [_traj(0, 2), _traj(1, 2)]))
    out.write_table("trajectories", to_table("trajectories", [_traj(1, 2)]))
    with pytest.raises(StoreError, match=r"duplicate key \(trajectory_id\) = \('t2-1',\)"):
        store.commit(b1, out.finish(Manifest("e", 2, "generate", 1, "h", 1, None, {})))
    assert _files(store, "trajectories") == [kept] and _count(store, "SELECT count(*) FROM trajectories") == 3


def test_a_part_of_an_older_coevo_is_rewritten_with_its_attempt(tmp_path):
    store = Store(tmp_path / "s")
    ref = StageRunRef("e", 1, "generate", 1)
    _start(store, ref)
    out = StageOutputWriter(tmp_path / "old", ref.stage_run_id)
    part = out.tmp_dir / "part-trajectories-00000.parquet"  # as the writer wrote it before parts named their attempt
    pq.write_table(to_table("trajectories", [_traj(0), _traj(1)]), part, compression="zstd")
    out.add_part("trajectories", out.final_dir / part.name, 2, sha256_file(part))
    store.commit(ref, out.finish(Manifest("e", 1, "generate", 1, "h", 1, None, {})))
    assert store.query("SELECT stage_run_id, count(*) FROM trajectories GROUP BY 1")[1] == [(ref.stage_run_id, 2)]
    # Rewritten: two rows, which DuckLake keeps in its catalog (data inlining), where a copied part would be a file
    assert _files(store, "trajectories") == []


def test_a_part_that_names_another_attempt_is_refused(tmp_path):
    store = Store(tmp_path / "s")
    ref = StageRunRef("e", 1, "generate", 1)
    _start(store, ref)
    out = StageOutputWriter(tmp_path / "r1" / "generate" / "a1", "e/r1/generate/a9")
    out.write_table("trajectories", to_table("trajectories", [_traj(0)]))
    mpath = out.finish(Manifest("e", 1, "generate", 1, "h", 1, None, {}))
    with pytest.raises(ManifestError, match="its rows name attempt 'e/r1/generate/a9', but it is committed as "
                                            "'e/r1/generate/a1'"):
        store.commit(ref, mpath)
    assert _count(store, "SELECT count(*) FROM trajectories") == 0 and _files(store, "trajectories") == []


def test_a_null_in_a_not_null_column_is_refused_as_by_an_insert(tmp_path):
    # A file added to a DuckLake is not checked for NOT NULL: such a part goes through INSERT, which is.
    store = Store(tmp_path / "s")
    ref = StageRunRef("e", 1, "generate", 1)
    _start(store, ref)
    out = StageOutputWriter(tmp_path / "r1" / "generate" / "a1", ref.stage_run_id)
    out.write_table("trajectories", to_table("trajectories", [_traj(0), _traj(1) | {"experiment_id": None}]))
    with pytest.raises(StoreError, match="NOT NULL constraint failed: trajectories.experiment_id"):
        store.commit(ref, out.finish(Manifest("e", 1, "generate", 1, "h", 1, None, {})))
    assert _count(store, "SELECT count(*) FROM trajectories") == 0 and _files(store, "trajectories") == []


def test_query_is_read_only(tmp_path):
    store = Store(tmp_path / "s")
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
    store = Store(tmp_path / "s")
    store.init()
    with pytest.raises(StoreError, match=r"(?s)Catalog Error.*nope.*query: SELECT \* FROM nope"):
        store.query("SELECT * FROM nope")


HOLDER = """
import sys, time
from components.store import Store
with Store(sys.argv[1]).reader() as con:
    con.execute("BEGIN TRANSACTION")
    print(con.execute("SELECT count(*) FROM trajectories").fetchone()[0], flush=True)
    sys.stdin.readline()  # the commit is done
    print(con.execute("SELECT count(*) FROM trajectories").fetchone()[0], flush=True)
    con.execute("COMMIT")
"""


def test_a_reader_holding_a_transaction_never_delays_a_commit_and_keeps_its_snapshot(tmp_path):
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    store = Store(tmp_path / "s", lock_timeout_s=0.5)
    a1 = StageRunRef("e", 1, "generate", 1)
    _commit(store, tmp_path, a1, n=5)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store.path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "5"  # its transaction is open
        b1 = StageRunRef("e", 2, "generate", 1)
        _start(store, b1)
        t0 = time.perf_counter()
        store.commit(b1, _job(tmp_path, b1, 7))
        took = time.perf_counter() - t0
        assert _count(store, "SELECT count(*) FROM trajectories") == 12  # a new reader sees the commit
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "5", "the open reader keeps the snapshot it started on"
    finally:
        holder.kill()
        holder.wait()
    assert took < 1.0, f"the commit waited {took:.2f}s for a reader"


def test_a_commit_leaves_a_core_to_the_readers(tmp_path, monkeypatch):
    """A writer's connection takes one DuckDB thread fewer than the process may use (at least one); a reader keeps
    DuckDB's default."""
    import os

    from components.store import writer_threads

    store = Store(tmp_path / "s")
    store.init()
    for cores, want in ((2, 1), (1, 1), (16, 15)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert writer_threads() == want
        with store.writer() as con:
            assert con.execute("SELECT current_setting('threads')").fetchone()[0] == want
    monkeypatch.undo()
    default = duckdb.connect().execute("SELECT current_setting('threads')").fetchone()[0]
    assert store.query("SELECT current_setting('threads')")[1] == [(default,)]


def test_attempt_dirs_are_never_overwritten(tmp_path):
    ref = StageRunRef("e", 1, "generate", 1)
    _job(tmp_path, ref, 1)
    with pytest.raises(ManifestError, match="never overwritten"):
        StageOutputWriter(tmp_path / "r1" / "generate" / "a1", ref.stage_run_id)


def test_schema_has_the_design_tables(tmp_path):
    store = Store(tmp_path / "s")
    store.init()
    names = {r[0] for r in store.query("SELECT table_name FROM information_schema.tables")[1]}
    for t in ["experiments", "stage_runs", "problems", "trajectories", "steps", "verifications", "step_labels",
              "scores", "selections", "models", "evaluations", "v_round_summary", "v_trajectory_scores",
              "v_lineage", "v_stage_timings", "v_prm_calibration", "model_inputs"]:
        assert t in names


def test_prm_calibration_view_pairs_step_scores_with_labels(tmp_path):
    store = Store(tmp_path / "s")
    store.init()
    with store.writer() as con:
        _calibration_rows(con)
    _, rows = store.query("SELECT step_index, score, score_bin, mc_soft, mc_hard, oracle FROM v_prm_calibration "
                          "ORDER BY step_index")
    assert rows == [(0, 0.93, 9, 0.75, None, 1.0), (1, 0.12, 1, 0.25, 1.0, None), (2, 1.0, 9, None, None, None)]


def _calibration_rows(con) -> None:
    con.execute("INSERT INTO trajectories (trajectory_id, experiment_id, round, purpose, problem_id, level, "
                "sample_index, prompt, completion, num_tokens, stage_run_id) "
                "VALUES ('t', 'e', 1, 'train', 'p', 2, 0, '3+4-2\n', '3+4=7\n7-2=5\n#### 5\n', 12, 'x')")
    con.execute("INSERT INTO scores VALUES ('t', 'prm', 'e/prm/r0', 0, 'step', 0.93, 'x'), "
                "('t', 'prm', 'e/prm/r0', 1, 'step', 0.12, 'x'), ('t', 'prm', 'e/prm/r0', -1, 'min', 0.12, 'x'), "
                "('t', 'prm', 'e/prm/r0', 2, 'step', 1.0, 'x')")
    con.execute("INSERT INTO step_labels VALUES ('t', 0, 'mc_soft', 0.75, 4, 'x'), ('t', 0, 'oracle', 1, NULL, 'x'), "
                "('t', 1, 'mc_soft', 0.25, 4, 'x'), ('t', 1, 'mc_hard', 1, 4, 'x')")


def test_round_summary_pass_rate_counts_the_train_trajectories_of_every_stage_that_verified_them(tmp_path):
    """`v_round_summary` counts `verify`'s verifications by stage run and joins only the other stages' to their
    trajectories: the rate must be the one every verification of a train trajectory gives, whichever stage wrote
    it (here verify, an import of train and eval trajectories, and evaluate)."""
    store = Store(tmp_path / "s")
    store.init()
    runs = {"e/r1/generate/a1": "generate", "e/r1/verify/a1": "verify", "e/r1/import/a1": "import",
            "e/r1/evaluate/a1": "evaluate", "e/r2/verify/a1": "verify", "e/r2/evaluate/a1": "evaluate"}
    trajectories = [  # (id, round, purpose, the stage run that wrote it, its verification's stage run, correct)
        *[(f"g{i}", 1, "train", "e/r1/generate/a1", "e/r1/verify/a1", i % 3 == 0) for i in range(6)],
        ("g6", 1, "train", "e/r1/generate/a1", "e/r1/verify/a1", None),  # a verifier that did not apply: wrong
        *[(f"i{i}", 1, "train", "e/r1/import/a1", "e/r1/import/a1", True) for i in range(3)],
        *[(f"j{i}", 1, "eval", "e/r1/import/a1", "e/r1/import/a1", False) for i in range(4)],
        *[(f"v{i}", 1, "eval", "e/r1/evaluate/a1", "e/r1/evaluate/a1", True) for i in range(5)],
        *[(f"h{i}", 2, "train", "e/r2/generate/a1", "e/r2/verify/a1", i < 3) for i in range(4)],
        *[(f"w{i}", 2, "eval", "e/r2/evaluate/a1", "e/r2/evaluate/a1", False) for i in range(2)],
    ]
    with store.writer() as con:
        for run, stage in runs.items():
            con.execute("INSERT INTO stage_runs (stage_run_id, experiment_id, round, stage, attempt, status) "
                        "VALUES (?, 'e', ?, ?, 1, 'committed')", [run, int(run[3]), stage])
        for tid, rnd, purpose, wrote, verified, correct in trajectories:
            con.execute("INSERT INTO trajectories (trajectory_id, experiment_id, round, purpose, problem_id, level, "
                        "sample_index, prompt, completion, num_tokens, stage_run_id) "
                        "VALUES (?, 'e', ?, ?, 'p', 1, 0, 'q', 'a', 3, ?)", [tid, rnd, purpose, wrote])
            con.execute("INSERT INTO verifications VALUES (?, 'oracle', '1', ?, 0.0, NULL, ?)", [tid, correct, verified])
        for rnd in (1, 2):
            con.execute("INSERT INTO evaluations VALUES ('e', ?, 'm', -1, 'greedy_acc', 0.5, 10, ?)",
                        [rnd, f"e/r{rnd}/evaluate/a1"])
    rates = dict(store.query("SELECT round, train_pass_rate FROM v_round_summary ORDER BY round")[1])
    reference = dict(store.query(
        "SELECT t.round, avg(CASE WHEN v.correct THEN 1.0 ELSE 0.0 END) FROM trajectories t "
        "JOIN verifications v USING (trajectory_id) WHERE t.purpose = 'train' GROUP BY ALL")[1])
    assert reference == pytest.approx({1: 5 / 10, 2: 3 / 4})  # r1: 2 of verify's 7 right, 3 of 3 imported
    assert rates == pytest.approx(reference, abs=1e-12)


def _legacy_store(workdir: Path) -> Path:
    """A single-file store as coevo wrote them before the DuckLake: tables in `coevo.duckdb`, round 0's
    training still recorded as `train_policy` (older still), and a few rows."""
    from components.store import TABLES, VIEWS, create_table_sql

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "coevo.duckdb"
    with duckdb.connect(str(path)) as con:
        for t in TABLES.values():
            con.execute(create_table_sql(t))
        con.execute(VIEWS)
        for round in (0, 1):
            con.execute("INSERT INTO stage_runs (stage_run_id, experiment_id, round, stage, attempt, status) "
                        "VALUES (?, 'old', ?, 'train_policy', 1, 'committed')", [f"old/r{round}/train_policy/a1", round])
        _calibration_rows(con)
    return path


def test_a_store_of_an_older_coevo_is_read_as_it_is_then_migrated_by_the_first_writer(tmp_path):
    legacy = _legacy_store(tmp_path)
    store = Store(tmp_path / "store")
    calibration = "SELECT step_index, score, mc_soft FROM v_prm_calibration ORDER BY step_index"
    assert store.legacy == legacy
    assert store.query("SELECT count(*) FROM trajectories")[1] == [(1,)]  # read as it is, nothing written
    assert not store.location.exists() and legacy.is_file()
    with pytest.raises(StoreError, match="predates snapshots"):
        store.query("SELECT 1", as_of="old/r1")
    with pytest.raises(StoreError, match="refused: COPY"):  # the same guard
        store.query(f"COPY trajectories TO '{tmp_path / 'x.csv'}'")
    before = store.query(calibration)[1]
    store.init()  # the first writer migrates it
    assert store.legacy is None and not legacy.exists() and legacy.with_name("coevo.duckdb.migrated").is_file()
    assert store.query(calibration)[1] == before == [(0, 0.93, 0.75), (1, 0.12, 0.25), (2, 1.0, None)]
    # Stores written before round 0's bootstrap was a stage of its own recorded it as round 0's train_policy.
    got = {(r["round"], r["stage"], r["stage_run_id"]) for r in store.stage_runs("old")}
    assert got == {(0, "bootstrap", "old/r0/train_policy/a1"), (1, "train_policy", "old/r1/train_policy/a1")}
    assert store.next_attempt("old", 0, "bootstrap") == 2


def test_a_store_made_by_a_newer_coevo_is_refused(tmp_path):
    store = Store(tmp_path / "s")
    _commit(store, tmp_path, StageRunRef("e", 1, "generate", 1), n=2)
    with store.writer() as con:
        con.execute("UPDATE coevo_meta SET value = '99' WHERE key = 'schema_version'")
    for read in (lambda s: s.query("SELECT 1"), lambda s: s.init()):
        with pytest.raises(StoreError, match="schema version 99, made by a newer coevo"):
            read(Store(tmp_path / "s"))


def test_as_of_reads_the_store_as_each_committed_attempt_left_it(tmp_path):
    store = Store(tmp_path / "s")
    count = "SELECT count(*) FROM trajectories"
    _commit(store, tmp_path, StageRunRef("e", 1, "generate", 1), n=3)
    _commit(store, tmp_path, StageRunRef("e", 1, "generate", 2), n=4, later=("verify",))  # a rerun: 4 replace 3
    _commit(store, tmp_path, StageRunRef("e", 1, "verify", 1))
    _commit(store, tmp_path, StageRunRef("e", 2, "generate", 1), n=5)
    assert store.query(count)[1] == [(9,)]
    assert store.query(count, as_of="e/r1")[1] == [(4,)]  # after round 1's last live stage
    assert store.query(count, as_of="e/r1/generate")[1] == [(4,)]  # the live attempt's commit
    assert store.query(count, as_of="e/r1/generate/a1")[1] == [(3,)]  # a superseded attempt's
    assert store.query("SELECT status FROM stage_runs WHERE stage_run_id = 'e/r1/generate/a1'",
                       as_of="e/r1/generate/a1")[1] == [("committed",)]  # as it stood then
    assert store.query(count, as_of="e/r2/generate")[1] == [(9,)]
    view = store.at("e/r1/generate/a1")  # every read of it at that snapshot: what verify-reproducible reads
    assert view.query(count)[1] == [(3,)] and view.committed_run("e", 1, "generate")["attempt"] == 1
    assert view.committed_run("e", 1, "verify") is None and store.committed_run("e", 1, "verify") is not None
    with pytest.raises(StoreError, match="read only"):
        view.fail_dangling_runs("e")
    for point, message in [("e/r7", "e has no commit in round 7 (rounds: 1, 2)"),
                           ("e/r1/score", "round 1 of e has no such committed attempt (committed: generate/a1, "
                                          "generate/a2, verify/a1)"),
                           ("e/r1/generate/a9", "no such committed attempt"),
                           ("nope/r1", "no commit of experiment 'nope'"),
                           ("e-round-1", "expected <experiment>/r<round>[/<stage>[/a<attempt>]]")]:
        with pytest.raises(StoreError, match=re.escape(message)):
            store.query(count, as_of=point)
