"""The trajectory store: a DuckLake of every experiment's rows, with schema, commit-by-manifest, snapshots
and guarded read-only queries.

    from components.store import Store
    store = Store("workdir/store")                    # the embedded default: catalog.sqlite + data/
    store.query("SELECT * FROM v_round_summary")
    store.query("SELECT count(*) FROM trajectories", as_of="arith-default/r2")

Its tables are declared once, in `components.tables`; this module turns them into DDL. Where the store lives
and how a process attaches it is `components.store.lake`; what a user's SQL may do is `components.store.guard`.

Every commit is a DuckLake snapshot, so readers (any number, in any process) never wait for the flow and never
make it wait: each reads the snapshot it started on. The flow is the single writer of an experiment, and
each stage attempt commits in one transaction whose snapshot names the attempt (`as_of`). Stage jobs never
open the store: they read committed Parquet.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow.parquet as pq

from components import storage
from components.manifest import Manifest, ManifestError, part_path, verify_manifest
from components.store import guard, lake
from components.store.errors import StoreError, StoreLockedError
from components.tables import DATA_TABLES, PARTS, SCHEMAS, TABLES, Table

T = TypeVar("T")

# DuckDB's name for each Arrow type a table declares.
_DUCKDB_TYPES = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE", "bool": "BOOLEAN",
                 "timestamp[us]": "TIMESTAMP", "list<item: int32>": "INTEGER[]"}

# The store's layout version, in `coevo_meta`. 1 was the single DuckDB file (coevo.duckdb, read as it is and
# migrated by the first writer); 2 is the DuckLake; 3 adds agent episodes (`turns`, `v_episodes`,
# `v_tool_stats`), which the first writer of a version-2 store adds; 4 adds `turns.token_ids`; 5 adds recipe
# grpo's `advantages`, `rollout_logprobs`, `trajectories.token_ids` and `v_rl_round`; 6 adds MCTS's `nodes`
# and `v_search`; 7 adds `step_pairs.source`, `chosen_q` and `rejected_q` (pairs from a tree); 8 adds
# `advantages.process` and `process_return` (step-level credit); 9 has `v_round_summary` count a round's pass rate by
# stage run (the same values; the view took 0.81 s at 100M steps, against 3.6 s); 10 adds
# `advantages.steps_checked` (filter.check_steps under recipe grpo); 11 adds
# `v_trajectory_scores.confidence_min_step_score` (the sampler's confidence). An older store's first writer adds the
# tables and columns it lacks, and makes the views again. A higher version was made by a newer coevo.
SCHEMA_VERSION = 11
LEGACY_FILE = "coevo.duckdb"  # the single-file store of versions before the lake, beside the store's folder


def create_table_sql(table: Table) -> str:
    """The table's CREATE TABLE statement, from its declaration in `components.tables`.

    DuckLake enforces no PRIMARY KEY, so key columns are NOT NULL and `Store.commit` checks their uniqueness
    for every row it adds.
    """
    lines = []
    for c in table.columns:
        line = f"{c.name} {_DUCKDB_TYPES[str(c.type)]}"
        if not c.nullable or c.name in table.key:
            line += " NOT NULL"
        if c.default is not None:
            line += f" DEFAULT {c.default}"
        lines.append(line)
    return f"CREATE TABLE IF NOT EXISTS {table.name} (\n    " + ",\n    ".join(lines) + "\n);"


SCHEMA = "\n".join(create_table_sql(t) for t in TABLES.values()) + \
    "\nCREATE TABLE IF NOT EXISTS coevo_meta (key VARCHAR NOT NULL, value VARCHAR);"
# Stores written before round 0's bootstrap was a stage of its own recorded it as round 0's `train_policy`:
# the same job, seed and rows, so the attempt is renamed, and resume and rerun find it where they look.
MIGRATIONS = "UPDATE stage_runs SET stage = 'bootstrap' WHERE round = 0 AND stage = 'train_policy';"

VIEWS = """
CREATE OR REPLACE VIEW v_round_summary AS
WITH gen AS (
    SELECT t.experiment_id, t.round, count(*) AS generated, sum(t.num_tokens) AS generated_tokens
    FROM trajectories t WHERE t.purpose = 'train' GROUP BY ALL
), ver_runs AS (
    SELECT stage_run_id, count(*) FILTER (WHERE correct) AS n_right, count(*) AS n FROM verifications GROUP BY ALL
), ver AS (
    -- The verifications of the round's train trajectories. `verify` verifies its round's `generate` output, all
    -- of it purpose 'train', and `evaluate` only 'eval' trajectories: their rows are counted by stage run,
    -- without joining every verification to its trajectory (2.7 s of 3.6 at 100M steps). Any other stage's
    -- (an import's) are joined to their trajectories.
    SELECT experiment_id, round, sum(n_right) / sum(n) AS train_pass_rate FROM (
        SELECT s.experiment_id, s.round, v.n_right, v.n
        FROM ver_runs v JOIN stage_runs s USING (stage_run_id) WHERE s.stage = 'verify'
        UNION ALL
        SELECT t.experiment_id, t.round, count(*) FILTER (WHERE o.correct), count(*)
        FROM (SELECT trajectory_id, correct FROM verifications SEMI JOIN (
                  SELECT stage_run_id FROM stage_runs WHERE stage NOT IN ('verify', 'evaluate')) USING (stage_run_id)
              ) AS o
        JOIN trajectories t USING (trajectory_id) WHERE t.purpose = 'train' GROUP BY ALL
    ) GROUP BY ALL
), sel AS (
    SELECT experiment_id, round, count(*) FILTER (WHERE selected AND purpose IN ('policy_sft', 'grpo')) AS selected,
           count(*) FILTER (WHERE selected AND purpose = 'dpo_chosen') AS dpo_pairs
    FROM selections GROUP BY ALL
), mc AS (
    -- Monte Carlo rollouts are generation too, and so is the tree score grows (score.tree.search): the score
    -- stage's tokens count in the round's budget.
    SELECT experiment_id, round,
           sum(coalesce(TRY_CAST(json_extract(metrics_json, '$.mc_generated_tokens') AS DOUBLE), 0)
               + coalesce(TRY_CAST(json_extract(metrics_json, '$.tree_search_generated_tokens') AS DOUBLE), 0)
           )::BIGINT AS mc_tokens
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
       max(s.value) FILTER (WHERE s.scorer = 'confidence' AND s.aggregate = 'min') AS confidence_min_step_score,
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
                           WHEN mi.use IN ('grpo', 'grpo+ptx') THEN 'grpo' WHEN mi.use = 'ptx' THEN 'ptx'
                           ELSE 'policy_sft' END;

CREATE OR REPLACE VIEW v_rl_round AS
-- A grpo round's learning signal: its groups and rewards (the filter's `advantages`), and what training did
-- with them (train_policy's metrics, from TRL's logs, and `rollout_logprobs`).
WITH r AS (
    SELECT a.experiment_id, a.round, a.group_id, a.reward, a.outcome, a.advantage, a.kept, a.group_std,
           t.num_tokens, v.correct
    FROM advantages a JOIN trajectories t USING (trajectory_id) LEFT JOIN verifications v USING (trajectory_id)
    WHERE a.turn_index = -1
), g AS (
    SELECT experiment_id, round, group_id, bool_or(coalesce(correct, false)) AS solved,
           coalesce(max(group_std), 0) < 1e-6 AS zero_variance, bool_or(kept) AS kept, count(*) AS k
    FROM r GROUP BY ALL
), rs AS (
    SELECT experiment_id, round, count(*) AS rollouts, count(*) FILTER (WHERE kept) AS rollouts_trained,
           avg(reward) AS reward_mean, avg(outcome) AS outcome_mean, avg(num_tokens) AS response_length,
           avg(abs(advantage)) FILTER (WHERE kept) AS mean_abs_advantage
    FROM r GROUP BY ALL
), gs AS (
    SELECT experiment_id, round, count(*) AS groups, count(*) FILTER (WHERE kept) AS groups_trained,
           max(k) AS group_size, avg(solved::INTEGER) AS pass_at_k, avg(zero_variance::INTEGER) AS zero_variance_share
    FROM g GROUP BY ALL
), tr AS (
    SELECT experiment_id, round, metrics_json AS m FROM stage_runs
    WHERE stage = 'train_policy' AND status = 'committed'
), lp AS (
    SELECT m.experiment_id, m.round, sum(l.old_logprob - l.new_logprob) / sum(l.tokens) AS policy_shift
    FROM rollout_logprobs l JOIN models m USING (model_id) GROUP BY ALL
)
SELECT rs.experiment_id, rs.round, gs.groups, gs.group_size, gs.groups_trained, rs.rollouts, rs.rollouts_trained,
       rs.reward_mean, gs.pass_at_k, gs.zero_variance_share, rs.mean_abs_advantage, rs.response_length,
       TRY_CAST(json_extract(tr.m, '$.steps') AS INTEGER) AS optimizer_steps,
       TRY_CAST(json_extract(tr.m, '$.entropy') AS DOUBLE) AS entropy,
       TRY_CAST(json_extract(tr.m, '$.kl') AS DOUBLE) AS kl,
       TRY_CAST(json_extract(tr.m, '$.clip_ratio') AS DOUBLE) AS clip_fraction,
       TRY_CAST(json_extract(tr.m, '$.staleness_mean') AS DOUBLE) AS staleness_mean,
       TRY_CAST(json_extract(tr.m, '$.staleness_max') AS INTEGER) AS staleness_max,
       lp.policy_shift
FROM rs JOIN gs USING (experiment_id, round)
LEFT JOIN tr USING (experiment_id, round)
LEFT JOIN lp USING (experiment_id, round)
ORDER BY rs.experiment_id, rs.round;

CREATE OR REPLACE VIEW v_episodes AS
-- One row per agent episode: its turns, tool calls and their errors, tokens, time and outcome.
SELECT t.experiment_id, t.round, t.purpose, t.trajectory_id, t.problem_id, t.level, t.policy_model_id,
       t.finish_reason AS episode_status,
       count(*) FILTER (WHERE u.role = 'assistant') AS assistant_turns,
       count(*) FILTER (WHERE u.role = 'tool') AS tool_calls,
       count(*) FILTER (WHERE u.role = 'tool' AND NOT u.tool_ok) AS tool_errors,
       count(*) FILTER (WHERE u.truncated) AS cut_observations,
       sum(u.num_tokens) FILTER (WHERE u.role = 'assistant') AS assistant_tokens,
       sum(length(u.content)) FILTER (WHERE u.role IN ('tool', 'user') AND u.turn_index > 1) AS observation_chars,
       sum(u.latency_s) FILTER (WHERE u.role = 'assistant') AS generation_s,
       sum(u.latency_s) FILTER (WHERE u.role = 'tool') AS tool_s,
       v.reward, v.correct
FROM trajectories t
JOIN turns u USING (trajectory_id)
LEFT JOIN verifications v USING (trajectory_id)
GROUP BY ALL;

CREATE OR REPLACE VIEW v_tool_stats AS
-- Calls, errors and latency per tool and round; malformed calls count under the tool name 'invalid'.
SELECT t.experiment_id, t.round, t.purpose, u.tool_name, count(*) AS calls,
       count(*) FILTER (WHERE NOT u.tool_ok) AS errors, avg(CASE WHEN u.tool_ok THEN 0.0 WHEN NOT u.tool_ok THEN 1.0 END) AS error_rate,
       count(*) FILTER (WHERE u.truncated) AS cut, avg(u.latency_s) AS mean_latency_s,
       quantile_cont(u.latency_s, 0.5) AS p50_latency_s, quantile_cont(u.latency_s, 0.99) AS p99_latency_s
FROM turns u JOIN trajectories t USING (trajectory_id)
WHERE u.role = 'tool'
GROUP BY ALL;

CREATE OR REPLACE VIEW v_search AS
-- One row per search tree (generate.mcts; score.tree.search, purpose 'label'): how far it went, what it cost, what it found and returned.
SELECT experiment_id, round, purpose, tree_id, problem_id,
       count(*) - 1 AS steps_drawn,
       max(depth) AS max_depth,
       max(visits) FILTER (WHERE node_id = 0) AS root_visits,
       max(q) FILTER (WHERE node_id = 0) AS root_q,
       count(*) FILTER (WHERE terminal) AS terminal_nodes,
       count(*) FILTER (WHERE terminal AND reward >= 1) AS right_leaves,
       count(*) FILTER (WHERE node_id > 0 AND visits <= 1 AND NOT terminal) AS abandoned,
       sum(tokens) AS tokens,
       count(trajectory_id) AS returned
FROM nodes
GROUP BY ALL;
"""

AS_OF = re.compile(r"(?P<experiment>[^/]+)/r(?P<round>\d+)(?:/(?P<stage>[a-z_]+)(?:/a(?P<attempt>\d+))?)?")


@dataclass(frozen=True)
class StageRunRef:
    experiment: str
    round: int
    stage: str
    attempt: int

    @property
    def stage_run_id(self) -> str:
        return f"{self.experiment}/r{self.round}/{self.stage}/a{self.attempt}"


def writer_threads() -> int:
    """DuckDB threads for a commit's connection: one fewer than this process may use, so that a commit leaves a
    core to the readers (a query on 2 cores otherwise runs at half speed while a round commits). Measured on 2
    cores, five runs each of `benchmarks/store_scale.py --steps 10000000`: busy / idle 1.35 to 1.84 (median 1.58)
    with 1 thread, 1.69 to 8.45 (median 1.76) with 2; ingest 0.524 against 0.535 (medians)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _locked(e: Exception) -> StoreError:
    """A LakeError (or DuckDB's own error while attaching) as the store's error: transient ones are a lock."""
    if isinstance(e, lake.LakeError):
        return StoreLockedError(str(e)) if e.transient else StoreError(str(e))
    return StoreError(f"cannot open the store: {type(e).__name__}: {e}")


def _schema_version(con: duckdb.DuckDBPyConnection) -> int | None:
    """The attached store's `coevo_meta` schema version; None where it has no tables yet."""
    try:
        row = con.execute("SELECT max(TRY_CAST(value AS INTEGER)) FROM coevo_meta WHERE key = 'schema_version'").fetchone()
    except duckdb.CatalogException:
        return None
    return int(row[0]) if row and row[0] is not None else None


def _check_version(version: int | None, where: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(f"store {where} has schema version {version}, made by a newer coevo (this one reads "
                         f"up to {SCHEMA_VERSION}): upgrade coevo (pip install -U coevo) to read or write it")


def _add_missing_columns(con: duckdb.DuckDBPyConnection) -> None:
    """ALTER TABLE ... ADD COLUMN for each declared column an older store's table lacks (null in its old rows)."""
    have: dict[str, set[str]] = {}
    for table, column in con.execute(f"SELECT table_name, column_name FROM duckdb_columns() "
                                     f"WHERE database_name = '{lake.LAKE}'").fetchall():
        have.setdefault(table, set()).add(column)
    for t in TABLES.values():
        for c in t.columns:
            if t.name in have and c.name not in have[t.name]:
                con.execute(f"ALTER TABLE {t.name} ADD COLUMN {c.name} {_DUCKDB_TYPES[str(c.type)]}")


class Store:
    """The store at `where`: a folder (the embedded DuckLake, `catalog.sqlite` + `data/`) or
    `postgres:<connection string>` (a shared catalog; `data_path` where a new one keeps its data)."""

    def __init__(self, where: str | Path, lock_timeout_s: float = 30.0, data_path: str | None = None):
        try:
            self.location = lake.Location.parse(where, data_path)
        except lake.LakeError as e:
            raise StoreError(str(e)) from None
        self.path = self.location.root  # the embedded store's folder; None for a shared catalog
        self.lock_timeout_s = lock_timeout_s
        self.pinned: int | None = None  # `at`: every read at this snapshot, and no writes
        # A writer's checks that a commit need not repeat: each read of the catalog costs a few ms.
        self._version_checked = False  # the schema version, once per Store (a newer coevo's store is refused)
        self._folders: dict[str, str] = {}  # table: the folder its data files lie in, which never moves

    def at(self, point: str) -> Store:
        """The store as it stood at `point` (`<experiment>/r<round>[/<stage>[/a<attempt>]]`, see `snapshot`):
        every read of the view sees that snapshot, and it refuses writes."""
        view = copy.copy(self)
        view.pinned = self.snapshot(point)
        return view

    @classmethod
    def for_config(cls, cfg) -> Store:
        """The store an experiment config names (`execution.catalog`, else `<workdir>/store`)."""
        return cls(cfg.store_path, data_path=cfg.store_data_path)

    def __repr__(self) -> str:
        return f"Store({self.location.describe()!r})"

    @property
    def legacy(self) -> Path | None:
        """A single-file store of an older coevo beside this folder, not migrated yet."""
        if self.path is None or self.location.exists():
            return None
        old = self.path.parent / LEGACY_FILE
        return old if old.is_file() else None

    def exists(self) -> bool:
        return self.location.exists() or self.legacy is not None

    # -- connections -----------------------------------------------------------------
    @contextlib.contextmanager
    def writer(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-write connection with the store attached, created (or migrated) where needed. Readers never
        wait for it; hold it for one commit anyway, since every statement outside BEGIN..COMMIT is a snapshot."""
        if self.pinned is not None:
            raise StoreError(f"{self!r} is a view at snapshot {self.pinned}: it is read only")
        legacy = self.legacy
        if self.location.data_path is None:
            raise StoreError(f"store {self.location.describe()}: a shared catalog's writer needs the data path every "
                             "reader reaches (execution.storage: s3://bucket/prefix)")
        try:
            if self.path is not None and not self.location.exists():
                if lake.create_embedded(self.location, lambda con: self._create(con, legacy)) and legacy is not None:
                    legacy.rename(legacy.with_name(legacy.name + ".migrated"))  # kept: the lake holds a copy
            con = lake.connect(self.location, read_only=False, config={"threads": writer_threads()})
        except (lake.LakeError, duckdb.Error) as e:
            raise _locked(e) from None
        try:
            if not self._version_checked:
                version = _schema_version(con)
                _check_version(version, self.location.describe())
                if version != SCHEMA_VERSION:  # a new shared catalog (Postgres): made in one transaction
                    lake.retry_busy(lambda: self._create(con, None), f"creating the store {self.location.describe()}",
                                    self.lock_timeout_s)
                self._version_checked = True
            yield con
        except lake.LakeError as e:
            raise _locked(e) from None
        finally:
            con.close()

    def _create(self, con: duckdb.DuckDBPyConnection, legacy: Path | None) -> None:
        """Tables, views and the schema version in one snapshot; the rows of a single-file store copied in."""
        con.execute("BEGIN TRANSACTION")
        try:
            if _schema_version(con) == SCHEMA_VERSION:  # another process created it first
                con.execute("ROLLBACK")
                return
            before = _schema_version(con)
            con.execute(SCHEMA)  # CREATE TABLE IF NOT EXISTS: an older store gains its new tables
            _add_missing_columns(con)  # and its tables their new columns
            con.execute(VIEWS)
            message = "coevo: create the store" if before is None else f"coevo: upgrade the store to schema {SCHEMA_VERSION}"
            if legacy is not None:
                message = f"coevo: migrate {legacy}"
                con.execute(f"ATTACH '{str(legacy).replace(chr(39), chr(39) * 2)}' AS legacy (READ_ONLY)")
                for table in TABLES.values():
                    have = {r[0] for r in con.execute(
                        "SELECT column_name FROM duckdb_columns() WHERE database_name = 'legacy' AND table_name = ?",
                        [table.name]).fetchall()}
                    cols = ", ".join(c for c in table.names if c in have)
                    if cols:
                        con.execute(f"INSERT INTO {table.name} ({cols}) SELECT {cols} FROM legacy.main.{table.name}")
                con.execute(MIGRATIONS)
            con.execute("INSERT INTO coevo_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            con.execute(f"CALL {lake.LAKE}.set_commit_message('coevo', ?)", [message])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        if legacy is not None:
            con.execute("DETACH legacy")

    @contextlib.contextmanager
    def reader(self, as_of: str | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only connection that sees the store's tables and nothing outside them (the query guard's
        lock), at the latest snapshot or at `as_of` (see `snapshot`). Holding it open blocks no commit."""
        if not self.exists():
            raise StoreError(f"no store at {self.location.describe()}: run an experiment first (coevo run)")
        if self.legacy is not None:  # an older coevo's file, read as it is until a writer migrates it
            if as_of is not None:
                raise StoreError(f"{self.legacy} predates snapshots: a run with this coevo migrates it, and the "
                                 "commits after that can be read as of")
            con = duckdb.connect(str(self.legacy), read_only=True, config=guard.locked_config())
        else:
            snapshot = self.snapshot(as_of) if as_of is not None else self.pinned

            def prepare(con: duckdb.DuckDBPyConnection) -> None:
                _check_version(_schema_version(con), self.location.describe())
                guard.lock(con, allowed_directories=[lake.data_path(con)])

            try:
                con = lake.connect(self.location, read_only=True, snapshot=snapshot, config=guard.STARTUP,
                                   prepare=prepare)
            except (lake.LakeError, duckdb.Error) as e:
                raise _locked(e) from None
        try:
            yield con
        finally:
            con.close()

    def init(self) -> None:
        with self.writer():
            pass

    # -- reads -----------------------------------------------------------------------
    def _read(self, sql: str, params: list[Any] | None, fetch: Callable[[duckdb.DuckDBPyConnection], T],
              as_of: str | None = None) -> T:
        """`fetch` the result of one statement, passed by the query guard, on a fresh reader."""
        with self.reader(as_of) as con:
            try:
                return guard.run(con, sql, params, fetch)
            except duckdb.Error as e:
                raise StoreError(f"{type(e).__name__}: {e}\nquery: {sql}") from None

    def query(self, sql: str, params: list[Any] | None = None, as_of: str | None = None) -> tuple[list[str], list[tuple]]:
        """Columns and rows of one read-only statement (`?` take `params`), at the latest snapshot or `as_of`
        (`<experiment>/r<round>[/<stage>[/a<attempt>]]`); the guard refuses the rest."""
        def fetch(cur: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
            return [d[0] for d in cur.description] if cur.description else [], cur.fetchall()

        return self._read(sql, params, fetch, as_of)

    def query_arrow(self, sql: str, params: list[Any] | None = None, as_of: str | None = None):
        """`query`'s result as an Arrow table."""
        return self._read(sql, params, lambda cur: cur.to_arrow_table(), as_of)

    def query_df(self, sql: str, params: list[Any] | None = None, as_of: str | None = None):
        """`query`'s result as a pandas DataFrame (the notebooks' `sql()`)."""
        return self._read(sql, params, lambda cur: cur.df(), as_of)

    # -- snapshots ---------------------------------------------------------------------
    def commits(self) -> list[dict[str, Any]]:
        """Every stage attempt's commit: its snapshot id and time, and the attempt, oldest first."""
        if not self.exists() or self.legacy is not None:
            return []
        with self.reader() as con:
            rows = con.execute(f"SELECT snapshot_id, snapshot_time, commit_extra_info FROM ducklake_snapshots('{lake.LAKE}') "
                               "WHERE commit_extra_info IS NOT NULL ORDER BY snapshot_id").fetchall()
        return [{"snapshot": sid, "time": t, **json.loads(info)} for sid, t, info in rows]

    def snapshot(self, point: str) -> int:
        """The snapshot that `<experiment>/r<round>[/<stage>[/a<attempt>]]` names: the commit of that attempt
        (of the stage's live attempt, where none is given), or of the round's last live stage."""
        m = AS_OF.fullmatch(point.strip())
        if not m:
            raise StoreError(f"--as-of {point!r}: expected <experiment>/r<round>[/<stage>[/a<attempt>]], "
                             "e.g. arith-default/r2 or arith-default/r2/generate")
        exp, round, stage, attempt = m["experiment"], int(m["round"]), m["stage"], m["attempt"]
        commits = [c for c in self.commits() if c["experiment"] == exp]
        if not commits:
            known = sorted({c["experiment"] for c in self.commits()})
            raise StoreError(f"--as-of {point!r}: no commit of experiment {exp!r} in {self.location.describe()} "
                             f"(experiments with commits: {', '.join(known) or 'none'})")
        in_round = [c for c in commits if c["round"] == round]
        if not in_round:
            rounds = sorted({c["round"] for c in commits})
            raise StoreError(f"--as-of {point!r}: {exp} has no commit in round {round} (rounds: "
                             f"{', '.join(map(str, rounds))})")
        live = {r["stage_run_id"] for r in self.stage_runs(exp) if r["status"] == "committed"}
        if stage is None:
            chosen = [c for c in in_round if c["stage_run_id"] in live] or in_round
        else:
            chosen = [c for c in in_round if c["stage"] == stage and
                      (c["attempt"] == int(attempt) if attempt else c["stage_run_id"] in live)]
            if not chosen:
                have = sorted({f"{c['stage']}/a{c['attempt']}" for c in in_round})
                raise StoreError(f"--as-of {point!r}: round {round} of {exp} has no such committed attempt "
                                 f"(committed: {', '.join(have)})")
        return max(c["snapshot"] for c in chosen)

    def rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        cols, rows = self.query(sql, params)
        return [dict(zip(cols, r)) for r in rows]

    def committed_run(self, experiment: str, round: int, stage: str) -> dict[str, Any] | None:
        if not self.exists():
            return None
        rows = self.rows(
            "SELECT * FROM stage_runs WHERE experiment_id=? AND round=? AND stage=? AND status='committed'",
            [experiment, round, stage],
        )
        return rows[0] if rows else None

    def stage_runs(self, experiment: str) -> list[dict[str, Any]]:
        if not self.exists():
            return []
        return self.rows(
            "SELECT * FROM stage_runs WHERE experiment_id=? ORDER BY round, started_at, attempt", [experiment]
        )

    def next_attempt(self, experiment: str, round: int, stage: str) -> int:
        if not self.exists():
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
        if not self.exists():
            return []
        return [r[0] for r in self.query("SELECT experiment_id FROM experiments ORDER BY experiment_id")[1]]

    def experiment_rounds(self, experiment: str) -> int | None:
        """The `rounds` of the experiment's stored config, or None if the store does not hold it."""
        if not self.exists():
            return None
        rows = self.query("SELECT config_json FROM experiments WHERE experiment_id=?", [experiment])[1]
        return int(json.loads(rows[0][0])["rounds"]) if rows else None

    def round_plan(self, experiment: str, round: int) -> list[int] | None:
        """The curriculum levels `set_round_plan` stored for the round, or None."""
        if not self.exists():
            return None
        rows = self.query("SELECT levels_json FROM round_plans WHERE experiment_id=? AND round=?",
                          [experiment, round])[1]
        return json.loads(rows[0][0]) if rows else None

    def committed_model(self, experiment: str, round: int, role: str = "policy") -> dict[str, Any] | None:
        """The `models` row of the round's committed model in that role, or None."""
        if not self.exists():
            return None
        rows = self.rows(
            "SELECT m.* FROM models m JOIN stage_runs s USING (stage_run_id) "
            "WHERE m.experiment_id=? AND m.round=? AND m.role=? AND s.status='committed'",
            [experiment, round, role],
        )
        return rows[0] if rows else None

    def stale_stages(self, experiment: str, round: int) -> list[str]:
        """The round's committed stages that a rerun of an earlier one made stale."""
        if not self.exists():
            return []
        return [r[0] for r in self.query("SELECT stage FROM stage_runs WHERE experiment_id=? AND round=? "
                                         "AND status='committed' AND stale ORDER BY started_at", [experiment, round])[1]]

    def newest_model_rounds(self, experiment: str) -> dict[str, int]:
        """{role: the newest round with a committed model in that role}: whose model is the live one."""
        if not self.exists():
            return {}
        return dict(self.query("SELECT m.role, max(m.round) FROM models m JOIN stage_runs s USING (stage_run_id) "
                               "WHERE m.experiment_id=? AND s.status='committed' GROUP BY m.role", [experiment])[1])

    def level_pass_rates(self, experiment: str, round: int) -> dict[int, float]:
        """{level: held-out greedy accuracy} from the round's committed evaluation; {} if none."""
        if not self.exists():
            return {}
        rows = self.query(
            "SELECT e.level, e.value FROM evaluations e JOIN stage_runs s USING (stage_run_id) "
            "WHERE e.experiment_id=? AND e.round=? AND e.metric='greedy_acc' AND e.level >= 0 "
            "AND s.status='committed' ORDER BY e.level",
            [experiment, round],
        )[1]
        return {int(level): float(value) for level, value in rows}

    def level_solved_shares(self, experiment: str, round: int) -> dict[int, float]:
        """{level: share of the round's sampled problems that a sample got right}, from its committed generate
        and verify attempts; {} if none."""
        if not self.exists():
            return {}
        rows = self.query(
            "SELECT t.level, count(DISTINCT t.problem_id) FILTER (WHERE v.correct) / count(DISTINCT t.problem_id) "
            "FROM trajectories t JOIN stage_runs g ON g.stage_run_id = t.stage_run_id AND g.status = 'committed' "
            "LEFT JOIN (SELECT v.trajectory_id, v.correct FROM verifications v JOIN stage_runs s USING (stage_run_id) "
            "           WHERE s.stage = 'verify' AND s.status = 'committed') v USING (trajectory_id) "
            "WHERE t.experiment_id=? AND t.round=? AND t.purpose = 'train' AND g.stage = 'generate' "
            "GROUP BY t.level ORDER BY t.level",
            [experiment, round],
        )[1]
        return {int(level): float(share) for level, share in rows}

    def evaluations(self, experiment: str) -> list[dict[str, Any]]:
        if not self.exists():
            return []
        return self.rows("SELECT * FROM evaluations WHERE experiment_id=? ORDER BY round, level, metric", [experiment])

    def round_summary(self, experiment: str, round: int | None = None) -> list[dict[str, Any]]:
        """`v_round_summary` rows of the experiment: the one round, or every round in order."""
        if not self.exists():
            return []
        if round is not None:
            return self.rows("SELECT * FROM v_round_summary WHERE experiment_id=? AND round=?", [experiment, round])
        return self.rows("SELECT * FROM v_round_summary WHERE experiment_id=? ORDER BY round", [experiment])

    def stage_timings(self, experiment: str, round: int) -> list[dict[str, Any]]:
        """Stage name and duration of the round's committed stage runs, in the order they started."""
        if not self.exists():
            return []
        return self.rows("SELECT stage, duration_s FROM stage_runs WHERE experiment_id=? AND round=? "
                         "AND status='committed' ORDER BY started_at", [experiment, round])

    def round_models(self, experiment: str, round: int) -> list[dict[str, Any]]:
        """The models the round trained, one row per role, in role order."""
        if not self.exists():
            return []
        return self.rows("SELECT model_id, role, uri, stage_run_id, train_examples FROM models "
                         "WHERE experiment_id=? AND round=? ORDER BY role", [experiment, round])

    def table_hashes(self, experiment: str) -> dict[str, tuple[int, str]]:
        """(row count, content hash) per data table for one experiment, independent of attempt numbers."""
        out = {}
        with self.reader() as con:
            for table in DATA_TABLES:
                cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()]
                n, h = con.execute(content_hash_sql(table, cols, experiment_filter(table)), [experiment]).fetchone()
                out[table] = (int(n), h)
        return out

    # -- writes (the flow is the single writer of an experiment) ------------------------------
    def _transaction(self, what: str, body: Callable[[duckdb.DuckDBPyConnection], T],
                     attempt: StageRunRef | None = None) -> T:
        """`body(con)` in one transaction, one snapshot; tried again whole while the catalog is busy (another
        experiment's writer). A stage attempt's commit names the attempt in its snapshot (`as_of`)."""
        def once() -> T:
            with self.writer() as con:
                con.execute("BEGIN TRANSACTION")
                try:
                    out = body(con)
                    if attempt is not None:
                        info = {"stage_run_id": attempt.stage_run_id, "experiment": attempt.experiment,
                                "round": attempt.round, "stage": attempt.stage, "attempt": attempt.attempt}
                        con.execute(f"CALL {lake.LAKE}.set_commit_message('coevo', ?, extra_info => ?)",
                                    [what, json.dumps(info)])
                    con.execute("COMMIT")
                    return out
                except BaseException:
                    with contextlib.suppress(duckdb.Error):
                        con.execute("ROLLBACK")
                    raise

        try:
            return lake.retry_busy(once, what, self.lock_timeout_s)
        except lake.LakeError as e:
            raise _locked(e) from None

    def _execute(self, what: str, sql: str, params: list[Any]) -> None:
        self._transaction(what, lambda con: con.execute(sql, params))

    def register_experiment(self, experiment: str, config_json: str, config_hash: str, seed: int, recipe: str,
                            code_version: str | None, extends: Callable[[str], bool] | None = None) -> bool:
        """Record the experiment's config, or check a resume against it. A different config is refused unless
        `extends(stored_config_json)` accepts it as a continuation (more rounds): then it replaces the stored
        one, and this returns True."""
        def body(con: duckdb.DuckDBPyConnection) -> bool:
            row = con.execute("SELECT config_hash, config_json FROM experiments WHERE experiment_id=?",
                              [experiment]).fetchone()
            if row and row[0] != config_hash and extends is not None and extends(row[1]):
                con.execute("UPDATE experiments SET config_json=?, config_hash=? WHERE experiment_id=?",
                            [config_json, config_hash, experiment])
                return True
            if row and row[0] != config_hash:
                raise StoreError(
                    f"experiment {experiment!r} already exists in {self.location.describe()} with config hash "
                    f"{row[0]}, not {config_hash}: use a new experiment name, resume it with its own config, or "
                    "raise only `rounds` to continue it"
                )
            if not row:
                con.execute(
                    "INSERT INTO experiments (experiment_id, config_json, config_hash, seed, recipe, code_version) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [experiment, config_json, config_hash, seed, recipe, code_version],
                )
            return False

        return self._transaction(f"register {experiment}", body)

    def set_round_plan(self, experiment: str, round: int, levels: list[int], reason: str) -> None:
        def body(con: duckdb.DuckDBPyConnection) -> None:
            con.execute("DELETE FROM round_plans WHERE experiment_id=? AND round=?", [experiment, round])
            con.execute("INSERT INTO round_plans VALUES (?, ?, ?, ?)", [experiment, round, json.dumps(levels), reason])

        self._transaction(f"plan {experiment}/r{round}", body)

    def start_stage_run(self, ref: StageRunRef, out_dir: str, spec_json: str, config_hash: str, seed: int,
                        prefect_task_run_id: str | None = None) -> None:
        def body(con: duckdb.DuckDBPyConnection) -> None:
            if con.execute("SELECT count(*) FROM stage_runs WHERE stage_run_id=?", [ref.stage_run_id]).fetchone()[0]:
                raise StoreError(f"stage run {ref.stage_run_id} already exists: attempts are never reused")
            con.execute(
                "INSERT INTO stage_runs (stage_run_id, experiment_id, round, stage, attempt, status, out_dir, "
                "spec_json, config_hash, seed, started_at, prefect_task_run_id) "
                "VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?, ?, now(), ?)",
                [ref.stage_run_id, ref.experiment, ref.round, ref.stage, ref.attempt, out_dir, spec_json,
                 config_hash, seed, prefect_task_run_id],
            )

        self._transaction(f"start {ref.stage_run_id}", body)

    def record_job(self, stage_run_id: str, shard: int, try_: int, worker: str | None, flow_run_id: str | None,
                   status: str, error: str | None, duration_s: float) -> None:
        """One try of a stage run's job (or of one of its shards): where it ran and how it ended."""
        def body(con: duckdb.DuckDBPyConnection) -> None:
            con.execute("DELETE FROM stage_jobs WHERE stage_run_id=? AND shard=? AND try=?", [stage_run_id, shard, try_])
            con.execute("INSERT INTO stage_jobs (stage_run_id, shard, try, worker, flow_run_id, status, error, "
                        "duration_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [stage_run_id, shard, try_, worker, flow_run_id, status, (error or "")[-4000:] or None,
                         duration_s])

        self._transaction(f"job {stage_run_id} shard {shard} try {try_}", body)

    def stage_jobs(self, stage_run_id: str) -> list[dict[str, Any]]:
        """The job tries of a stage run, by shard and try."""
        if not self.exists():
            return []
        return self.rows("SELECT * FROM stage_jobs WHERE stage_run_id=? ORDER BY shard, try", [stage_run_id])

    def fail_stage_run(self, ref: StageRunRef, error: str) -> None:
        self._execute(f"fail {ref.stage_run_id}",
                      "UPDATE stage_runs SET status='failed', error=?, finished_at=now(), "
                      "duration_s=epoch(now() - started_at) WHERE stage_run_id=?", [error[-4000:], ref.stage_run_id])

    def fail_dangling_runs(self, experiment: str) -> int:
        """Mark attempts left `running` by a killed flow as failed (called at resume)."""
        if not self.exists():
            return 0

        def body(con: duckdb.DuckDBPyConnection) -> int:
            n = con.execute("SELECT count(*) FROM stage_runs WHERE experiment_id=? AND status='running'",
                            [experiment]).fetchone()[0]
            if n:
                con.execute("UPDATE stage_runs SET status='failed', error='abandoned: the flow process ended before "
                            "this attempt finished', finished_at=now() WHERE experiment_id=? AND status='running'",
                            [experiment])
            return int(n)

        return self._transaction(f"settle {experiment}", body)

    def commit(self, ref: StageRunRef, manifest_path: Path, mlflow_run_id: str | None = None,
               later_stages: Sequence[str] = ()) -> Manifest:
        """Ingest a finished job's Parquet and flip statuses, all in one transaction: one snapshot, which
        `as_of` finds by the attempt's name.

        The manifest is verified (file sizes and sha256) before anything is written, so a corrupt
        or truncated part fails the commit with nothing visible; so does a row whose key another row holds.
        Where this attempt supersedes a committed one (a rerun), everything computed from the old one becomes
        stale in the same transaction: the round's `later_stages` and every stage of the later rounds.
        `coevo resume` recomputes them.
        """
        manifest = verify_manifest(manifest_path)
        if (manifest.experiment, manifest.round, manifest.stage, manifest.attempt) != (
            ref.experiment, ref.round, ref.stage, ref.attempt,
        ):
            raise ManifestError(f"{manifest_path}: manifest is for {manifest.stage_run_id}, expected {ref.stage_run_id}")
        out_dir = manifest_path.parent
        for out in manifest.outputs:
            if out["table"] not in DATA_TABLES:
                raise ManifestError(f"{manifest_path}: unknown output table {out['table']!r}")
        # The parts the store takes in as they are: a copy of each, in its table's folder, added to the table.
        adopt = {part_path(out_dir, o["path"]) for o in manifest.outputs
                 if _adoptable(part_path(out_dir, o["path"]), o["table"], ref)}
        placed: dict[str, str] = {}  # part: its copy in the store, made once, whatever the retries

        def take_in(con: duckdb.DuckDBPyConnection, table: str, part: str) -> None:
            if part not in placed:
                if table not in self._folders:
                    self._folders[table] = lake.table_folder(con, table)
                dest = f"{self._folders[table]}coevo-{uuid.uuid4().hex}.parquet"
                storage.put_file(Path(part), dest)
                placed[part] = dest
            con.execute("CALL ducklake_add_data_files(?, ?, ?)", [lake.LAKE, table, placed[part]])

        parts: dict[str, list[str]] = {}  # table: its parts (a sharded stage has a part per shard)
        for out in manifest.outputs:
            parts.setdefault(out["table"], []).append(part_path(out_dir, out["path"]))

        def body(con: duckdb.DuckDBPyConnection) -> None:
            # This attempt committed, and the round's earlier committed attempt of the stage, if any, superseded,
            # in one statement: each statement on a lake table costs a few ms of catalog reads.
            touched = con.execute(
                "UPDATE stage_runs SET status = CASE WHEN stage_run_id = $id THEN 'committed' ELSE 'superseded' END, "
                "stale = CASE WHEN stage_run_id = $id THEN false ELSE stale END, "
                "manifest_sha256 = CASE WHEN stage_run_id = $id THEN $sha ELSE manifest_sha256 END, "
                "rows_json = CASE WHEN stage_run_id = $id THEN $rows ELSE rows_json END, "
                "metrics_json = CASE WHEN stage_run_id = $id THEN $metrics ELSE metrics_json END, "
                "finished_at = CASE WHEN stage_run_id = $id THEN now() ELSE finished_at END, "
                "duration_s = CASE WHEN stage_run_id = $id THEN $duration ELSE duration_s END, "
                "pid = CASE WHEN stage_run_id = $id THEN $pid ELSE pid END, "
                "mlflow_run_id = CASE WHEN stage_run_id = $id THEN coalesce($mlflow, mlflow_run_id) ELSE mlflow_run_id END, "
                "error = CASE WHEN stage_run_id = $id THEN NULL ELSE error END "
                "WHERE stage_run_id = $id OR (experiment_id = $exp AND round = $round AND stage = $stage "
                "AND status = 'committed')",
                {"id": ref.stage_run_id, "sha": manifest.sha256,
                 "rows": json.dumps({o["table"]: o["rows"] for o in manifest.outputs}),
                 "metrics": json.dumps(manifest.metrics, sort_keys=True), "duration": manifest.timings.get("total_s"),
                 "pid": manifest.pid, "mlflow": mlflow_run_id, "exp": ref.experiment, "round": ref.round,
                 "stage": ref.stage},
            ).fetchone()[0]
            if touched == 0:
                raise StoreError(f"stage run {ref.stage_run_id} was never started (start_stage_run)")
            if touched > 1:  # a rerun: the superseded attempt's rows go, and what was computed from them is stale
                # (with those of any attempt superseded before, which are gone already: DuckLake has no RETURNING)
                old = [r[0] for r in con.execute(
                    "SELECT stage_run_id FROM stage_runs WHERE experiment_id=? AND round=? AND stage=? "
                    "AND status='superseded'", [ref.experiment, ref.round, ref.stage]).fetchall()]
                for table in DATA_TABLES:  # problems carry no stage run: shared by every run that drew them, they stay
                    if "stage_run_id" in TABLES[table].names:  # a list of constants: DuckLake skips the other files
                        con.execute(f"DELETE FROM {table} WHERE stage_run_id IN ({', '.join('?' * len(old))})", old)
                con.execute(
                    "UPDATE stage_runs SET stale=true WHERE experiment_id=? AND status='committed' "
                    "AND (round > ? OR (round = ? AND list_contains(?, stage)))",
                    [ref.experiment, ref.round, ref.round, list(later_stages)])
            # Anchors first: a part's rows are checked against the trajectories and models of this commit too.
            for table in sorted(parts, key=lambda t: t not in ANCHORS):
                select = ", ".join(SCHEMAS[table].names)
                if "stage_run_id" in TABLES[table].names:
                    _check_parts(con, table, parts[table], ref)  # all of the table's parts in one pass
                    for part in parts[table]:
                        if part in adopt:
                            take_in(con, table, part)
                        else:  # a part of an older coevo, without its attempt's id: rewritten with it
                            con.execute(f"INSERT INTO {table} ({select}, stage_run_id) "
                                        f"SELECT {select}, ? FROM read_parquet(?)", [ref.stage_run_id, part])
                else:  # problems: a problem another run already drew is kept as it is
                    key = ", ".join(TABLES[table].key)
                    con.execute(f"INSERT INTO {table} ({select}) SELECT {select} FROM (SELECT DISTINCT ON ({key}) * "
                                f"FROM read_parquet(?)) AS p WHERE ({key}) NOT IN (SELECT {key} FROM {table})",
                                [parts[table]])

        try:
            self._transaction(f"commit {ref.stage_run_id}", body, attempt=ref)
        except BaseException as e:
            for dest in placed.values():  # nothing committed: the copies are no one's
                with contextlib.suppress(OSError, storage.StorageError):
                    storage.remove(dest)
            if isinstance(e, duckdb.Error):
                raise StoreError(f"commit of {ref.stage_run_id} failed, nothing committed: {e}") from e
            raise
        return manifest

    def set_mlflow_run(self, stage_run_id: str, mlflow_run_id: str) -> None:
        self._execute(f"mlflow run of {stage_run_id}", "UPDATE stage_runs SET mlflow_run_id=? WHERE stage_run_id=?",
                      [mlflow_run_id, stage_run_id])

    def set_model_registration(self, model_id: str, name: str, version: str, mlflow_run_id: str | None) -> None:
        self._execute(f"register {model_id}",
                      "UPDATE models SET registered_name=?, registered_version=?, mlflow_run_id=? WHERE model_id=?",
                      [name, version, mlflow_run_id, model_id])


def _adoptable(part: str, table: str, ref: StageRunRef) -> bool:
    """Whether the store can take `part` in as it is, by its footer: written as the store keeps the table
    (`PARTS`: the columns, their types, the attempt's `stage_run_id`) and with no NULL where the table has NOT
    NULL, which a file added to a DuckLake is not checked for. A part of an older coevo, which has no
    `stage_run_id`, is not; one that names another attempt is refused."""
    meta = pq.ParquetFile(part).metadata
    schema = meta.schema.to_arrow_schema()
    if "stage_run_id" not in schema.names:
        return False
    not_null = {c.name for c in TABLES[table].columns if not c.nullable}
    ok = schema == PARTS[table] and meta.num_rows > 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i in range(group.num_columns):
            column = group.column(i)
            name, stats = column.path_in_schema, column.statistics
            if name == "stage_run_id":
                if stats is None or not stats.has_min_max or stats.null_count != 0:
                    ok = False
                elif (stats.min, stats.max) != (ref.stage_run_id, ref.stage_run_id):
                    raise ManifestError(f"{part}: its rows name attempt {stats.min!r}"
                                        f"{'' if stats.max == stats.min else f' to {stats.max!r}'}, but it is "
                                        f"committed as {ref.stage_run_id!r}")
            elif name in not_null and (stats is None or not stats.has_null_count or stats.null_count != 0):
                ok = False  # a NULL key, or no statistics to tell: rewritten, where NOT NULL is checked
    return ok


# Tables whose key is unique store-wide, checked against the whole table: every other row names one of their
# rows, or its experiment and round, and so belongs to that round.
ANCHORS = ("trajectories", "models")


def _owner(table: str) -> str | None:
    """How a row of `table` names the experiment and round it belongs to: through its model, its trajectory or
    its own columns; None for an anchor (or a table with none of them), whose keys are checked store-wide."""
    key = TABLES[table].key
    if table in ANCHORS:
        return None
    if "model_id" in key:
        return "models"
    if "trajectory_id" in key:
        return "trajectories"
    if {"experiment_id", "round"} <= set(key):
        return "columns"
    return None


def _check_parts(con: duckdb.DuckDBPyConnection, table: str, parts: list[str], ref: StageRunRef) -> None:
    """Refuse a commit's parts of `table` whose rows are not of the attempt's own experiment and round, or
    repeat a key among themselves or against the table (DuckLake has no PRIMARY KEY). The parts are read
    together: one statement per check, whatever the shards.

    Each row belongs to one round: an anchor's row is its own, a step's or score's is its trajectory's, a model
    input's is its model's, an evaluation names it. Every commit holds its rows to its own round, so a key can
    only meet its equal in rows of that round, and the check reads only those: the files of the round's stage
    runs, which DuckLake finds by their `stage_run_id` range without opening the others. The anchors' keys,
    which the rest lean on, are checked against the whole table."""
    key = ", ".join(TABLES[table].key)
    where = f"{table}: every row of {ref.stage_run_id} must belong to experiment {ref.experiment!r}, round {ref.round}"
    owner = _owner(table)
    if owner is None:  # an anchor: its parts' keys, then the whole table's
        dup = _repeated(con, key, f"SELECT {key} FROM read_parquet(?)", [parts])
        if dup is None:
            dup = con.execute(f"SELECT {key} FROM {table} SEMI JOIN read_parquet(?) AS p USING ({key}) LIMIT 1",
                              [parts]).fetchone()
    else:  # the parts' keys and the round's, in one pass
        prefix = f"{ref.experiment}/r{ref.round}/"  # exactly the ids in [prefix, prefix less '/' plus '0')
        rows, params = (f"SELECT {key} FROM read_parquet(?) UNION ALL "
                        f"SELECT {key} FROM {table} WHERE stage_run_id >= ? AND stage_run_id < ?",
                        [parts, prefix, prefix[:-1] + "0"])
        hashes = None
        if owner == "columns":
            bad = con.execute("SELECT experiment_id, round FROM read_parquet(?) WHERE experiment_id <> ? OR round <> ? "
                              "LIMIT 1", [parts, ref.experiment, ref.round]).fetchone()
            if bad is not None:
                raise duckdb.ConstraintException(f"Constraint Error: {where}; a row names {bad!r}")
        else:  # with the key check's first pass: one statement on the lake, not two
            col = "model_id" if owner == "models" else "trajectory_id"
            bad, hashes = con.execute(
                f"SELECT (SELECT p.{col} FROM read_parquet(?) AS p ANTI JOIN (SELECT {col} FROM {owner} "
                f"WHERE experiment_id = ? AND round = ?) AS o USING ({col}) LIMIT 1), ({_twice(key, rows)})",
                [parts, ref.experiment, ref.round, *params]).fetchone()
            if bad is not None:
                raise duckdb.ConstraintException(f"Constraint Error: {where}; {col} {bad!r} is not one of its "
                                                 f"{owner}")
        dup = _repeated(con, key, rows, params, hashes)
    if dup is not None:
        raise duckdb.ConstraintException(f"Constraint Error: duplicate key ({key}) = {dup!r} in {table}: the key "
                                         "is already in the store or repeated in the parts")


_MOST = 1000  # candidate hashes compared at once; where all of them prove collisions, every key is compared


def _twice(key: str, rows: str) -> str:
    """SQL for the list of `key` hashes that the query `rows` yields more than once (at most `_MOST`; empty for
    none): the first pass of `_repeated`."""
    return (f"SELECT coalesce(list(h), []) FROM (SELECT hash({key}) AS h FROM ({rows}) GROUP BY h HAVING count(*) > 1 "
            f"LIMIT {_MOST})")


def _repeated(con: duckdb.DuckDBPyConnection, key: str, rows: str, params: list[Any],
              hashes: list[int] | None = None) -> tuple | None:
    """A `key` that the query `rows` yields more than once, or None. The rows are grouped by a 64-bit hash of the
    key, faster than by the key's own columns (a part of 5M steps: 0.59 s against 0.98 s), and only the keys of a
    hash seen twice are compared (two keys share a hash by a collision alone, about once in 10^6 commits of 5M
    rows). `hashes`: the first pass's result (`_twice`) where the caller ran it within another statement."""
    if hashes is None:
        hashes = con.execute(_twice(key, rows), params).fetchone()[0]
    if not hashes:
        return None
    dup = con.execute(f"SELECT {key} FROM ({rows}) WHERE hash({key}) IN (SELECT unnest(?::UBIGINT[])) GROUP BY ALL "
                      "HAVING count(*) > 1 LIMIT 1", [*params, hashes]).fetchone()
    if dup is None and len(hashes) == _MOST:
        dup = con.execute(f"SELECT {key} FROM ({rows}) GROUP BY ALL HAVING count(*) > 1 LIMIT 1", params).fetchone()
    return dup


# A model id's attempt (`<exp>/<role>/r<round>/a<k>`), which content hashes read the id without.
ATTEMPT_SUFFIX = r"/a[0-9]+$"
# Columns that say which attempt wrote a row, where its files lie, or where MLflow tracks it: not what it holds.
ATTEMPT_COLUMNS = ("stage_run_id", "uri", "mlflow_run_id", "registered_name", "registered_version")
# Columns that time the work (a turn's wall time): a rerun of the same work measures them anew.
MEASURED_COLUMNS = ("latency_s",)
# What content hashes leave out.
NOT_CONTENT = ATTEMPT_COLUMNS + MEASURED_COLUMNS


def content_hash_sql(table: str, columns: Sequence[str], where: str) -> str:
    """`SELECT count(*), <hash>` over the table's rows that match `where`: a row's content is its columns less
    `NOT_CONTENT`, with model ids read without their `/a<attempt>` (a rerun's model is the same content
    under a new id)."""
    exprs = [f"regexp_replace({c}, '{ATTEMPT_SUFFIX}', '')" if c.endswith("model_id") else c
             for c in columns if c not in NOT_CONTENT]
    row = f"CAST(row({', '.join(exprs)}) AS VARCHAR)"
    return f"SELECT count(*), coalesce(md5(string_agg({row}, '|' ORDER BY {row})), '') FROM {table} WHERE {where}"


def experiment_filter(table: str) -> str:
    """A SQL condition, with one `?` for the experiment id, that picks the table's rows of one experiment."""
    if table == "problems":
        return "problem_id IN (SELECT problem_id FROM trajectories WHERE experiment_id = ?)"
    if table in ("model_inputs", "rollout_logprobs"):
        return "model_id IN (SELECT model_id FROM models WHERE experiment_id = ?)"
    if table == "stage_jobs":
        return "stage_run_id IN (SELECT stage_run_id FROM stage_runs WHERE experiment_id = ?)"
    if table in ("steps", "verifications", "step_labels", "step_pairs", "scores", "trajectory_sources", "turns"):
        return "trajectory_id IN (SELECT trajectory_id FROM trajectories WHERE experiment_id = ?)"
    return "experiment_id = ?"
