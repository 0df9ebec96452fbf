"""Stage outputs: Parquet parts plus a manifest, written so that a crash leaves nothing visible.

A job writes into `a<attempt>.tmp/` and renames it to `a<attempt>/` only after every part and the
manifest are on disk and fsynced. The manifest records each file's rows and sha256; the commit
re-checks them, so a truncated or corrupted part is refused. Each part is written as the store keeps
it (`components.tables.PARTS`: the attempt's `stage_run_id` included), so the commit copies the file
into the store instead of rewriting it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components.storage import normjoin
from components.tables import PARTS, SCHEMAS

MANIFEST = "manifest.json"


class ManifestError(RuntimeError):
    """A manifest or one of its files is missing, corrupt or inconsistent."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def sha256_dir(path: Path) -> str:
    """Hash of a directory's files (names and contents), e.g. a saved checkpoint."""
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\0" + sha256_file(p).encode() + b"\0")
    return h.hexdigest()


@dataclass
class Manifest:
    experiment: str
    round: int
    stage: str
    attempt: int
    config_hash: str
    seed: int
    code_version: str | None
    inputs: dict[str, Any]
    outputs: list[dict[str, Any]] = field(default_factory=list)  # {table, path, rows, sha256}
    artifacts: list[dict[str, Any]] = field(default_factory=list)  # {name, path, sha256}
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    pid: int | None = None
    sha256: str = ""  # of the manifest file itself; filled on read

    @property
    def stage_run_id(self) -> str:
        return f"{self.experiment}/r{self.round}/{self.stage}/a{self.attempt}"

    def output_paths(self, out_dir: Path, table: str) -> list[str]:
        return [part_path(out_dir, o["path"]) for o in self.outputs if o["table"] == table]


def part_path(out_dir: str | Path, rel: str) -> str:
    """Where a manifest's part lies. A sharded stage's manifest lists its shards' parts, beside its folder
    (`../a1.shard0/part-….parquet`), so the path is normalised."""
    return normjoin(out_dir, rel)


class StageOutputWriter:
    """Collects a job's tables and artifacts in a temp dir; `finish()` publishes them atomically. Its parts
    name `stage_run_id`, the attempt they are committed under."""

    def __init__(self, final_dir: Path, stage_run_id: str):
        self.final_dir = Path(final_dir)
        self.stage_run_id = stage_run_id
        self.tmp_dir = self.final_dir.with_name(self.final_dir.name + ".tmp")
        if self.final_dir.exists():
            raise ManifestError(f"{self.final_dir} already exists: attempts are never overwritten")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)  # leftovers of a killed attempt with the same number
        self.tmp_dir.mkdir(parents=True)
        self._outputs: list[dict[str, Any]] = []
        self._artifacts: list[dict[str, Any]] = []

    def artifact_dir(self, name: str) -> Path:
        p = self.tmp_dir / name
        p.mkdir(parents=True, exist_ok=True)
        return p

    def write_table(self, table: str, data: pa.Table) -> None:
        """Write `data` (the table's `SCHEMAS` columns) as the next part of `table`, with the attempt's id."""
        if data.schema != SCHEMAS[table]:
            raise ManifestError(f"table {table}: columns {data.schema.names} do not match {SCHEMAS[table].names}")
        if PARTS[table] != SCHEMAS[table]:
            data = data.append_column(PARTS[table].field("stage_run_id"),
                                      pa.repeat(pa.scalar(self.stage_run_id, pa.string()), data.num_rows))
        part = sum(1 for o in self._outputs if o["table"] == table and "/" not in o["path"])
        rel = f"part-{table}-{part:05d}.parquet"
        path = self.tmp_dir / rel
        # Fixed writer options so the bytes depend only on the data (byte-reproducible rounds).
        pq.write_table(data, path, compression="zstd", use_dictionary=True, write_statistics=True)
        self._outputs.append({"table": table, "path": rel, "rows": data.num_rows, "sha256": sha256_file(path)})

    def add_part(self, table: str, path: Path, rows: int, sha256: str) -> None:
        """List a part that lies elsewhere (a shard's, beside this folder) under a path relative to this one."""
        rel = os.path.relpath(path, self.final_dir)
        self._outputs.append({"table": table, "path": rel, "rows": rows, "sha256": sha256})

    def finish(self, manifest: Manifest) -> Path:
        for name in sorted(p.name for p in self.tmp_dir.iterdir() if p.is_dir()):
            self._artifacts.append({"name": name, "path": name, "sha256": sha256_dir(self.tmp_dir / name)})
        manifest.outputs = self._outputs
        manifest.artifacts = self._artifacts
        manifest.pid = os.getpid()
        body = asdict(manifest)
        body.pop("sha256")
        mpath = self.tmp_dir / MANIFEST
        with open(mpath, "w") as f:
            json.dump(body, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.tmp_dir, self.final_dir)
        return self.final_dir / MANIFEST


def read_manifest(path: Path) -> Manifest:
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest not found: {path}")
    try:
        body = json.loads(path.read_text())
        m = Manifest(**body)
    except (json.JSONDecodeError, TypeError) as e:
        raise ManifestError(f"{path}: not a valid manifest: {e}") from None
    m.sha256 = sha256_file(path)
    return m


def verify_manifest(path: Path) -> Manifest:
    """Read a manifest and check every file it lists: present, same sha256, readable Parquet, same rows."""
    m = read_manifest(path)
    out_dir = Path(path).parent
    for o in m.outputs:
        f = Path(part_path(out_dir, o["path"]))
        if not f.is_file():
            raise ManifestError(f"{path}: listed file {f} is missing")
        digest = sha256_file(f)
        if digest != o["sha256"]:
            raise ManifestError(f"{f}: sha256 {digest[:12]}… does not match the manifest's {o['sha256'][:12]}…")
        try:
            rows = pq.ParquetFile(f).metadata.num_rows
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise ManifestError(f"{f}: not a readable Parquet file: {e}") from None
        if rows != o["rows"]:
            raise ManifestError(f"{f}: has {rows} rows, the manifest says {o['rows']}")
    for a in m.artifacts:
        d = out_dir / a["path"]
        if not d.is_dir() or sha256_dir(d) != a["sha256"]:
            raise ManifestError(f"{path}: artifact {a['name']} at {d} is missing or does not match its sha256")
    return m
