"""`coevo resume <exp> --more-rounds N` (the nightly schedule's `more_rounds`) continues a finished experiment
past its last round; `--rounds N` names the total.

On the fault suite's `seed1` experiment (round 0 only), after the other fault tests have read it: its
committed round 0 is kept as it is (the same attempts, the same rows), round 1 runs, the store and the
config snapshot then say `rounds: 1` (a plain `coevo resume` is a no-op), and fewer rounds is refused with
the fix named and nothing written.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.fault.conftest import contains, round_hashes, runs_by_round

pytestmark = pytest.mark.slow

ROUND_STAGES = {"generate", "verify", "score", "filter", "train_policy", "evaluate"}


@pytest.fixture(scope="module")
def extended(fault_runs):
    run = fault_runs.seed1
    run.assert_finished()
    before = {"runs": runs_by_round(run.store, run.experiment)[0], "r0": round_hashes(run.store, run.experiment, 0)}
    p = run.cli("resume", run.experiment, "--more-rounds", "1")  # stored rounds 0, so to 1
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run, before, p


def test_committed_rounds_are_kept(extended):
    run, before, _ = extended
    runs = runs_by_round(run.store, run.experiment)
    assert runs[0] == before["runs"], "round 0's attempts were touched"
    assert round_hashes(run.store, run.experiment, 0) == before["r0"]


def test_the_new_round_runs_once(extended):
    run, _, _ = extended
    r1 = runs_by_round(run.store, run.experiment)[1]
    assert sorted(r["stage"] for r in r1) == sorted(ROUND_STAGES)
    assert {r["status"] for r in r1} == {"committed"}
    assert run.store.rows("SELECT count(*) AS n FROM evaluations WHERE experiment_id=? AND round=1",
                          [run.experiment])[0]["n"] > 0


def test_store_and_snapshot_take_the_new_rounds(extended):
    run, _, _ = extended
    row = run.store.rows("SELECT config_json FROM experiments WHERE experiment_id=?", [run.experiment])[0]
    assert json.loads(row["config_json"])["rounds"] == 1
    assert yaml.safe_load((run.exp_dir / "config.yaml").read_text())["rounds"] == 1
    hashes = run.store.table_hashes(run.experiment)
    p = run.cli("resume", run.experiment)
    assert p.returncode == 0, p.stderr[-3000:]
    assert run.store.table_hashes(run.experiment) == hashes


def test_fewer_rounds_is_refused_and_writes_nothing(extended):
    run, _, _ = extended
    hashes, runs = run.store.table_hashes(run.experiment), run.store.stage_runs(run.experiment)
    p = run.cli("resume", run.experiment, "--rounds", "0")
    assert p.returncode == 2
    assert contains(p.stdout + p.stderr, "raise only `rounds` to continue it")
    assert run.store.table_hashes(run.experiment) == hashes and run.store.stage_runs(run.experiment) == runs
