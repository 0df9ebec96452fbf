"""`coevo rerun <exp> --round 1 --stage score [--downstream]` on a finished micro experiment (rounds 0..2).

Without `--downstream`: exactly one attempt is superseded, rounds 0 and 2 are untouched (their stage
runs and their rows), and the later stages of round 1 are marked stale, which `coevo status` shows.
With it: exactly the later stages of round 1 are recomputed, and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.fault.conftest import round_hashes, rows_of, runs_by_round

pytestmark = pytest.mark.slow

LATER = ("filter", "train_policy", "evaluate")  # after `score` in a micro round (rft: no train_reward)


@dataclass
class Snapshot:
    runs: dict[int, list[dict[str, Any]]]
    hashes: dict[int, dict[str, tuple[int, str]]]

    def committed(self, round: int) -> dict[str, dict[str, Any]]:
        return {r["stage"]: r for r in self.runs[round] if r["status"] == "committed"}

    def ids(self, status: str) -> set[str]:
        return {r["stage_run_id"] for rs in self.runs.values() for r in rs if r["status"] == status}


def snapshot(run) -> Snapshot:
    store, exp = run.store, run.experiment
    return Snapshot(dict(runs_by_round(store, exp)), {r: round_hashes(store, exp, r) for r in (0, 1, 2)})


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
    after_downstream: Snapshot
    rerun: Any
    downstream: Any
    run: Any


@pytest.fixture(scope="module")
def reruns(fault_runs) -> Reruns:
    run = fault_runs.killed
    run.assert_finished()
    before = snapshot(run)
    p1 = run.cli("rerun", run.experiment, "--round", "1", "--stage", "score")
    after1 = snapshot(run)
    p2 = run.cli("rerun", run.experiment, "--round", "1", "--stage", "score", "--downstream")
    return Reruns(before, after1, snapshot(run), p1, p2, run)


def test_rerun_supersedes_exactly_one_attempt(reruns):
    assert reruns.rerun.returncode == 0, reruns.rerun.stdout + reruns.rerun.stderr
    b, a = reruns.before, reruns.after_rerun
    old = b.committed(1)["score"]
    assert a.ids("superseded") - b.ids("superseded") == {old["stage_run_id"]}
    new = a.committed(1)["score"]
    assert new["attempt"] == max(r["attempt"] for r in a.runs[1] if r["stage"] == "score") > old["attempt"]
    assert rows_of(reruns.run.store, [old["stage_run_id"]]) == 0, "a superseded attempt keeps no rows"


def test_rerun_leaves_other_rounds_untouched(reruns):
    b, a = reruns.before, reruns.after_rerun
    for r in (0, 2):
        assert a.runs[r] == b.runs[r], f"round {r} stage runs changed"
        assert a.hashes[r] == b.hashes[r], f"round {r} rows changed"
    for stage in ("generate", "verify"):
        assert a.committed(1)[stage] == b.committed(1)[stage]
    # the new score attempt has the same content: the round's rows are as before
    assert a.hashes[1] == b.hashes[1]


def test_rerun_marks_later_stages_stale(reruns):
    b, a = reruns.before, reruns.after_rerun
    for stage in LATER:  # kept, not recomputed, but flagged
        assert a.committed(1)[stage]["stage_run_id"] == b.committed(1)[stage]["stage_run_id"]
        assert a.committed(1)[stage]["stale"] is True, stage
    stale = {(r["round"], r["stage"]) for rs in a.runs.values() for r in rs if r["stale"] and r["status"] == "committed"}
    assert stale == {(1, s) for s in LATER}
    rows = status_rows(reruns.rerun.stdout)
    assert rows, reruns.rerun.stdout
    shown = {(r["round"], r["stage"]) for r in rows if r["status"] == "committed (stale)"}
    assert shown == {(1, s) for s in LATER}, reruns.rerun.stdout


def test_downstream_recomputes_only_later_stages(reruns):
    p = reruns.downstream
    assert p.returncode == 0, p.stdout + p.stderr
    b, a = reruns.after_rerun, reruns.after_downstream
    for stage in ("generate", "verify"):
        assert a.committed(1)[stage] == b.committed(1)[stage], stage
    recomputed = ("score", *LATER)
    for stage in recomputed:
        assert a.committed(1)[stage]["attempt"] > b.committed(1)[stage]["attempt"], stage
        assert a.committed(1)[stage]["stale"] is False, stage
    assert a.ids("superseded") - b.ids("superseded") == {b.committed(1)[s]["stage_run_id"] for s in recomputed}
    for r in (0, 2):
        assert a.runs[r] == reruns.before.runs[r], f"round {r} stage runs changed"
        assert a.hashes[r] == reruns.before.hashes[r], f"round {r} rows changed"
    # recomputed from the same committed inputs and seeds: the same rows and the same checkpoint bytes
    assert a.hashes[1] == reruns.before.hashes[1]
    assert not [r for r in status_rows(p.stdout) if "stale" in r["status"]], p.stdout
    assert reruns.run.store.table_hashes(reruns.run.experiment) == reruns.run.hashes
