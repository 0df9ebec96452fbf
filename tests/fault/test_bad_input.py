"""Bad input: each a clear error naming what is wrong, a non-zero exit, and nothing committed.

- a committed Parquet part corrupted on disk, then read by a rerun (the job re-hashes what it reads);
- a committed manifest edited after its commit;
- a finished job's part corrupted, or its manifest's sha256 not matching its file, before the commit;
- a rerun of a round or a stage that does not exist;
- a full disk: the stage's folder is a tmpfs with room for the spec and nothing more.

The CLI cases run as four `coevo` processes at once (each has its own ephemeral Prefect server);
the commit-time and disk-full cases call `run_stage_attempt` directly, in this process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from components.config import load_config
from components.jobs.launch import StageJobError, run_stage_attempt
from components.manifest import ManifestError
from components.stages import build_spec
from components.tracking import code_version
from tests.fault.conftest import REPO, coevo_cmd, coevo_env, contains

pytestmark = pytest.mark.slow


def flip_byte(path: Path) -> bytes:
    """Flip one byte in the middle of a file; returns the original bytes to restore."""
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return original


@dataclass
class Case:
    proc: subprocess.Popen
    out: str = ""
    before: Any = None
    after: Any = None
    run: Any = None
    file: Path | None = None


def part(run, round: int, stage: str, table: str) -> Path:
    c = run.store.committed_run(run.experiment, round, stage)
    m = json.loads((Path(c["out_dir"]) / "manifest.json").read_text())
    return Path(c["out_dir"]) / next(o["path"] for o in m["outputs"] if o["table"] == table)


def state(run) -> tuple[dict, dict]:
    committed = {(r["round"], r["stage"]): r["stage_run_id"] for r in run.store.stage_runs(run.experiment)
                 if r["status"] == "committed"}
    return committed, run.store.table_hashes(run.experiment)


@pytest.fixture(scope="module")
def cli_cases(fault_runs, tmp_path_factory) -> dict[str, Case]:
    ref, killed, seed1 = fault_runs.ref, fault_runs.killed, fault_runs.seed1
    for run in (ref, killed, seed1):
        run.assert_finished()
    base = tmp_path_factory.mktemp("bad-input")
    corrupt = part(ref, 1, "verify", "verifications")                       # read by score
    manifest = Path(seed1.store.committed_run(seed1.experiment, 0, "bootstrap")["out_dir"]) / "manifest.json"
    saved = {corrupt: flip_byte(corrupt), manifest: manifest.read_bytes()}
    manifest.write_bytes(saved[manifest] + b"\n")                           # edited after its commit
    jobs = {
        "corrupt_part": (ref, ["rerun", ref.experiment, "--round", "1", "--stage", "score"]),
        "edited_manifest": (seed1, ["rerun", seed1.experiment, "--round", "0", "--stage", "evaluate"]),
        "no_such_round": (killed, ["rerun", killed.experiment, "--round", "9", "--stage", "score"]),
        "no_such_stage": (killed, ["rerun", killed.experiment, "--round", "1", "--stage", "scorez"]),
    }
    cases: dict[str, Case] = {}
    try:
        befores = {id(r): state(r) for r in (ref, killed, seed1)}
        for name, (run, args) in jobs.items():
            p = subprocess.Popen(coevo_cmd(*args, "--workdir", str(run.workdir)), cwd=REPO,
                                 env=coevo_env(base / f"{name}.prefect"), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            cases[name] = Case(p, before=befores[id(run)])
        for c in cases.values():
            c.out, _ = c.proc.communicate(timeout=600)
    finally:
        for c in cases.values():
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        for path, data in saved.items():
            path.write_bytes(data)
    cases["corrupt_part"].file = corrupt
    cases["edited_manifest"].file = manifest
    for name, (run, _) in jobs.items():
        cases[name].after = state(run)
        cases[name].run = run
    return cases


def test_corrupted_committed_part(cli_cases):
    c = cli_cases["corrupt_part"]
    assert c.proc.returncode != 0, c.out
    assert contains(c.out, str(c.file)) and "corrupted" in c.out, c.out
    assert c.after == c.before, "nothing may be committed"
    runs = [r for r in c.run.store.stage_runs(c.run.experiment) if (r["round"], r["stage"]) == (1, "score")]
    assert runs[-1]["status"] == "failed" and str(c.file) in runs[-1]["error"]
    assert len(runs) == 2, "not retried: a corrupt input is not a transient fault"


def test_manifest_edited_after_commit(cli_cases):
    c = cli_cases["edited_manifest"]
    assert c.proc.returncode != 0, c.out
    assert contains(c.out, str(c.file)) and "changed after it was committed" in c.out, c.out
    assert c.after == c.before
    # refused while planning, before an attempt was even recorded
    assert [r["attempt"] for r in c.run.store.stage_runs(c.run.experiment) if r["stage"] == "evaluate"] == [1]


@pytest.mark.parametrize("name,message", [
    ("no_such_round", "round 9 does not exist"),
    ("no_such_stage", "'scorez' is not one of them"),
])
def test_rerun_of_nonexistent_round_or_stage(cli_cases, name, message):
    c = cli_cases[name]
    assert c.proc.returncode == 2, c.out
    assert contains(c.out, message), c.out
    assert c.after == c.before


# -- commit time and disk full: the attempt lifecycle, called directly --------------------------

def _attempt(run, stage: str, round: int, on_line=None):
    cfg = load_config(run.exp_dir / "config.yaml")
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if on_line:
            on_line(line)

    return cfg, lambda: run_stage_attempt(cfg, run.store, round, stage, code_version=code_version(), log=log), lines


def _published_manifest(line: str) -> Path | None:
    # the job's last line: "[score] wrote <out_dir>/manifest.json in 0.1s" (published, not yet committed)
    if "] wrote " in line and "manifest.json" in line:
        return Path(line.split("] wrote ", 1)[1].split(" in ", 1)[0])
    return None


def test_part_corrupted_before_commit(fault_runs):
    run = fault_runs.ref
    before = state(run)
    hit: list[Path] = []

    def corrupt(line: str) -> None:
        if (m := _published_manifest(line)) is not None:
            p = m.parent / json.loads(m.read_text())["outputs"][0]["path"]
            flip_byte(p)
            hit.append(p)

    _, go, _ = _attempt(run, "score", 2, corrupt)
    with pytest.raises(ManifestError) as e:
        go()
    assert hit and str(hit[0]) in str(e.value) and "does not match" in str(e.value)
    last = run.store.stage_runs(run.experiment)[-1]
    assert (last["round"], last["stage"], last["status"]) == (2, "score", "failed") and str(hit[0]) in last["error"]
    assert state(run) == before


def test_manifest_sha256_not_matching_its_file(fault_runs):
    run = fault_runs.ref
    before = state(run)
    hit: list[Path] = []

    def lie(line: str) -> None:
        if (m := _published_manifest(line)) is not None:
            body = json.loads(m.read_text())
            body["outputs"][0]["sha256"] = "0" * 64
            m.write_text(json.dumps(body, indent=2, sort_keys=True))
            hit.append(m.parent / body["outputs"][0]["path"])

    _, go, _ = _attempt(run, "score", 2, lie)
    with pytest.raises(ManifestError) as e:
        go()
    assert hit and str(hit[0]) in str(e.value) and "000000000000" in str(e.value)
    assert run.store.stage_runs(run.experiment)[-1]["status"] == "failed"
    assert state(run) == before


def test_disk_full(fault_runs):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    run = fault_runs.ref
    before = state(run)
    cfg, go, _ = _attempt(run, "score", 2)
    stage_dir = run.exp_dir / "r2" / "score"
    attempt = run.store.next_attempt(run.experiment, 2, "score")
    spec = build_spec(cfg, run.store, 2, "score", attempt, code_version())
    # room for the spec file the flow writes, not one page more: the job's first Parquet write fails
    size = math.ceil(len(spec.to_json().encode()) / 4096) * 4096
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(stage_dir)],
                       capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        with pytest.raises(StageJobError) as e:
            go()
        listing = sorted(p.name for p in stage_dir.iterdir())
    finally:
        subprocess.run(["umount", str(stage_dir)], check=True)
    assert e.value.returncode == 1 and not e.value.transient
    assert "No space left on device" in str(e.value)
    assert f"a{attempt}" not in listing, "a failed job publishes nothing"
    last = run.store.stage_runs(run.experiment)[-1]
    assert (last["attempt"], last["status"]) == (attempt, "failed") and "No space left on device" in last["error"]
    assert state(run) == before
