"""components.progress: stage progress parsed from job output, shown only where a sink is set."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from components import progress
from components.jobs import launch
from components.jobs.launch import StageJobError, run_stage_attempt
from components.progress import RichProgressSink, installed, parse_progress


class Recorder:
    def __init__(self):
        self.events: list[tuple] = []

    def started(self, stage_run_id):
        self.events.append(("started", stage_run_id))

    def line(self, stage_run_id, line, progress):
        self.events.append(("line", stage_run_id, line, progress))

    def finished(self, stage_run_id, ok):
        self.events.append(("finished", stage_run_id, ok))


@pytest.mark.parametrize("line, expected", [
    ("[train_policy] step 50/500, loss 0.4100", (50, 500)),
    ("[train_policy] step 500/500", (500, 500)),
    ("[generate] batch 3/5", (3, 5)),
    ("[generate] Batch 3 / 5", (3, 5)),
    ("[verify] 12/40 correct", None),
    ("[score] Monte Carlo labels: 8 trajectories, k=4 rollouts per step prefix", None),
    ("[train_policy] step 1/0", None),
    ("", None),
])
def test_parse_progress(line, expected):
    assert parse_progress(line) == expected


def test_no_sink_is_a_no_op():
    assert progress.set_sink(None) is None
    progress.stage_started("e/r1/generate/a1")
    progress.stage_line("e/r1/generate/a1", "[generate] batch 1/2")
    progress.stage_finished("e/r1/generate/a1", True)


def test_sink_gets_parsed_progress_and_is_unset_after():
    rec = Recorder()
    with installed(rec):
        progress.stage_started("s")
        progress.stage_line("s", "[train_policy] step 50/500, loss 0.41")
        progress.stage_line("s", "[train_policy] SFT on 8 examples")
        progress.stage_finished("s", False)
    progress.stage_started("t")  # after the block: nowhere
    assert rec.events == [("started", "s"), ("line", "s", "[train_policy] step 50/500, loss 0.41", (50, 500)),
                          ("line", "s", "[train_policy] SFT on 8 examples", None), ("finished", "s", False)]


def test_a_failing_sink_is_dropped_not_raised():
    class Broken(Recorder):
        def line(self, *a):
            raise ValueError("boom")

    with installed(Broken()):
        with pytest.warns(RuntimeWarning, match="boom"):
            progress.stage_line("s", "[generate] batch 1/2")
        progress.stage_finished("s", True)  # the sink is gone: no second warning


class FakeStore:
    def __init__(self, commit_error: Exception | None = None):
        self.commit_error, self.failed = commit_error, []

    def next_attempt(self, experiment, round, stage):
        return 2

    def start_stage_run(self, *a):
        pass

    def commit(self, ref, manifest_path, later_stages=()):
        if self.commit_error:
            raise self.commit_error
        return SimpleNamespace(outputs=[{"table": "trajectories", "rows": 4}], metrics={"n": 4.0})

    def fail_stage_run(self, ref, error):
        self.failed.append(error)

    def record_job(self, *a):
        pass


def _attempt(monkeypatch, tmp_path, store, job_lines, job_error=None):
    def fake_spec(cfg, store, round, stage, attempt, code_version):
        return SimpleNamespace(out_dir=str(tmp_path / f"r{round}" / stage / f"a{attempt}"), seed=1,
                               config_hash="h", to_json=lambda: "{}", stage=stage, shard=0, shards=1)

    def fake_job(stage, spec_path, log, timeout_s, python=None):
        for line in job_lines:
            log(line)
        if job_error:
            raise job_error

    monkeypatch.setattr(launch, "build_spec", fake_spec)
    monkeypatch.setattr(launch, "run_job", fake_job)
    logged: list[str] = []
    rec = Recorder()
    cfg = SimpleNamespace(experiment="e", recipe="rft", imports=[], stage_timeout_s=60, generate=SimpleNamespace(backend="hf"),
                          execution=SimpleNamespace(shards=1), storage_dir=str(tmp_path))
    with installed(rec):
        try:
            run_stage_attempt(cfg, store, 1, "train_policy", code_version=None, log=logged.append)
        except StageJobError:
            pass
    return rec.events, logged


def test_run_stage_attempt_reports_job_lines_and_keeps_logging_them(monkeypatch, tmp_path):
    lines = ["[train_policy] SFT on 8 examples", "[train_policy] step 250/500, loss 0.5", "[train_policy] step 500/500"]
    events, logged = _attempt(monkeypatch, tmp_path, FakeStore(), lines)
    sid = "e/r1/train_policy/a2"
    assert events == [("started", sid), ("line", sid, lines[0], None), ("line", sid, lines[1], (250, 500)),
                      ("line", sid, lines[2], (500, 500)), ("finished", sid, True)]
    assert logged[1:4] == lines  # every job line still reaches the log (Prefect's logger in a task)
    assert logged[0].startswith(f"{sid}: starting job") and logged[-1].startswith(f"{sid}: committed")


def test_run_stage_attempt_reports_a_failed_job(monkeypatch, tmp_path):
    store = FakeStore()
    events, _ = _attempt(monkeypatch, tmp_path, store, ["[generate] batch 1/5"],
                         job_error=StageJobError("exited with code 1", 1, transient=False))
    assert [e[0] for e in events] == ["started", "line", "finished"] and events[-1][2] is False
    assert store.failed == ["exited with code 1"]


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=120, color_system=None), out


def test_rich_sink_shows_the_stage_and_its_progress():
    console, out = _terminal()
    with RichProgressSink(console) as sink, installed(sink):
        progress.stage_started("arith/r1/generate/a1")
        progress.stage_line("arith/r1/generate/a1", "[generate] batch 3/5")
        sink.progress.refresh()
        assert "arith/r1/generate/a1" in out.getvalue() and "3/5" in out.getvalue()
        progress.stage_started("arith/r1/train_policy/a1")
        progress.stage_line("arith/r1/train_policy/a1", "[train_policy] step 50/500, loss 0.41")
        sink.progress.refresh()
        assert "50/500" in out.getvalue()
        progress.stage_line("arith/r1/train_policy/a1", "[train_policy] step 10/20")  # a new phase
        task = sink.progress.tasks[-1]
        assert (task.completed, task.total) == (10, 20)
        progress.stage_finished("arith/r1/generate/a1", True)
        progress.stage_finished("arith/r1/train_policy/a1", False)
        assert sink.progress.tasks == []  # finished attempts leave the live display...
    text = out.getvalue()
    assert "arith/r1/generate/a1 ✓ done" in text and "5/5" in text  # ...as a static line each
    assert "arith/r1/train_policy/a1 ✗ failed" in text and "10/20" in text


def test_rich_sink_is_silent_without_a_terminal():
    out = io.StringIO()
    with RichProgressSink(Console(file=out)) as sink, installed(sink):
        progress.stage_started("s")
        progress.stage_line("s", "[generate] batch 1/2")
        progress.stage_finished("s", True)
    assert out.getvalue() == ""


def test_rich_sink_on_a_console_with_a_bare_theme():
    """Prefect's console handler has a theme without rich's default styles: the bars must still render."""
    from rich.theme import Theme

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, theme=Theme({"log.info_level": "cyan"}, inherit=False))
    with RichProgressSink(console) as sink, installed(sink):
        progress.stage_started("s")
        sink.progress.refresh()
        progress.stage_line("s", "[generate] batch 1/2")
        sink.progress.refresh()
        progress.stage_finished("s", True)
    assert "2/2" in out.getvalue()
