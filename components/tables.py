"""Every store table, declared once: its columns (Arrow type, nullability) and its key.

    from components.tables import TABLES, to_table
    to_table("steps", [{"trajectory_id": "t", "step_index": 0, "text": "1+1=2"}])

The store builds its DuckDB tables from these declarations (`components.store`), and stage jobs
write Parquet with the Arrow schemas derived from them (`SCHEMAS`; a part adds the attempt's
`stage_run_id`, `PARTS`). Fixed schemas (rather than inferred ones) keep Parquet bytes identical across
runs, but for the column that names the attempt, and make a job that produces a wrong column fail in the
job, not at commit. Columns are decided here even for tables that later stages fill
(reward models, DPO pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa

STR, INT, BIGINT, FLOAT, BOOL, TIME = pa.string(), pa.int32(), pa.int64(), pa.float64(), pa.bool_(), pa.timestamp("us")
IDS = pa.list_(pa.int32())  # token ids


class Column(NamedTuple):
    name: str
    type: pa.DataType
    nullable: bool = True
    default: str | None = None  # a DuckDB expression, for columns the store fills itself


def col(name: str, type: pa.DataType, *, null: bool = True, default: str | None = None) -> Column:
    return Column(name, type, null, default)


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    # Written by stage jobs as Parquet (the writer adds `stage_run_id`) and ingested by `Store.commit`.
    job_output: bool = True

    def __post_init__(self):
        names = [c.name for c in self.columns]
        nullable_key = [c.name for c in self.columns if c.name in self.key and c.nullable]
        if set(self.key) - set(names) or nullable_key:
            raise ValueError(f"table {self.name}: key {self.key} must name non-null columns of {names}")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def arrow_schema(self) -> pa.Schema:
        """The rows a stage builds: every column but `stage_run_id`, the attempt's, which the part's writer adds.
        Every field stays nullable: NOT NULL is the store's to enforce, at commit."""
        return pa.schema([(c.name, c.type) for c in self.columns if c.name != "stage_run_id"])

    def part_schema(self) -> pa.Schema:
        """A job's Parquet part: the rows, then the attempt's `stage_run_id` where the table keeps one, so that
        the store can take the file in as it is (`Store.commit`)."""
        schema = self.arrow_schema()
        return schema.append(pa.field("stage_run_id", STR)) if "stage_run_id" in self.names else schema


def _table(name: str, key: tuple[str, ...], *columns: Column, job_output: bool = True) -> Table:
    return Table(name, columns, key, job_output)


_STAGE_RUN = col("stage_run_id", STR, null=False)

# Column order is the store's (`SELECT *`, and the row hashes of `Store.table_hashes`): reorder nothing.
# The store runs CREATE TABLE IF NOT EXISTS, so a column added here does not reach an existing store.
TABLES: dict[str, Table] = {t.name: t for t in [
    _table(
        "experiments", ("experiment_id",),
        col("experiment_id", STR, null=False),
        col("config_json", STR, null=False),
        col("config_hash", STR, null=False),
        col("seed", BIGINT, null=False),
        col("recipe", STR, null=False),
        col("code_version", STR),
        col("created_at", TIME, default="current_timestamp"),
        job_output=False,
    ),
    _table(
        "stage_runs", ("stage_run_id",),
        col("stage_run_id", STR, null=False),  # <experiment>/r<round>/<stage>/a<attempt>
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("stage", STR, null=False),
        col("attempt", INT, null=False),
        col("status", STR, null=False),  # running | committed | failed | superseded
        col("stale", BOOL, default="false"),  # an upstream stage of the round was rerun after this committed
        col("out_dir", STR),
        col("spec_json", STR),
        col("manifest_sha256", STR),
        col("config_hash", STR),
        col("seed", BIGINT),
        col("rows_json", STR),
        col("metrics_json", STR),
        col("started_at", TIME),
        col("finished_at", TIME),
        col("duration_s", FLOAT),
        col("error", STR),
        col("pid", INT),
        col("mlflow_run_id", STR),
        col("prefect_task_run_id", STR),
        job_output=False,
    ),
    _table(  # one row per try of a stage run's job, or of each shard's: where it ran and how it ended
        "stage_jobs", ("stage_run_id", "shard", "try"),
        col("stage_run_id", STR, null=False),
        col("shard", INT, null=False),  # 0 where the stage is not sharded
        col("try", INT, null=False),  # 1, then 2.. where a shard was retried alone
        col("worker", STR),  # the Prefect worker that ran it, or local:<host>
        col("flow_run_id", STR),  # its flow run of the `stage-job` deployment, where it ran on a work pool
        col("status", STR, null=False),  # published | failed
        col("error", STR),
        col("duration_s", FLOAT),
        col("finished_at", TIME, default="current_timestamp"),
        job_output=False,
    ),
    _table(
        "problems", ("problem_id",),
        col("problem_id", STR, null=False),  # content hash
        col("domain", STR, null=False),
        col("level", INT),
        col("prompt", STR, null=False),
        col("answer", STR, null=False),
        col("meta_json", STR),
        col("split", STR),  # train | test; no stage_run_id: a problem is shared by every run that draws it
    ),
    _table(
        "trajectories", ("trajectory_id",),
        col("trajectory_id", STR, null=False),
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("purpose", STR, null=False),  # train (generate) | eval (evaluate) | demo (bootstrap) | hindsight (filter)
        col("problem_id", STR, null=False),
        col("level", INT),
        col("policy_model_id", STR),
        col("sample_index", INT, null=False),
        col("prompt", STR, null=False),
        col("completion", STR, null=False),
        col("answer", STR),  # extracted final answer, NULL if none
        col("num_tokens", INT, null=False),
        col("finish_reason", STR),
        col("temperature", FLOAT),
        col("top_p", FLOAT),
        col("max_new_tokens", INT),
        col("seed", BIGINT),
        _STAGE_RUN,
        # The completion's ids as sampled, EOS included, where the backend returned them (NULL: references,
        # imports, agent episodes, whose ids are in `turns`): what grpo trains on.
        col("token_ids", IDS),
    ),
    _table(
        "steps", ("trajectory_id", "step_index"),
        col("trajectory_id", STR, null=False),
        col("step_index", INT, null=False),
        col("text", STR, null=False),
        _STAGE_RUN,
    ),
    _table(
        "verifications", ("trajectory_id", "verifier"),
        col("trajectory_id", STR, null=False),
        col("verifier", STR, null=False),
        col("verifier_version", STR, null=False),
        col("correct", BOOL),  # NULL: verifier not applicable
        col("reward", FLOAT),
        col("detail", STR),
        _STAGE_RUN,
    ),
    _table(
        "step_labels", ("trajectory_id", "step_index", "source"),
        col("trajectory_id", STR, null=False),
        col("step_index", INT, null=False),
        col("source", STR, null=False),  # mc_hard | mc_soft | tree_hard | tree_soft | oracle | judge | implicit
        col("value", FLOAT, null=False),
        col("num_rollouts", INT),
        _STAGE_RUN,
    ),
    _table(
        "scores", ("trajectory_id", "scorer", "step_index", "aggregate"),
        col("trajectory_id", STR, null=False),
        col("scorer", STR, null=False),  # outcome | prm | orm | implicit_prm
        col("model_id", STR),  # reward model version, NULL for the verifier outcome
        col("step_index", INT, null=False),  # -1: the whole trajectory
        col("aggregate", STR, null=False),  # step | min | last | mean | outcome
        col("value", FLOAT, null=False),
        _STAGE_RUN,
    ),
    _table(
        "selections", ("trajectory_id", "purpose"),
        col("trajectory_id", STR, null=False),
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("purpose", STR, null=False),  # policy_sft | dpo_chosen | dpo_rejected | step_dpo | reward_train
        col("selected", BOOL, null=False),
        col("rank", INT),
        col("reason", STR, null=False),
        col("pair_id", STR),
        _STAGE_RUN,
    ),
    _table(
        "models", ("model_id",),
        col("model_id", STR, null=False),  # <experiment>/<role>/r<round>/a<attempt>; older stores: no /a<attempt>
        col("experiment_id", STR, null=False),
        col("role", STR, null=False),  # policy | prm | orm
        col("round", INT, null=False),
        col("uri", STR, null=False),
        col("sha256", STR, null=False),
        col("parent_model_id", STR),
        col("train_examples", INT),
        col("mlflow_run_id", STR),
        col("registered_name", STR),
        col("registered_version", STR),
        _STAGE_RUN,
    ),
    _table(
        # Exactly which trajectories trained which model.
        "model_inputs", ("model_id", "trajectory_id"),
        col("model_id", STR, null=False),
        col("trajectory_id", STR, null=False),
        col("source_round", INT, null=False),  # the round whose selection it came from
        # new | replay | dpo_chosen | dpo_rejected | step_dpo_rejected | step_dpo_chosen | grpo | ptx | grpo+ptx
        col("use", STR, null=False),
        _STAGE_RUN,
    ),
    _table(
        "evaluations", ("experiment_id", "round", "level", "metric"),
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("model_id", STR, null=False),
        col("level", INT, null=False),  # -1: all levels
        col("metric", STR, null=False),  # greedy_acc | maj_at_<k> | pass_at_<k> | ...
        col("value", FLOAT, null=False),
        col("n", INT, null=False),
        _STAGE_RUN,
    ),
    _table(
        # Where an imported trajectory came from (`coevo import`): its file, row and model, the label it
        # came with (re-verified, never trusted: `verifications` holds the domain's verdict), and the
        # text as written where the domain's normalisation changed it.
        "trajectory_sources", ("trajectory_id",),
        col("trajectory_id", STR, null=False),
        col("source_file", STR, null=False),
        col("source_row", INT, null=False),  # 1-based: the line of a JSONL file, the row of a Parquet file
        col("source_model", STR),
        col("given_correct", BOOL),
        col("original_completion", STR),  # NULL: stored as written
        _STAGE_RUN,
    ),
    _table(
        # Step-level preference pairs (score). From the Monte Carlo search (mc_strategy first_error): at a wrong
        # trajectory's first dead step, a continuation that reached the answer from the live prefix before it
        # (chosen) against the trajectory's own (rejected). From an MCTS tree (score.tree): a right trajectory
        # whose path parts from the wrong one's at siblings apart in Q. prefix + chosen and prefix + rejected are
        # whole solutions; the filter selects the pairs (`selections`, purpose step_dpo), train_policy trains on them.
        "step_pairs", ("trajectory_id",),
        col("trajectory_id", STR, null=False),  # the wrong trajectory: the rejected side
        col("step_index", INT, null=False),  # its first dead step; from a tree, the first step the sides differ in
        col("prefix", STR, null=False),  # the steps before it, as text: the live prefix both sides share
        col("chosen", STR, null=False),
        col("rejected", STR, null=False),
        col("chosen_from", STR, null=False),  # 'rollout', or the right trajectory's id
        col("source", STR),  # mc | tree (NULL in stores before schema 7: mc)
        col("chosen_q", FLOAT),  # tree: the Q of the siblings where the sides part
        col("rejected_q", FLOAT),
        _STAGE_RUN,
    ),
    _table(
        # An agent's episode turn by turn (components.envs): its prompt messages, each assistant turn as generated,
        # and each observation (a tool's result or the environment's feedback). The trajectory's steps are its
        # assistant turns, so labels, scores and selections treat an episode as any other trajectory.
        "turns", ("trajectory_id", "turn_index"),
        col("trajectory_id", STR, null=False),
        col("turn_index", INT, null=False),  # 0, 1, ... in the order the model saw them
        col("role", STR, null=False),  # system | user | assistant | tool
        col("content", STR, null=False),  # the text as generated or observed (an observation after its cut)
        col("tool_name", STR),  # a tool turn's tool; 'invalid' for a call the format could not read
        col("tool_arguments", STR),  # its JSON arguments
        col("tool_ok", BOOL),  # a tool turn: did the call run (False: malformed, unknown, wrong arguments, failed)
        col("error", STR),  # why it did not; on an episode's last turn, the traceback of an environment that raised
        col("reward", FLOAT),  # an assistant turn's own reward; the last one's is the outcome
        col("num_tokens", INT),  # an assistant turn's generated tokens
        col("finish_reason", STR),  # an assistant turn's: stop | length | ...
        col("latency_s", FLOAT),  # generating an assistant turn, or running a tool
        col("truncated", BOOL),  # an observation cut at the environment's max_observation_chars
        col("token_ids", IDS),  # an assistant turn's ids as sampled, its turn end included: what training reads
        _STAGE_RUN,
    ),
    _table(
        # A grpo round's learning signal (components.rl), one row per rollout (turn_index -1) and, for an agent's
        # episode, per assistant turn, or with train_policy.grpo.credit=step, per step: its rewards, its group's
        # mean and std, and the advantage train_policy feeds TRL's loss for those tokens. `kept` is false for a
        # group the filter dropped (no signal, or over the cap).
        "advantages", ("trajectory_id", "turn_index"),
        col("trajectory_id", STR, null=False),
        col("turn_index", INT, null=False),  # -1: the whole rollout; else an agent's turn (`turns`) or a step (`steps`)
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("group_id", STR, null=False),  # the problem: a group is its samples_per_problem rollouts
        col("outcome", FLOAT, null=False),  # the verifier's reward
        col("shaping", FLOAT, null=False),  # the dense reward added to it (0 without shaping)
        col("reward", FLOAT, null=False),  # outcome + shaping: what the group normalises
        col("group_size", INT, null=False),
        col("group_mean", FLOAT, null=False),
        col("group_std", FLOAT),  # the sample std (Bessel), as TRL's; NULL for a group of one
        col("advantage", FLOAT, null=False),
        col("kept", BOOL, null=False),
        col("reason", STR, null=False),  # why kept or dropped
        col("process", FLOAT),  # credit=step: the step's reward (reward-model score or mc_soft); NULL otherwise
        col("process_return", FLOAT),  # credit=step: the sum of the group-normalised step rewards from it on
        # filter.check_steps: the domain's step checker on a right answer (false: `outcome` is 0, not the
        # verifier's reward); NULL for a wrong answer or without the checker
        col("steps_checked", BOOL),
        _STAGE_RUN,
    ),
    _table(
        # What a grpo round's training did to each rollout it trained on: the summed log-probability of the
        # tokens the model sampled, under the policy that sampled them and under the policy trained on them.
        "rollout_logprobs", ("model_id", "trajectory_id"),
        col("model_id", STR, null=False),  # the trained policy
        col("trajectory_id", STR, null=False),
        col("tokens", INT, null=False),  # the sampled tokens the sums run over (observations left out)
        col("old_logprob", FLOAT, null=False),  # under the round's starting policy: the sampler
        col("new_logprob", FLOAT, null=False),  # under the trained policy
        _STAGE_RUN,
    ),
    _table(
        # A search tree (generate.mcts, or score.tree.search around a round's samples), one row per node: the root is the problem (node 0, no step), every other
        # node one step the policy drew. Q is the mean backed-up value (verifier's reward at terminal nodes, the
        # value source's elsewhere). A node the search returned names the trajectory it became: a terminal leaf,
        # or, where fewer leaves ended than generate asked for, a node completed by the rollout that valued it.
        "nodes", ("tree_id", "node_id"),
        col("tree_id", STR, null=False),  # one per problem and stage: hash of experiment, round, purpose, problem
        col("node_id", INT, null=False),  # 0 is the root; ids grow in creation order
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("purpose", STR, null=False),  # train (generate.mcts) or label (score.tree.search)
        col("problem_id", STR, null=False),
        col("parent_id", INT),  # NULL at the root
        col("step_text", STR, null=False),  # this node's step; '' at the root
        col("depth", INT, null=False),  # steps from the root
        col("prior", FLOAT, null=False),  # the policy's share among its siblings (of the K draws, the duplicates')
        col("visits", INT, null=False),
        col("q", FLOAT),  # mean backed-up value; NULL where never visited
        col("value", FLOAT),  # the value source's first estimate of a non-terminal node
        col("terminal", BOOL, null=False),  # ends the solution: the answer line, EOS, or the step cap
        col("reward", FLOAT),  # the verifier's, at a terminal node
        col("tokens", INT, null=False),  # generated for this step, its duplicate draws included
        # What it became: a returned terminal leaf, or a node its rollout completed; in score's trees, the leaf of a
        # sample (the first by id, where samples repeat)
        col("trajectory_id", STR),
        _STAGE_RUN,
    ),
    _table(
        "round_plans", ("experiment_id", "round"),
        col("experiment_id", STR, null=False),
        col("round", INT, null=False),
        col("levels_json", STR, null=False),  # curriculum decision for the round
        col("reason", STR),
        job_output=False,
    ),
]}

# A commit ingests these and replaces the rows of the superseded attempt (problems are only added).
DATA_TABLES: tuple[str, ...] = tuple(name for name, t in TABLES.items() if t.job_output)
SCHEMAS: dict[str, pa.Schema] = {name: TABLES[name].arrow_schema() for name in DATA_TABLES}
PARTS: dict[str, pa.Schema] = {name: TABLES[name].part_schema() for name in DATA_TABLES}


def to_table(name: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Rows to an Arrow table with the fixed schema; a missing or extra column is an error here."""
    schema = SCHEMAS[name]
    for i, r in enumerate(rows[:1]):
        extra = set(r) - set(schema.names)
        missing = set(schema.names) - set(r)
        if extra or missing:
            raise ValueError(f"table {name}, row {i}: extra columns {sorted(extra)}, missing {sorted(missing)}")
    return pa.Table.from_pylist(rows, schema=schema)
