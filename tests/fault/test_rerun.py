"""Reruns keep lineage true, on a finished micro experiment (rounds 0..2), in three steps:

1. `coevo rerun <exp> --round 1 --stage train_policy`: one attempt superseded, a new model id for the new
   checkpoint, and, in the commit's own transaction, everything computed from the old one stale: round 1's
   `evaluate` and every stage of round 2 (round 2 was sampled from the superseded model). `coevo status`
   shows them; round 0 is untouched; round 2's model still names the parent it was trained from.
2. `coevo resume <exp>` recomputes exactly the stale stages; round 2's new model names round 1's new one.
3. `coevo rerun <exp> --round 1 --stage score --downstream` recomputes round 1 from `score` on and all of
   round 2 at once.

The registry gets one version per committed attempt, `current` is always the newest round's live model,
and `models.registered_name` / `registered_version` say which version each model is. Every recompute starts
from the same committed inputs and seeds, so the rows end as they began.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.fault.conftest import rows_of, runs_by_round

pytestmark = pytest.mark.slow

ROUND = ("generate", "verify", "score", "filter", "train_policy", "evaluate")  # a micro round (rft)


@dataclass
class Snapshot:
    runs: dict[int, list[dict[str, Any]]]
    models: dict[str, dict[str, Any]]      # model_id -> models row
    versions: dict[str, str]               # model_id -> registered version of <experiment>-policy
    current: str | None                    # the model_id the `current` alias names

    def committed(self, round: int) -> dict[str, dict[str, Any]]:
        return {r["stage"]: r for r in self.runs[round] if r["status"] == "committed"}

    def ids(self, status: str) -> set[str]:
        return {r["stage_run_id"] for rs in self.runs.values() for r in rs if r["status"] == status}

    def stale(self) -> set[tuple[int, str]]:
        return {(r["round"], r["stage"]) for rs in self.runs.values() for r in rs
                if r["stale"] and r["status"] == "committed"}

    def live_policy(self, round: int) -> dict[str, Any]:
        run_id = self.committed(round)["bootstrap" if round == 0 else "train_policy"]["stage_run_id"]
        return next(m for m in self.models.values() if m["stage_run_id"] == run_id and m["role"] == "policy")


def snapshot(run) -> Snapshot:
    from mlflow.tracking import MlflowClient

    store, exp = run.store, run.experiment
    models = {m["model_id"]: m for m in store.rows("SELECT * FROM models WHERE experiment_id=?", [exp])}
    uri = f"sqlite:///{run.workdir / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    name = f"{exp}-policy"
    versions = {v.tags["coevo.model_id"]: str(v.version) for v in client.search_model_versions(f"name = '{name}'")}
    current = client.get_model_version_by_alias(name, "current").tags["coevo.model_id"]
    return Snapshot(dict(runs_by_round(store, exp)), models, versions, current)


def status_rows(stdout: str) -> list[dict[str, str]]:
    """The rows of the `coevo status` table (rich box drawing, one row per line at COLUMNS=250)."""
    out = []
    for line in stdout.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) >= 4 and cells[0].isdigit():
            out.append({"round": int(cells[0]), "stage": cells[1], "attempt": int(cells[2]), "status": cells[3]})
    return out


@dataclass
class Reruns:
    before: Snapshot
    after_rerun: Snapshot
    after_resume: Snapshot
    after_downstream: Snapshot
    rerun: Any
    resume: Any
    downstream: Any
    run: Any


@pytest.fixture(scope="module")
def reruns(fault_runs) -> Reruns:
    run = fault_runs.killed
    run.assert_finished()
    before = snapshot(run)
    p1 = run.cli("rerun", run.experiment, "--round", "1", "--stage", "train_policy")
    after1 = snapshot(run)
    p2 = run.cli("resume", run.experiment)
    after2 = snapshot(run)
    p3 = run.cli("rerun", run.experiment, "--round", "1", "--stage", "score", "--downstream")
    return Reruns(before, after1, after2, snapshot(run), p1, p2, p3, run)


def test_rerun_supersedes_one_attempt_and_names_a_new_model(reruns):
    assert reruns.rerun.returncode == 0, reruns.rerun.stdout + reruns.rerun.stderr
    b, a = reruns.before, reruns.after_rerun
    old = b.committed(1)["train_policy"]
    assert a.ids("superseded") - b.ids("superseded") == {old["stage_run_id"]}
    assert rows_of(reruns.run.store, [old["stage_run_id"]]) == 0, "a superseded attempt keeps no rows"
    old_model, new_model = b.live_policy(1), a.live_policy(1)
    assert new_model["model_id"] != old_model["model_id"]
    assert new_model["model_id"] == f"{reruns.run.experiment}/policy/r1/a{a.committed(1)['train_policy']['attempt']}"
    assert new_model["parent_model_id"] == old_model["parent_model_id"] == b.live_policy(0)["model_id"]
    # Round 2 was trained from the superseded model, and its row still says so.
    assert a.live_policy(2) == b.live_policy(2)
    assert a.live_policy(2)["parent_model_id"] == old_model["model_id"]


def test_rerun_marks_the_rest_of_the_round_and_every_later_round_stale(reruns):
    b, a = reruns.before, reruns.after_rerun
    assert b.stale() == set()
    assert a.stale() == {(1, "evaluate")} | {(2, s) for s in ROUND}
    assert a.runs[0] == b.runs[0], "round 0 changed"
    for stage in ("generate", "verify", "score", "filter"):
        assert a.committed(1)[stage] == b.committed(1)[stage], stage
    for stage in ROUND:  # kept, not recomputed, but flagged
        assert a.committed(2)[stage]["stage_run_id"] == b.committed(2)[stage]["stage_run_id"], stage
    shown = {(r["round"], r["stage"]) for r in status_rows(reruns.rerun.stdout) if r["status"] == "committed (stale)"}
    assert shown == a.stale(), reruns.rerun.stdout


def test_registry_has_a_version_per_attempt_and_current_stays_on_the_newest_round(reruns):
    b, a = reruns.before, reruns.after_rerun
    new_model = a.live_policy(1)["model_id"]
    assert set(a.versions) == set(b.versions) | {new_model}
    assert len(set(a.versions.values())) == len(a.versions), "one version per attempt"
    assert b.current == a.current == b.live_policy(2)["model_id"], "current is the newest round's live model"
    for snap in (b, a):
        for model_id, m in snap.models.items():
            if model_id in snap.versions:
                assert (m["registered_name"], m["registered_version"]) == (
                    f"{reruns.run.experiment}-policy", snap.versions[model_id]), model_id


def test_resume_recomputes_exactly_the_stale_stages(reruns):
    p = reruns.resume
    assert p.returncode == 0, p.stdout + p.stderr
    b, a = reruns.after_rerun, reruns.after_resume
    assert a.stale() == set()
    recomputed = {(1, "evaluate")} | {(2, s) for s in ROUND}
    assert a.ids("superseded") - b.ids("superseded") == {b.committed(r)[s]["stage_run_id"] for r, s in recomputed}
    assert a.runs[0] == b.runs[0]
    for stage in ("generate", "verify", "score", "filter", "train_policy"):
        assert a.committed(1)[stage] == b.committed(1)[stage], stage
    # Round 2 now comes from round 1's new model, and names it.
    assert a.live_policy(2)["parent_model_id"] == a.live_policy(1)["model_id"] == b.live_policy(1)["model_id"]
    assert a.current == a.live_policy(2)["model_id"] != b.current
    assert set(a.versions) == set(b.versions) | {a.live_policy(2)["model_id"]}


def test_downstream_recomputes_the_round_and_every_later_round(reruns):
    p = reruns.downstream
    assert p.returncode == 0, p.stdout + p.stderr
    b, a = reruns.after_resume, reruns.after_downstream
    assert a.stale() == set()
    recomputed = {(1, s) for s in ROUND[2:]} | {(2, s) for s in ROUND}
    assert a.ids("superseded") - b.ids("superseded") == {b.committed(r)[s]["stage_run_id"] for r, s in recomputed}
    for stage in ("generate", "verify"):
        assert a.committed(1)[stage] == b.committed(1)[stage], stage
    assert a.runs[0] == b.runs[0]
    assert a.live_policy(2)["parent_model_id"] == a.live_policy(1)["model_id"]
    assert a.current == a.live_policy(2)["model_id"]
    assert not [r for r in status_rows(p.stdout) if "stale" in r["status"]], p.stdout


def test_recomputed_from_the_same_inputs_and_seeds_the_rows_end_as_they_began(reruns):
    # Model ids name their attempt; content hashes read them without it (components.store.content_hash_sql).
    assert reruns.run.store.table_hashes(reruns.run.experiment) == reruns.run.hashes
