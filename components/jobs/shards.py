"""A sharded stage: N jobs, each on its share of the problems with its own seed, and one commit over all.

    generate (execution.shards=2)
      r1/generate/a1.shard0/   manifest + parts of shard 0 (seed of (experiment seed, round, stage, 0))
      r1/generate/a1.shard1/   ... shard 1
      r1/generate/a1/          the stage's manifest: lists both shards' parts, and what `Stage.merge` computed
                               over all of them (metrics; evaluate's `evaluations`)

Each shard publishes atomically like any job (`manifest.StageOutputWriter`); the stage's manifest is
written only after every shard's has been verified, and the store commits that one manifest in one
transaction. A shard that published is never run again, so a retry reruns only the shards that failed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components import storage
from components.jobs.spec import StageSpec
from components.manifest import MANIFEST, Manifest, ManifestError, StageOutputWriter, part_path, verify_manifest
from components.seeding import derive_seed
from components.stages.base import Stage
from components.tables import SCHEMAS, to_table


def shard_dir(out_dir: str, shard: int) -> str:
    return f"{str(out_dir).rstrip('/')}.shard{shard}"


def shard_specs(spec: StageSpec, stage: Stage, experiment_seed: int, shards: int) -> list[StageSpec]:
    """The stage's spec once per shard: its share (`StageSpec.share`), its seed and its own folder."""
    return [dataclasses.replace(spec, shard=k, shards=shards, out_dir=shard_dir(spec.out_dir, k),
                                seed=derive_seed(experiment_seed, spec.round, stage.seed_name or stage.name, k))
            for k in range(shards)]


def published(spec: StageSpec) -> Manifest | None:
    """The shard's verified manifest where it published (in storage: fetched here), else None."""
    if not storage.exists(storage.join(spec.out_dir, MANIFEST)):
        return None
    path = storage.fetch(spec.out_dir) / MANIFEST
    m = verify_manifest(path)
    if (m.stage_run_id, m.inputs.get("shard")) != (spec.stage_run_id, spec.shard):
        raise ManifestError(f"{path}: manifest is for {m.stage_run_id} shard {m.inputs.get('shard')}, "
                            f"expected {spec.job_id}")
    return m


def merge_shards(spec: StageSpec, stage: Stage, shards: list[StageSpec]) -> Path:
    """Write the stage's manifest over its published shards: their parts, listed where they lie, plus what
    `stage.merge` computes over all of them. Returns the manifest's path, for `Store.commit`."""
    if stage.merge is None:
        raise ValueError(f"stage {stage.name} cannot be sharded")
    t0 = time.perf_counter()
    manifests = []
    for s in shards:
        m = published(s)
        if m is None:
            raise ManifestError(f"{spec.stage_run_id}: shard {s.shard} has no manifest at "
                                f"{storage.join(s.out_dir, MANIFEST)}")
        if m.artifacts:
            raise ManifestError(f"{storage.join(s.out_dir, MANIFEST)}: a shard publishes tables only, not artifacts")
        manifests.append(m)
    # Written in the mirror, where the shards' parts lie beside it as they do in storage, then pushed.
    out = StageOutputWriter(storage.writable_mirror(spec.out_dir), spec.stage_run_id)
    for s, m in zip(shards, manifests):
        for o in m.outputs:
            out.add_part(o["table"], Path(part_path(storage.local(s.out_dir), o["path"])), o["rows"], o["sha256"])

    def read(table: str) -> list[dict[str, Any]]:
        parts = [pq.read_table(part_path(storage.local(s.out_dir), o["path"]), columns=SCHEMAS[table].names)
                 for s, m in zip(shards, manifests) for o in m.outputs if o["table"] == table]
        return pa.concat_tables(parts).to_pylist() if parts else []

    metrics, tables = stage.merge(spec, [m.metrics for m in manifests], read)
    for name, rows in tables.items():
        out.write_table(name, to_table(name, rows))
    shard_s = [m.timings.get("total_s", 0.0) for m in manifests]
    manifest = Manifest(
        experiment=spec.experiment, round=spec.round, stage=spec.stage, attempt=spec.attempt,
        config_hash=spec.config_hash, seed=spec.seed, code_version=spec.code_version,
        inputs={i.stage_run_id: i.manifest_sha256 for i in spec.inputs}
        | {"params": spec.params, "shards": {str(s.shard): m.sha256 for s, m in zip(shards, manifests)}},
        metrics={k: float(v) for k, v in metrics.items()},
        timings={"total_s": round(max(shard_s) + time.perf_counter() - t0, 3),
                 **{f"shard{s.shard}_s": t for s, t in zip(shards, shard_s)}},
    )
    path = out.finish(manifest)
    storage.push(path.parent, spec.out_dir)
    return path
