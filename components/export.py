"""Export one experiment's rows from every store table: Parquet files, or a Hugging Face dataset on disk.

    coevo export micro --to parquet --out exports/micro      # exports/micro/<table>.parquet
    coevo export micro --to hf --out exports/micro-hf        # datasets.load_from_disk("exports/micro-hf")

Rows are selected by experiment (problems and per-trajectory tables through the experiment's
trajectories), so one store holding several experiments exports each on its own. An `export.json`
beside the data records row counts, the store path and the experiment's config hash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from components.store import Store, StoreError, experiment_filter

# Table -> how its rows belong to an experiment (a SQL condition with one `?` for the experiment id).
TABLES: dict[str, str] = {t: experiment_filter(t) for t in (
    "experiments", "stage_runs", "stage_jobs", "round_plans", "problems", "trajectories", "steps", "verifications", "step_labels",
    "step_pairs", "scores", "selections", "models", "evaluations", "trajectory_sources", "turns", "advantages",
    "rollout_logprobs", "nodes",
)}
FORMATS = ("parquet", "hf")


class ExportError(ValueError):
    """Unknown experiment or format, or an output folder that is not ours to overwrite."""


def read_tables(store: Store, experiment: str) -> dict:
    """Arrow tables of the experiment, one per store table (empty tables keep their schema)."""
    known = store.experiments()
    if experiment not in known:
        raise ExportError(f"unknown experiment {experiment!r} in {store.path}; known: {', '.join(known) or 'none'}")
    # One read-only connection for all tables; `to_arrow_table` materialises before it closes.
    with store.reader() as con:
        return {t: con.execute(f"SELECT * FROM {t} WHERE {cond} ORDER BY ALL", [experiment]).to_arrow_table()
                for t, cond in TABLES.items()}


def _prepare(out: Path) -> None:
    # Overwrite only an earlier export (it has export.json), never an unrelated folder.
    if out.exists() and any(out.iterdir()):
        if not (out / "export.json").is_file():
            raise ExportError(f"{out} exists and is not a coevo export; choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def export_experiment(store: Store, experiment: str, to: str, out: str | Path) -> dict[str, int]:
    """Write the experiment to `out`; returns rows per table."""
    if to not in FORMATS:
        raise ExportError(f"--to must be one of {', '.join(FORMATS)}, not {to!r}")
    if not store.path.exists():
        raise StoreError(f"no store at {store.path}: run an experiment first (coevo run)")
    tables = read_tables(store, experiment)
    out = Path(out)
    _prepare(out)
    if to == "parquet":
        import pyarrow.parquet as pq

        for name, table in tables.items():
            pq.write_table(table, out / f"{name}.parquet")
    else:
        _save_hf(tables, out)
    counts = {name: t.num_rows for name, t in tables.items()}
    config_hash = tables["experiments"].column("config_hash")[0].as_py()
    (out / "export.json").write_text(json.dumps(
        {"experiment": experiment, "format": to, "store": str(store.path.resolve()), "config_hash": config_hash,
         "rows": counts}, indent=1))
    return counts


def _save_hf(tables: dict, out: Path) -> None:
    """A DatasetDict with one split per table, saved with `save_to_disk`."""
    import pyarrow as pa
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    splits = {}
    for name, table in tables.items():
        # datasets has no feature type for timestamps with time zones; ISO strings round-trip everywhere.
        cols = [c.cast(pa.string()) if pa.types.is_timestamp(c.type) else c for c in table.columns]
        splits[name] = Dataset(InMemoryTable(pa.table(cols, names=table.column_names)))
    # One shard per split: datasets writes no shard for an empty table and then cannot load it back.
    DatasetDict(splits).save_to_disk(str(out), num_shards={name: 1 for name in splits})
