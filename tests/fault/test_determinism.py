"""Same config and seed on CPU: byte-identical stage outputs. Another seed: other content.

`ref` and `killed` (conftest) ran the same config and seed in different workdirs, so their committed
attempts can be compared stage by stage, Parquet file by Parquet file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from components.jobs.launch import content_hashes
from components.manifest import read_manifest
from components.tables import TABLES
from tests.fault.conftest import committed, round_hashes

pytestmark = pytest.mark.slow


def _model_ids(run: dict) -> set[str]:
    """The attempt-named model ids an attempt's spec reads, and its own attempt (which names what it trains)."""
    return set(re.findall(r"[\w-]+/(?:policy|prm|orm)/r\d+/a\d+", run["spec_json"] or "")) | {f"a{run['attempt']}"}


def test_same_seed_gives_identical_stage_outputs(fault_runs):
    ref, other = fault_runs.ref, fault_runs.killed
    a, b = committed(ref.stage_runs, ref.experiment), committed(other.stage_runs, other.experiment)
    assert set(a) == set(b) and len(a) == 14
    for key in sorted(a):
        # content per table plus each artifact's sha256 (the trained checkpoint of train_policy included)
        ha, hb = content_hashes(Path(a[key]["out_dir"])), content_hashes(Path(b[key]["out_dir"]))
        assert ha == hb, f"{key}: {[k for k in ha if ha[k] != hb.get(k)]}"
        # and the Parquet bytes themselves, except where a column names an attempt: `models.uri` (the attempt's
        # folder), model ids where the two runs' models differ in attempt (a killed training retried is a2), and
        # a part's `stage_run_id` where the attempts differ
        named = {"models"} | ({t for t, d in TABLES.items() if any(c.endswith("model_id") for c in d.names)}
                              if _model_ids(a[key]) != _model_ids(b[key]) else set()) | (
            {t for t, d in TABLES.items() if "stage_run_id" in d.names} if a[key]["attempt"] != b[key]["attempt"]
            else set())
        ma, mb = read_manifest(Path(a[key]["out_dir"]) / "manifest.json"), read_manifest(Path(b[key]["out_dir"]) / "manifest.json")
        pa = {(o["table"], o["path"]): o["sha256"] for o in ma.outputs if o["table"] not in named}
        pb = {(o["table"], o["path"]): o["sha256"] for o in mb.outputs if o["table"] not in named}
        assert pa == pb, f"{key}: Parquet bytes differ"
        assert json.loads(a[key]["rows_json"]) == json.loads(b[key]["rows_json"])


def test_same_seed_gives_identical_table_hashes(fault_runs):
    assert fault_runs.ref.hashes and fault_runs.ref.hashes == fault_runs.killed.hashes


def test_other_seed_gives_other_content(fault_runs):
    ref, seed1 = fault_runs.ref, fault_runs.seed1
    seed1.assert_finished()
    a = round_hashes(ref.store, ref.experiment, 0)
    b = round_hashes(seed1.store, seed1.experiment, 0)
    # Same experiment name, round and config but the seed: demos, initial weights, samples all differ.
    for table in ("problems", "trajectories", "selections", "models", "model_inputs"):
        assert a[table][0] > 0 and a[table][1] != b[table][1], table
    models_a = dict(ref.store.query("SELECT model_id, sha256 FROM models WHERE round = 0")[1])
    models_b = dict(seed1.store.query("SELECT model_id, sha256 FROM models WHERE round = 0")[1])
    assert models_a.keys() == models_b.keys() and models_a != models_b


def test_verify_reproducible_cli(fault_runs):
    run = fault_runs.killed
    run.assert_finished()
    before = run.store.stage_runs(run.experiment)
    p = run.cli("verify-reproducible", run.experiment, "--round", "1", "--stage", "generate")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "byte-identical" in p.stdout
    for table in ("problems", "trajectories", "steps"):
        assert f"table:{table}" in p.stdout
    # the scratch attempt is never recorded, let alone committed
    assert run.store.stage_runs(run.experiment) == before
