"""Arrow schemas of the rows stage jobs write; each mirrors a store table without `stage_run_id`.

Fixed schemas (rather than inferred ones) keep Parquet bytes identical across runs and make a job
that produces a wrong column fail in the job, not at commit.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

SCHEMAS: dict[str, pa.Schema] = {
    "problems": pa.schema([
        ("problem_id", pa.string()), ("domain", pa.string()), ("level", pa.int32()), ("prompt", pa.string()),
        ("answer", pa.string()), ("meta_json", pa.string()), ("split", pa.string()),
    ]),
    "trajectories": pa.schema([
        ("trajectory_id", pa.string()), ("experiment_id", pa.string()), ("round", pa.int32()),
        ("purpose", pa.string()), ("problem_id", pa.string()), ("level", pa.int32()),
        ("policy_model_id", pa.string()), ("sample_index", pa.int32()), ("prompt", pa.string()),
        ("completion", pa.string()), ("answer", pa.string()), ("num_tokens", pa.int32()),
        ("finish_reason", pa.string()), ("temperature", pa.float64()), ("top_p", pa.float64()),
        ("max_new_tokens", pa.int32()), ("seed", pa.int64()),
    ]),
    "steps": pa.schema([("trajectory_id", pa.string()), ("step_index", pa.int32()), ("text", pa.string())]),
    "verifications": pa.schema([
        ("trajectory_id", pa.string()), ("verifier", pa.string()), ("verifier_version", pa.string()),
        ("correct", pa.bool_()), ("reward", pa.float64()), ("detail", pa.string()),
    ]),
    "step_labels": pa.schema([
        ("trajectory_id", pa.string()), ("step_index", pa.int32()), ("source", pa.string()),
        ("value", pa.float64()), ("num_rollouts", pa.int32()),
    ]),
    "scores": pa.schema([
        ("trajectory_id", pa.string()), ("scorer", pa.string()), ("model_id", pa.string()),
        ("step_index", pa.int32()), ("aggregate", pa.string()), ("value", pa.float64()),
    ]),
    "selections": pa.schema([
        ("trajectory_id", pa.string()), ("experiment_id", pa.string()), ("round", pa.int32()),
        ("purpose", pa.string()), ("selected", pa.bool_()), ("rank", pa.int32()), ("reason", pa.string()),
        ("pair_id", pa.string()),
    ]),
    "models": pa.schema([
        ("model_id", pa.string()), ("experiment_id", pa.string()), ("role", pa.string()), ("round", pa.int32()),
        ("uri", pa.string()), ("sha256", pa.string()), ("parent_model_id", pa.string()),
        ("train_examples", pa.int32()), ("mlflow_run_id", pa.string()), ("registered_name", pa.string()),
        ("registered_version", pa.string()),
    ]),
    "model_inputs": pa.schema([
        ("model_id", pa.string()), ("trajectory_id", pa.string()), ("source_round", pa.int32()),
        ("use", pa.string()),
    ]),
    "evaluations": pa.schema([
        ("experiment_id", pa.string()), ("round", pa.int32()), ("model_id", pa.string()), ("level", pa.int32()),
        ("metric", pa.string()), ("value", pa.float64()), ("n", pa.int32()),
    ]),
}


def to_table(name: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Rows to an Arrow table with the fixed schema; a missing or extra column is an error here."""
    schema = SCHEMAS[name]
    for i, r in enumerate(rows[:1]):
        extra = set(r) - set(schema.names)
        missing = set(schema.names) - set(r)
        if extra or missing:
            raise ValueError(f"table {name}, row {i}: extra columns {sorted(extra)}, missing {sorted(missing)}")
    return pa.Table.from_pylist(rows, schema=schema)
