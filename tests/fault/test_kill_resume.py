"""`kill -9` of stage jobs mid-stage and of the flow between commits, then `coevo resume`: nothing lost, nothing doubled.

The `killed` run (see conftest) must end with a store equal, table by table and row by row, to the
uninterrupted `ref` run of the same config, seed and experiment name.
"""

from __future__ import annotations

import json

import pytest

from components.config import load_config
from components.recipes import get_recipe
from tests.fault.conftest import (KILL_MARKERS, KILL_STAGES, READER_TABLES, committed, contains, duplicate_keys,
                                  rows_of)

pytestmark = pytest.mark.slow


def test_runs_finished(fault_runs):
    fault_runs.ref.assert_finished()
    fault_runs.killed.assert_finished()
    fault_runs.seed1.assert_finished()


def test_every_stage_job_was_killed_mid_stage_and_retried(fault_runs):
    by_id = {r["stage_run_id"]: r for r in fault_runs.killed.stage_runs}
    killed_stages = {k["stage"] for k in fault_runs.kills}
    assert killed_stages == set(KILL_STAGES), f"kills: {fault_runs.kills}, missed: {fault_runs.missed}"
    for k in fault_runs.kills:
        run = by_id[k["stage_run_id"]]
        assert run["status"] == "failed", (k, run["status"])
        assert "killed by signal 9" in run["error"], run["error"]
        # the retry (a later attempt of the same round and stage) is the one committed
        again = [r for r in by_id.values() if (r["round"], r["stage"]) == (k["round"], k["stage"])
                 and r["status"] == "committed"]
        assert len(again) == 1 and again[0]["attempt"] > k["attempt"], (k, again)
    # round-1 kills landed inside the stage body: its temp output dir existed, long stages had logged
    # their work starting, and nothing was published yet
    for k in fault_runs.kills:
        assert not k["published_before_kill"], k
        if k["mode"] == "mid_stage":
            assert k["tmp_existed"], k
            assert k["marker_seen"] or k["stage"] not in KILL_MARKERS, k


def test_killed_attempts_left_nothing_visible(fault_runs):
    failed = [r["stage_run_id"] for r in fault_runs.killed.stage_runs if r["status"] == "failed"]
    assert len(failed) >= len(KILL_STAGES)
    assert rows_of(fault_runs.killed.store, failed) == 0


def test_flow_kill_between_commits_then_resume(fault_runs):
    fk = fault_runs.flow_kill
    assert fk is not None, "the flow process was never killed"
    assert fk["returncode"] == -9 and fk["job_pid"] is not None, fk
    killed = fault_runs.killed
    assert len(killed.procs) == 2 and killed.procs[1].args[3] == "resume"
    assert killed.procs[1].returncode == 0, killed.log_tail()
    store, exp, runs = killed.store, killed.experiment, killed.stage_runs
    assert not [r for r in runs if r["status"] == "running"], "resume must settle attempts left running"
    # the attempt whose job was running when the flow died: failed as abandoned, its rows nowhere
    abandoned = [r for r in runs if "abandoned" in (r["error"] or "")]
    assert [r["stage_run_id"] for r in abandoned] == [fk["running"]]
    assert abandoned[0]["status"] == "failed" and rows_of(store, [fk["running"]]) == 0
    assert "marked 1 attempt(s) left running" in killed.logs[1].read_text()
    cfg = load_config(killed.exp_dir / "config.yaml")
    got = committed(runs, exp)
    want = {(r, s) for r in range(cfg.rounds + 1) for s in get_recipe(cfg.recipe).round_stages(r, cfg)}
    assert set(got) == want
    assert not any(r["stale"] for r in got.values())
    # the resume picked up after the last commit: nothing committed before the kill ran again
    before_kill = {(r["round"], r["stage"]) for r in runs if r["status"] == "committed"
                   and r["finished_at"] < abandoned[0]["started_at"]}
    assert before_kill and all(got[k]["finished_at"] < abandoned[0]["started_at"] for k in before_kill)


def test_store_equals_uninterrupted_run(fault_runs):
    ref, killed = fault_runs.ref, fault_runs.killed
    assert ref.hashes and killed.hashes, "both runs must finish"
    # Every data table: same row count and same content hash. `models.sha256` (the checkpoint's bytes)
    # is part of it: training on CPU with a fixed seed and thread count is bit-reproducible here.
    diff = {t: (ref.hashes[t], killed.hashes[t]) for t in ref.hashes if ref.hashes[t] != killed.hashes[t]}
    assert not diff, f"tables differ after kill + resume: {diff}"
    # (step_labels and step_pairs: rft labels no steps; trajectory_sources: only `coevo import` writes it;
    # turns: only agent episodes have them; advantages and rollout_logprobs: only recipe grpo writes them;
    # nodes: only generate.mcts)
    empty = ("step_labels", "step_pairs", "trajectory_sources", "turns", "advantages", "rollout_logprobs", "nodes")
    assert all(n > 0 for t, (n, _) in ref.hashes.items() if t not in empty), ref.hashes


def test_no_duplicate_primary_keys(fault_runs):
    for run in (fault_runs.ref, fault_runs.killed):
        assert duplicate_keys(run.store) == {}, run.name


def test_model_checkpoints_identical(fault_runs):
    q = "SELECT regexp_replace(model_id, '/a[0-9]+$', ''), sha256 FROM models ORDER BY 1"  # ids name attempts
    ref = dict(fault_runs.ref.store.query(q)[1])
    killed = dict(fault_runs.killed.store.query(q)[1])
    assert len(ref) == 3 and ref == killed


def test_reader_only_sees_committed_totals(fault_runs):
    """`count(*)` polled while `ref` ran: every observation is the total after some whole commit."""

    ref = fault_runs.ref
    assert not fault_runs.reader_errors, fault_runs.reader_errors
    runs = [r for r in ref.stage_runs if r["rows_json"]]
    assert all(r["status"] == "committed" for r in runs)
    totals = [(0,) * len(READER_TABLES)]
    for r in sorted(runs, key=lambda r: r["finished_at"]):  # commit order
        rows = json.loads(r["rows_json"])
        totals.append(tuple(t + rows.get(name, 0) for t, name in zip(totals[-1], READER_TABLES)))
    seen = fault_runs.reader_counts
    assert len(set(seen)) >= 5, f"the reader barely ran during the round: {sorted(set(seen))}"
    partial = [c for c in seen if c not in totals]
    assert not partial, f"reader saw totals no sequence of whole commits gives: {partial[:5]} (commits: {totals})"
    # and never went back in time
    index = [totals.index(c) for c in seen]
    assert index == sorted(index)


def test_a_reader_held_open_through_the_whole_run_neither_fails_nor_stalls_it(fault_runs):
    """A notebook's reader, one transaction open from the store's first commit to the run's end: the run
    completes as fast as the reference, and the reader keeps the snapshot it opened on."""
    h, ref = fault_runs.holder, fault_runs.ref
    ref.assert_finished()
    assert not h["errors"], h["errors"]
    assert "opened" in h and h["closed"] >= h["run_ended"], "the reader was not open until the run ended"
    assert len(h["counts"]) >= 20, f"the reader read {len(h['counts'])} times"
    assert len(set(h["counts"])) == 1 and h["after"] == h["counts"][0], "the open reader's snapshot moved"
    total = tuple(sum(json.loads(r["rows_json"]).get(t, 0) for r in ref.stage_runs if r["status"] == "committed"
                      and r["rows_json"]) for t in READER_TABLES)
    assert h["fresh"] == total and h["fresh"] != h["after"], "a new reader sees the whole finished run"
    assert not [r for r in ref.stage_runs if r["status"] != "committed"], "no attempt failed beside the reader"


def test_second_writer_is_refused(fault_runs):
    s = fault_runs.second_writer
    assert "result" in s, "the first run ended before its lock was seen"
    p = s["result"]
    assert s["holder_alive_after"], "the second writer must have run while the first one held the experiment"
    assert p.returncode == 2, p.stdout + p.stderr
    assert contains(p.stderr, f"experiment is locked by pid {s['holder_pid']}"), p.stderr
