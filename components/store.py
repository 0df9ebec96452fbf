"""The DuckDB trajectory store: schema, commit-by-manifest, and read-only queries.

    from components.store import Store
    store = Store("workdir/coevo.duckdb")
    store.query("SELECT * FROM v_round_summary")

Its tables are declared once, in `components.tables`; this module turns them into DuckDB DDL.

DuckDB lets no other process open the file while a read-write connection is held, readers included.
So the writer (the flow) connects only for the moment of a commit, and readers open read-only and
retry briefly on the lock. Stage jobs never open this file: they read committed Parquet.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from components.manifest import Manifest, ManifestError, part_path, verify_manifest
from components.tables import DATA_TABLES, SCHEMAS, TABLES, Table

# DuckDB's name for each Arrow type a table declares.
_DUCKDB_TYPES = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE", "bool": "BOOLEAN",
                 "timestamp[us]": "TIMESTAMP"}


def create_table_sql(table: Table) -> str:
    """The table's CREATE TABLE statement, from its declaration in `components.tables`.

    A one-column key is written `PRIMARY KEY` on its column, a compound one as a closing PRIMARY KEY
    clause over NOT NULL columns: the forms every older store was created in (`duckdb_constraints()`
    tells them apart).
    """
    inline_key = table.key[0] if len(table.key) == 1 else None
    lines = []
    for c in table.columns:
        line = f"{c.name} {_DUCKDB_TYPES[str(c.type)]}"
        if c.name == inline_key:
            line += " PRIMARY KEY"
        elif not c.nullable:
            line += " NOT NULL"
        if c.default is not None:
            line += f" DEFAULT {c.default}"
        lines.append(line)
    if inline_key is None:
        lines.append(f"PRIMARY KEY ({', '.join(table.key)})")
    return f"CREATE TABLE IF NOT EXISTS {table.name} (\n    " + ",\n    ".join(lines) + "\n);"


SCHEMA = "\n".join(create_table_sql(t) for t in TABLES.values())
# Stores written before round 0's bootstrap was a stage of its own recorded it as round 0's `train_policy`:
# the same job, seed and rows, so the attempt is renamed, and resume and rerun find it where they look.
MIGRATIONS = "UPDATE stage_runs SET stage = 'bootstrap' WHERE round = 0 AND stage = 'train_policy';"

VIEWS = """
CREATE OR REPLACE VIEW v_round_summary AS
WITH gen AS (
    SELECT t.experiment_id, t.round, count(*) AS generated, sum(t.num_tokens) AS generated_tokens,
           count(DISTINCT t.problem_id) AS problems
    FROM trajectories t WHERE t.purpose = 'train' GROUP BY ALL
), ver AS (
    SELECT t.experiment_id, t.round, avg(CASE WHEN v.correct THEN 1.0 ELSE 0.0 END) AS train_pass_rate
    FROM trajectories t JOIN verifications v USING (trajectory_id)
    WHERE t.purpose = 'train' GROUP BY ALL
), sel AS (
    SELECT experiment_id, round, count(*) FILTER (WHERE selected AND purpose = 'policy_sft') AS selected,
           count(*) FILTER (WHERE selected AND purpose = 'dpo_chosen') AS dpo_pairs
    FROM selections GROUP BY ALL
), mc AS (
    -- Monte Carlo rollouts are generation too: the score stage's tokens count in the round's budget.
    SELECT experiment_id, round, sum(TRY_CAST(json_extract(metrics_json, '$.mc_generated_tokens') AS DOUBLE))::BIGINT AS mc_tokens
    FROM stage_runs WHERE stage = 'score' AND status = 'committed' GROUP BY ALL
), srch AS (
    -- So are the step draws a PRM-guided search discarded (generate.search).
    SELECT experiment_id, round, sum(TRY_CAST(json_extract(metrics_json, '$.search_discarded_tokens') AS DOUBLE))::BIGINT AS search_tokens
    FROM stage_runs WHERE stage = 'generate' AND status = 'committed' GROUP BY ALL
), trunc AS (
    -- Training examples cut to a max_length and prompts cut to generate.max_prompt_length: never silent.
    SELECT experiment_id, round,
           sum(coalesce(TRY_CAST(json_extract(metrics_json, '$.truncated') AS DOUBLE), 0)
               + coalesce(TRY_CAST(json_extract(metrics_json, '$.dpo_truncated') AS DOUBLE), 0)
               + coalesce(TRY_CAST(json_extract(metrics_json, '$.truncated_prompts') AS DOUBLE), 0)
               + coalesce(TRY_CAST(json_extract(metrics_json, '$.prm_truncated') AS DOUBLE), 0)
               + coalesce(TRY_CAST(json_extract(metrics_json, '$.orm_truncated') AS DOUBLE), 0))::BIGINT AS truncated
    FROM stage_runs WHERE status = 'committed' GROUP BY ALL
), ev AS (
    SELECT experiment_id, round,
           max(value) FILTER (WHERE metric = 'greedy_acc' AND level = -1) AS greedy_acc,
           -- maj@k at the smallest k evaluated (evaluate.maj_k; larger k come with best-of-N)
           arg_min(value, TRY_CAST(split_part(metric, '_', 3) AS INTEGER))
               FILTER (WHERE metric LIKE 'maj_at_%' AND level = -1) AS maj_acc,
           max(value) FILTER (WHERE metric = 'prm_step_f1' AND level = -1) AS prm_step_f1,
           max(value) FILTER (WHERE metric = 'processbench_f1' AND level = -1) AS processbench_f1
    FROM evaluations GROUP BY ALL
), lv AS (
    SELECT experiment_id, round,
           map_from_entries(list(struct_pack(k := level, v := round(value, 4)) ORDER BY level)) AS greedy_acc_by_level
    FROM evaluations WHERE metric = 'greedy_acc' AND level >= 0 GROUP BY ALL
)
SELECT ev.experiment_id, ev.round, p.levels_json AS curriculum_levels,
       coalesce(gen.generated, 0) AS generated, coalesce(gen.generated_tokens, 0) AS generated_tokens,
       coalesce(mc.mc_tokens, 0) AS mc_tokens, coalesce(srch.search_tokens, 0) AS search_tokens,
       coalesce(gen.generated_tokens, 0) + coalesce(mc.mc_tokens, 0) + coalesce(srch.search_tokens, 0) AS budget_tokens,
       ver.train_pass_rate, coalesce(sel.selected, 0) AS selected, coalesce(sel.dpo_pairs, 0) AS dpo_pairs,
       ev.greedy_acc, ev.maj_acc, lv.greedy_acc_by_level, ev.prm_step_f1, ev.processbench_f1,
       coalesce(trunc.truncated, 0) AS truncated
FROM ev
LEFT JOIN gen USING (experiment_id, round)
LEFT JOIN ver USING (experiment_id, round)
LEFT JOIN sel USING (experiment_id, round)
LEFT JOIN mc USING (experiment_id, round)
LEFT JOIN srch USING (experiment_id, round)
LEFT JOIN lv USING (experiment_id, round)
LEFT JOIN trunc USING (experiment_id, round)
LEFT JOIN round_plans p USING (experiment_id, round)
ORDER BY ev.experiment_id, ev.round;

CREATE OR REPLACE VIEW v_trajectory_scores AS
SELECT t.experiment_id, t.round, t.trajectory_id, t.problem_id, t.level, t.sample_index, t.num_tokens,
       v.correct,
       max(s.value) FILTER (WHERE s.scorer = 'outcome') AS outcome_score,
       max(s.value) FILTER (WHERE s.scorer = 'prm' AND s.aggregate = 'min') AS min_step_score,
       max(s.value) FILTER (WHERE s.scorer = 'prm' AND s.aggregate = 'last') AS last_step_score,
       max(s.value) FILTER (WHERE s.scorer = 'prm' AND s.aggregate = 'mean') AS mean_step_score,
       max(s.value) FILTER (WHERE s.scorer = 'orm') AS orm_score,
       max(s.value) FILTER (WHERE s.scorer = 'implicit' AND s.aggregate = 'min') AS implicit_min_step_score,
       any_value(s.model_id) FILTER (WHERE s.scorer = 'prm') AS prm_model_id
FROM trajectories t
LEFT JOIN verifications v USING (trajectory_id)
LEFT JOIN scores s USING (trajectory_id)
GROUP BY ALL;

CREATE OR REPLACE VIEW v_prm_calibration AS
-- Each step a reward model scored, beside its Monte Carlo and oracle labels (NULL where absent),
-- with a 10-bin score bucket for reliability curves.
SELECT t.experiment_id, t.round, t.level, s.trajectory_id, s.step_index, s.scorer, s.model_id,
       s.value AS score, least(floor(s.value * 10), 9)::INTEGER AS score_bin,
       max(l.value) FILTER (WHERE l.source = 'mc_soft') AS mc_soft,
       max(l.value) FILTER (WHERE l.source = 'mc_hard') AS mc_hard,
       max(l.value) FILTER (WHERE l.source = 'oracle') AS oracle
FROM scores s
JOIN trajectories t USING (trajectory_id)
LEFT JOIN step_labels l ON l.trajectory_id = s.trajectory_id AND l.step_index = s.step_index
WHERE s.aggregate = 'step'
GROUP BY ALL;

CREATE OR REPLACE VIEW v_stage_timings AS
SELECT experiment_id, round, stage, attempt, status, stale, duration_s, started_at, finished_at
FROM stage_runs ORDER BY experiment_id, round, started_at;

CREATE OR REPLACE VIEW v_lineage AS
-- Which trajectories, selected by which filter decision, trained which model, and who generated them.
SELECT m.experiment_id, m.model_id AS trained_model_id, m.round AS trained_round, m.role,
       mi.trajectory_id, mi.use, mi.source_round, sel.purpose AS selected_for, sel.reason AS selection_reason,
       sel.stage_run_id AS selection_stage_run_id, t.purpose AS trajectory_purpose,
       t.policy_model_id AS generated_by_model_id, t.problem_id, t.level
FROM models m
JOIN model_inputs mi USING (model_id)
JOIN trajectories t USING (trajectory_id)
LEFT JOIN selections sel ON sel.trajectory_id = mi.trajectory_id AND sel.selected
    AND sel.purpose = CASE WHEN m.role IN ('prm', 'orm') THEN 'reward_train'
                           WHEN mi.use LIKE 'dpo_%' THEN mi.use WHEN mi.use = 'step_dpo_rejected' THEN 'step_dpo'
                           ELSE 'policy_sft' END;
"""

_WRITE_SQL = re.compile(
    r"^\s*(insert|update|delete|create|drop|alter|copy|attach|detach|install|load|pragma|set|call|checkpoint"
    r"|vacuum|export|import|truncate|begin|commit|rollback|merge|replace)\b",
    re.IGNORECASE,
)


class StoreError(RuntimeError):
    """A store operation failed; nothing was committed."""


class StoreLockedError(StoreError):
    pass


@dataclass(frozen=True)
class StageRunRef:
    experiment: str
    round: int
    stage: str
    attempt: int

    @property
    def stage_run_id(self) -> str:
        return f"{self.experiment}/r{self.round}/{self.stage}/a{self.attempt}"


def _connect(path: Path, read_only: bool, timeout_s: float = 10.0) -> duckdb.DuckDBPyConnection:
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.IOException as e:
            if "lock" not in str(e).lower() or time.monotonic() > deadline:
                if "lock" in str(e).lower():
                    raise StoreLockedError(
                        f"store {path} is locked by another process (a commit in progress?) after {timeout_s:.0f}s: {e}"
                    ) from None
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


class Store:
    def __init__(self, path: str | Path, lock_timeout_s: float = 30.0):
        self.path = Path(path)
        self.lock_timeout_s = lock_timeout_s

    # -- connections -----------------------------------------------------------------
    @contextlib.contextmanager
    def writer(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short-lived read-write connection; hold it only for one commit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = _connect(self.path, read_only=False, timeout_s=self.lock_timeout_s)
        try:
            con.execute(SCHEMA)
            con.execute(MIGRATIONS)
            con.execute(VIEWS)
            yield con
        finally:
            con.close()

    @contextlib.contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        if not self.path.exists():
            raise StoreError(f"no store at {self.path}: run an experiment first (coevo run)")
        con = _connect(self.path, read_only=True, timeout_s=self.lock_timeout_s)
        try:
            yield con
        finally:
            con.close()

    def init(self) -> None:
        with self.writer():
            pass

    # -- reads -----------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple]]:
        """Run a read-only query; write statements are refused before they reach DuckDB."""
        if _WRITE_SQL.match(sql):
            raise StoreError(f"coevo query is read-only; refused: {sql.strip().split()[0].upper()} statement")
        with self.reader() as con:
            try:
                cur = con.execute(sql, params or [])
            except duckdb.Error as e:
                raise StoreError(f"{type(e).__name__}: {e}\nquery: {sql}") from None
            cols = [d[0] for d in cur.description] if cur.description else []
            return cols, cur.fetchall()

    def query_arrow(self, sql: str, params: list[Any] | None = None):
        if _WRITE_SQL.match(sql):
            raise StoreError(f"coevo query is read-only; refused: {sql.strip().split()[0].upper()} statement")
        with self.reader() as con:
            try:
                return con.execute(sql, params or []).to_arrow_table()
            except duckdb.Error as e:
                raise StoreError(f"{type(e).__name__}: {e}\nquery: {sql}") from None

    def rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        cols, rows = self.query(sql, params)
        return [dict(zip(cols, r)) for r in rows]

    def committed_run(self, experiment: str, round: int, stage: str) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        rows = self.rows(
            "SELECT * FROM stage_runs WHERE experiment_id=? AND round=? AND stage=? AND status='committed'",
            [experiment, round, stage],
        )
        return rows[0] if rows else None

    def stage_runs(self, experiment: str) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return self.rows(
            "SELECT * FROM stage_runs WHERE experiment_id=? ORDER BY round, started_at, attempt", [experiment]
        )

    def next_attempt(self, experiment: str, round: int, stage: str) -> int:
        if not self.path.exists():
            return 1
        _, rows = self.query(
            "SELECT coalesce(max(attempt), 0) FROM stage_runs WHERE experiment_id=? AND round=? AND stage=?",
            [experiment, round, stage],
        )
        return int(rows[0][0]) + 1

    # Named reads, so that flows and components hold no SQL. Each returns empty (None, [] or {})
    # where the store does not exist yet.
    def experiments(self) -> list[str]:
        """The experiment ids in the store, sorted."""
        if not self.path.exists():
            return []
        return [r[0] for r in self.query("SELECT experiment_id FROM experiments ORDER BY experiment_id")[1]]

    def round_plan(self, experiment: str, round: int) -> list[int] | None:
        """The curriculum levels `set_round_plan` stored for the round, or None."""
        if not self.path.exists():
            return None
        rows = self.query("SELECT levels_json FROM round_plans WHERE experiment_id=? AND round=?",
                          [experiment, round])[1]
        return json.loads(rows[0][0]) if rows else None

    def committed_model(self, experiment: str, round: int, role: str = "policy") -> dict[str, Any] | None:
        """The `models` row of the round's committed model in that role, or None."""
        if not self.path.exists():
            return None
        rows = self.rows(
            "SELECT m.* FROM models m JOIN stage_runs s USING (stage_run_id) "
            "WHERE m.experiment_id=? AND m.round=? AND m.role=? AND s.status='committed'",
            [experiment, round, role],
        )
        return rows[0] if rows else None

    def level_pass_rates(self, experiment: str, round: int) -> dict[int, float]:
        """{level: held-out greedy accuracy} from the round's committed evaluation; {} if none."""
        if not self.path.exists():
            return {}
        rows = self.query(
            "SELECT e.level, e.value FROM evaluations e JOIN stage_runs s USING (stage_run_id) "
            "WHERE e.experiment_id=? AND e.round=? AND e.metric='greedy_acc' AND e.level >= 0 "
            "AND s.status='committed' ORDER BY e.level",
            [experiment, round],
        )[1]
        return {int(level): float(value) for level, value in rows}

    def evaluations(self, experiment: str) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return self.rows("SELECT * FROM evaluations WHERE experiment_id=? ORDER BY round, level, metric", [experiment])

    def round_summary(self, experiment: str, round: int | None = None) -> list[dict[str, Any]]:
        """`v_round_summary` rows of the experiment: the one round, or every round in order."""
        if not self.path.exists():
            return []
        if round is not None:
            return self.rows("SELECT * FROM v_round_summary WHERE experiment_id=? AND round=?", [experiment, round])
        return self.rows("SELECT * FROM v_round_summary WHERE experiment_id=? ORDER BY round", [experiment])

    def stage_timings(self, experiment: str, round: int) -> list[dict[str, Any]]:
        """Stage name and duration of the round's committed stage runs, in the order they started."""
        if not self.path.exists():
            return []
        return self.rows("SELECT stage, duration_s FROM stage_runs WHERE experiment_id=? AND round=? "
                         "AND status='committed' ORDER BY started_at", [experiment, round])

    def round_models(self, experiment: str, round: int) -> list[dict[str, Any]]:
        """The models the round trained, one row per role, in role order."""
        if not self.path.exists():
            return []
        return self.rows("SELECT model_id, role, uri, stage_run_id, train_examples FROM models "
                         "WHERE experiment_id=? AND round=? ORDER BY role", [experiment, round])

    def table_hashes(self, experiment: str) -> dict[str, tuple[int, str]]:
        """(row count, content hash) per data table for one experiment, independent of attempt numbers."""
        out = {}
        with self.reader() as con:
            for table in DATA_TABLES:
                # Attempt-specific columns (which attempt, where its files lie) are not content.
                cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()
                        if r[0] not in ("stage_run_id", "uri")]
                where = experiment_filter(table)
                col_list = ", ".join(cols)
                n, h = con.execute(
                    f"SELECT count(*), coalesce(md5(string_agg(CAST(row({col_list}) AS VARCHAR), '|' "
                    f"ORDER BY CAST(row({col_list}) AS VARCHAR))), '') FROM {table} WHERE {where}",
                    [experiment],
                ).fetchone()
                out[table] = (int(n), h)
        return out

    # -- writes (the flow is the single writer) -------------------------------------------
    def register_experiment(self, experiment: str, config_json: str, config_hash: str, seed: int, recipe: str,
                            code_version: str | None, extends: Callable[[str], bool] | None = None) -> bool:
        """Record the experiment's config, or check a resume against it. A different config is refused unless
        `extends(stored_config_json)` accepts it as a continuation (more rounds): then it replaces the stored
        one, and this returns True."""
        with self.writer() as con:
            row = con.execute("SELECT config_hash, config_json FROM experiments WHERE experiment_id=?",
                              [experiment]).fetchone()
            if row and row[0] != config_hash and extends is not None and extends(row[1]):
                con.execute("UPDATE experiments SET config_json=?, config_hash=? WHERE experiment_id=?",
                            [config_json, config_hash, experiment])
                return True
            if row and row[0] != config_hash:
                raise StoreError(
                    f"experiment {experiment!r} already exists in {self.path} with config hash {row[0]}, "
                    f"not {config_hash}: use a new experiment name, resume it with its own config, or raise only "
                    "`rounds` to continue it"
                )
            if not row:
                con.execute(
                    "INSERT INTO experiments (experiment_id, config_json, config_hash, seed, recipe, code_version) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [experiment, config_json, config_hash, seed, recipe, code_version],
                )
            return False

    def set_round_plan(self, experiment: str, round: int, levels: list[int], reason: str) -> None:
        with self.writer() as con:
            con.execute(
                "INSERT OR REPLACE INTO round_plans VALUES (?, ?, ?, ?)",
                [experiment, round, json.dumps(levels), reason],
            )

    def start_stage_run(self, ref: StageRunRef, out_dir: str, spec_json: str, config_hash: str, seed: int,
                        prefect_task_run_id: str | None = None) -> None:
        with self.writer() as con:
            con.execute(
                "INSERT INTO stage_runs (stage_run_id, experiment_id, round, stage, attempt, status, out_dir, "
                "spec_json, config_hash, seed, started_at, prefect_task_run_id) "
                "VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?, ?, now(), ?)",
                [ref.stage_run_id, ref.experiment, ref.round, ref.stage, ref.attempt, out_dir, spec_json,
                 config_hash, seed, prefect_task_run_id],
            )

    def record_job(self, stage_run_id: str, shard: int, try_: int, worker: str | None, flow_run_id: str | None,
                   status: str, error: str | None, duration_s: float) -> None:
        """One try of a stage run's job (or of one of its shards): where it ran and how it ended."""
        with self.writer() as con:
            con.execute("INSERT OR REPLACE INTO stage_jobs (stage_run_id, shard, try, worker, flow_run_id, status, "
                        "error, duration_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [stage_run_id, shard, try_, worker, flow_run_id, status, (error or "")[-4000:] or None,
                         duration_s])

    def stage_jobs(self, stage_run_id: str) -> list[dict[str, Any]]:
        """The job tries of a stage run, by shard and try."""
        if not self.path.exists():
            return []
        return self.rows("SELECT * FROM stage_jobs WHERE stage_run_id=? ORDER BY shard, try", [stage_run_id])

    def fail_stage_run(self, ref: StageRunRef, error: str) -> None:
        with self.writer() as con:
            con.execute(
                "UPDATE stage_runs SET status='failed', error=?, finished_at=now(), "
                "duration_s=epoch(now() - started_at) WHERE stage_run_id=?",
                [error[-4000:], ref.stage_run_id],
            )

    def fail_dangling_runs(self, experiment: str) -> int:
        """Mark attempts left `running` by a killed flow as failed (called at resume)."""
        if not self.path.exists():
            return 0
        with self.writer() as con:
            n = con.execute(
                "SELECT count(*) FROM stage_runs WHERE experiment_id=? AND status='running'", [experiment]
            ).fetchone()[0]
            con.execute(
                "UPDATE stage_runs SET status='failed', error='abandoned: the flow process ended before this "
                "attempt finished', finished_at=now() WHERE experiment_id=? AND status='running'",
                [experiment],
            )
            return int(n)

    def commit(self, ref: StageRunRef, manifest_path: Path, mlflow_run_id: str | None = None) -> Manifest:
        """Ingest a finished job's Parquet and flip statuses, all in one transaction.

        The manifest is verified (file sizes and sha256) before anything is written, so a corrupt
        or truncated part fails the commit with nothing visible.
        """
        manifest = verify_manifest(manifest_path)
        if (manifest.experiment, manifest.round, manifest.stage, manifest.attempt) != (
            ref.experiment, ref.round, ref.stage, ref.attempt,
        ):
            raise ManifestError(f"{manifest_path}: manifest is for {manifest.stage_run_id}, expected {ref.stage_run_id}")
        out_dir = manifest_path.parent
        with self.writer() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                prev = con.execute(
                    "SELECT stage_run_id FROM stage_runs WHERE experiment_id=? AND round=? AND stage=? "
                    "AND status='committed' AND stage_run_id <> ?",
                    [ref.experiment, ref.round, ref.stage, ref.stage_run_id],
                ).fetchall()
                for (old_id,) in prev:
                    # Problems carry no stage run: they are shared by every run that drew them, and stay.
                    for table in DATA_TABLES:
                        if "stage_run_id" in TABLES[table].names:
                            con.execute(f"DELETE FROM {table} WHERE stage_run_id = ?", [old_id])
                    con.execute("UPDATE stage_runs SET status='superseded' WHERE stage_run_id=?", [old_id])
                for out in manifest.outputs:
                    part = part_path(out_dir, out["path"])
                    table = out["table"]
                    if table not in DATA_TABLES:
                        raise ManifestError(f"{manifest_path}: unknown output table {table!r}")
                    select = ", ".join(SCHEMAS[table].names)
                    if "stage_run_id" in TABLES[table].names:
                        con.execute(f"INSERT INTO {table} ({select}, stage_run_id) "
                                    f"SELECT {select}, ? FROM read_parquet(?)", [ref.stage_run_id, part])
                    else:  # problems: a problem another run already drew is kept as it is
                        con.execute(f"INSERT OR IGNORE INTO {table} ({select}) SELECT {select} FROM read_parquet(?)",
                                    [part])
                con.execute(
                    "UPDATE stage_runs SET status='committed', stale=false, manifest_sha256=?, rows_json=?, "
                    "metrics_json=?, finished_at=now(), duration_s=?, pid=?, mlflow_run_id=coalesce(?, mlflow_run_id), "
                    "error=NULL WHERE stage_run_id=?",
                    [manifest.sha256, json.dumps({o["table"]: o["rows"] for o in manifest.outputs}),
                     json.dumps(manifest.metrics, sort_keys=True), manifest.timings.get("total_s"),
                     manifest.pid, mlflow_run_id, ref.stage_run_id],
                )
                con.execute("COMMIT")
            except Exception as e:
                con.execute("ROLLBACK")
                if isinstance(e, (ManifestError, StoreError)):
                    raise
                raise StoreError(f"commit of {ref.stage_run_id} failed, nothing committed: {e}") from e
        return manifest

    def mark_stale(self, experiment: str, round: int, stages: list[str]) -> None:
        with self.writer() as con:
            con.execute(
                "UPDATE stage_runs SET stale=true WHERE experiment_id=? AND round=? AND status='committed' "
                "AND list_contains(?, stage)",
                [experiment, round, stages],
            )

    def set_mlflow_run(self, stage_run_id: str, mlflow_run_id: str) -> None:
        with self.writer() as con:
            con.execute("UPDATE stage_runs SET mlflow_run_id=? WHERE stage_run_id=?", [mlflow_run_id, stage_run_id])

    def set_model_registration(self, model_id: str, name: str, version: str, mlflow_run_id: str | None) -> None:
        with self.writer() as con:
            con.execute(
                "UPDATE models SET registered_name=?, registered_version=?, mlflow_run_id=? WHERE model_id=?",
                [name, version, mlflow_run_id, model_id],
            )


def experiment_filter(table: str) -> str:
    """A SQL condition, with one `?` for the experiment id, that picks the table's rows of one experiment."""
    if table == "problems":
        return "problem_id IN (SELECT problem_id FROM trajectories WHERE experiment_id = ?)"
    if table == "model_inputs":
        return "model_id IN (SELECT model_id FROM models WHERE experiment_id = ?)"
    if table == "stage_jobs":
        return "stage_run_id IN (SELECT stage_run_id FROM stage_runs WHERE experiment_id = ?)"
    if table in ("steps", "verifications", "step_labels", "step_pairs", "scores", "trajectory_sources"):
        return "trajectory_id IN (SELECT trajectory_id FROM trajectories WHERE experiment_id = ?)"
    return "experiment_id = ?"
