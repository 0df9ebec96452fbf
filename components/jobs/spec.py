"""The stage job spec: everything a job needs, by reference. It crosses the process boundary as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from components import storage
from components.config import ExperimentConfig, load_config_dict
from components.manifest import MANIFEST, part_path, read_manifest, sha256_file
from components.tables import SCHEMAS

T = TypeVar("T")


class SpecError(ValueError):
    pass


@dataclass
class InputRef:
    """A committed upstream stage run and its Parquet parts, per table."""

    round: int
    stage: str
    stage_run_id: str
    dir: str
    manifest_sha256: str
    tables: dict[str, list[str]]


@dataclass
class StageSpec:
    experiment: str
    round: int
    stage: str
    attempt: int
    out_dir: str
    seed: int
    config: dict[str, Any]
    config_hash: str
    code_version: str | None = None
    inputs: list[InputRef] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    shard: int = 0  # this job's part of a sharded stage (`execution.shards`): 0..shards-1
    shards: int = 1

    @property
    def stage_run_id(self) -> str:
        return f"{self.experiment}/r{self.round}/{self.stage}/a{self.attempt}"

    @property
    def job_id(self) -> str:
        """The stage run, and the shard where the stage is sharded."""
        return self.stage_run_id + (f"/shard{self.shard}" if self.shards > 1 else "")

    def share(self, keys: Iterable[str], what: str = "problems") -> set[str]:
        """The keys (problem ids) this shard works on: the distinct keys, sorted, dealt round-robin. Every key
        falls to exactly one shard; with one shard, all of them.

        >>> spec = StageSpec("e", 1, "verify", 1, "/tmp/x", 0, {}, "h", shard=1, shards=2)
        >>> sorted(spec.share(["p3", "p1", "p2", "p1"]))
        ['p2']
        """
        order = sorted(set(keys))
        mine = set(order[self.shard::self.shards])
        if not mine and self.shards > 1:
            raise SpecError(f"{self.job_id}: execution.shards={self.shards} is more than the {len(order)} {what} "
                            f"the stage has: shard {self.shard} would get none")
        return mine

    def cfg(self) -> ExperimentConfig:
        return load_config_dict(self.config, source=f"spec of {self.stage_run_id}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_file(cls, path: str | Path) -> StageSpec:
        """Read a spec from a path or a storage URL (`components.storage`)."""
        try:
            text = storage.read_text(path)
        except (FileNotFoundError, IsADirectoryError):
            raise SpecError(f"spec file not found: {path}") from None
        try:
            body = json.loads(text)
            body["inputs"] = [InputRef(**i) for i in body.get("inputs", [])]
            return cls(**body)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise SpecError(f"{path}: not a valid stage spec: {e}") from None

    def inputs_as(self, cls: type[T]) -> T:
        """The stage's typed inputs record (`params` holds it as JSON)."""
        try:
            inputs = cls(**self.params)
        except TypeError as e:
            raise SpecError(f"{self.stage_run_id}: spec params do not match {cls.__name__}: {e}") from None
        # Models in shared storage (`*_uri`), fetched to this machine: the job's libraries load local folders.
        for name, value in vars(inputs).items():
            if name.endswith("_uri") and isinstance(value, str) and storage.is_remote(value):
                setattr(inputs, name, str(storage.fetch(value)))
        return inputs

    def has(self, stage: str, round: int | None = None) -> bool:
        """Whether the job may read `stage`'s committed output of `round` (this round unless given)."""
        want = self.round if round is None else round
        return any(i.stage == stage and i.round == want for i in self.inputs)

    def read(self, stage: str, table: str, round: int | None = None) -> pa.Table:
        """Concatenate the committed parts of `table` from upstream `stage` (this round unless given)."""
        want = self.round if round is None else round
        refs = [i for i in self.inputs if i.stage == stage and i.round == want]
        if not refs:
            raise SpecError(f"{self.stage_run_id}: spec has no committed input {stage!r} for round {want}")
        paths = [p for r in refs for p in _checked_parts(r, table)]
        if not paths:
            raise SpecError(f"{self.stage_run_id}: input {stage!r} of round {want} has no table {table!r}")
        # The rows, without the part's `stage_run_id` (a part of an older coevo has none).
        return pa.concat_tables([pq.read_table(p, columns=SCHEMAS[table].names) for p in paths])

    def rows(self, stage: str, table: str, round: int | None = None) -> list[dict[str, Any]]:
        return self.read(stage, table, round).to_pylist()


def _checked_parts(ref: InputRef, table: str) -> list[str]:
    """The committed parts of `table`, each re-hashed against the committed manifest before it is read.

    Parquet parts carry no checksum a reader checks, so a flipped byte can decode into wrong rows
    silently; a corrupted or swapped part must fail the job, naming the file.
    """
    manifest = storage.join(ref.dir, MANIFEST)
    try:
        m = read_manifest(storage.fetch(manifest))
    except FileNotFoundError:
        raise SpecError(f"{manifest} of committed {ref.stage_run_id} is missing") from None
    if m.sha256 != ref.manifest_sha256:
        raise SpecError(f"{manifest} changed after {ref.stage_run_id} was committed "
                        f"(sha256 {m.sha256[:12]}… vs {ref.manifest_sha256[:12]}…)")
    listed = {part_path(ref.dir, o["path"]): o["sha256"] for o in m.outputs}
    paths = []
    for p in ref.tables.get(table, []):
        try:
            local = storage.fetch(p)
        except FileNotFoundError:
            local = None
        if local is None or not local.is_file():
            raise SpecError(f"committed input {p} of {ref.stage_run_id} is missing")
        digest = sha256_file(local)
        if digest != listed.get(p):
            raise SpecError(f"committed input {p} of {ref.stage_run_id} is corrupted: its sha256 {digest[:12]}… "
                            f"does not match the manifest's {str(listed.get(p))[:12]}…")
        paths.append(str(local))
    return paths
