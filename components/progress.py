"""Progress of running stage jobs, for whoever wants to show it: one process-wide sink, unset by default.

`run_stage_attempt` reports every job's start, output lines and end here. With no sink set every call
is a no-op, so tests, notebooks and Prefect workers are unaffected; the `coevo` command line sets a
`RichProgressSink` while a flow runs in a terminal:

    with RichProgressSink(Console(stderr=True)) as sink, installed(sink):
        run_stage_attempt(...)
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

# What the jobs print: `[train_policy] step 50/500, loss 0.41`, `[generate] samples 256/1024 (batch 1/4)`.
_PROGRESS = re.compile(r"\b(?:step|batch|samples|problems|episodes|simulation)\s+(\d+)\s*/\s*(\d+)\b", re.IGNORECASE)


def progress_text(line: str) -> str | None:
    """The progress phrase of a job's output line, as the job wrote it.

    >>> progress_text("[train_policy] step 50/500, loss 0.4100")
    'step 50/500'
    """
    m = _PROGRESS.search(line)
    return m.group(0) if m else None


def parse_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a job's output line, or None if it reports no progress.

    >>> parse_progress("[train_policy] step 50/500, loss 0.4100")
    (50, 500)
    >>> parse_progress("[generate] batch 3/5")
    (3, 5)
    >>> parse_progress("[generate] samples 256/1024 (batch 1/4)")
    (256, 1024)
    >>> parse_progress("[generate] simulation 3/16: 2048 tokens")
    (3, 16)
    >>> parse_progress("[verify] 12/40 correct") is None
    True
    >>> parse_progress("[generate] batch 1/0") is None
    True
    """
    m = _PROGRESS.search(line)
    if m is None or int(m.group(2)) == 0:
        return None
    return int(m.group(1)), int(m.group(2))


class ProgressSink(Protocol):
    def started(self, stage_run_id: str) -> None: ...
    def line(self, stage_run_id: str, line: str, progress: tuple[int, int] | None) -> None: ...
    def finished(self, stage_run_id: str, ok: bool) -> None: ...


_sink: ProgressSink | None = None


def set_sink(sink: ProgressSink | None) -> ProgressSink | None:
    """Send progress to `sink` (None: nowhere). Returns the sink it replaces."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def current_sink() -> ProgressSink | None:
    return _sink


class TeeSink:
    """Every event to each of several sinks (a terminal's bars and a Prefect artifact, say)."""

    def __init__(self, *sinks: ProgressSink | None):
        self.sinks = [s for s in sinks if s is not None]

    def started(self, stage_run_id: str) -> None:
        for s in self.sinks:
            s.started(stage_run_id)

    def line(self, stage_run_id: str, line: str, progress: tuple[int, int] | None) -> None:
        for s in self.sinks:
            s.line(stage_run_id, line, progress)

    def finished(self, stage_run_id: str, ok: bool) -> None:
        for s in self.sinks:
            s.finished(stage_run_id, ok)


@contextmanager
def installed(sink: ProgressSink | None) -> Iterator[ProgressSink | None]:
    """`set_sink(sink)` for the duration of a block, then whatever was set before."""
    previous = set_sink(sink)
    try:
        yield sink
    finally:
        set_sink(previous)


def stage_started(stage_run_id: str) -> None:
    _emit("started", stage_run_id)


def stage_line(stage_run_id: str, line: str) -> None:
    if _sink is not None:
        _emit("line", stage_run_id, line, parse_progress(line))


def stage_finished(stage_run_id: str, ok: bool) -> None:
    _emit("finished", stage_run_id, ok)


def _emit(method: str, *args) -> None:
    global _sink
    if (sink := _sink) is None:
        return
    try:
        getattr(sink, method)(*args)
    except Exception as e:  # a display must never stop a job: a dead reader thread would stall its pipe
        _sink = None
        warnings.warn(f"progress display turned off: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)


class RichProgressSink:
    """One bar per stage attempt on a rich console: its id, i/n of the current phase, elapsed time.

    A new phase (generate batches, then SFT steps) sets the bar's new total. A finished attempt leaves
    the live display as one static line marked done or failed, so a long experiment's bars never
    outgrow the terminal. Shows nothing when `console` is not a terminal (CI, pipes).
    """

    def __init__(self, console: Console | None = None):
        console = console or Console(stderr=True)
        # Colours, not theme names: the console may carry a theme without rich's defaults (Prefect's).
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=30, style="grey23", complete_style="magenta", finished_style="green",
                      pulse_style="magenta"),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            console=console, disable=not console.is_terminal)
        self._tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()  # lines arrive on each job's reader thread

    def __enter__(self) -> RichProgressSink:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def started(self, stage_run_id: str) -> None:
        with self._lock:
            self._tasks[stage_run_id] = self.progress.add_task(escape(stage_run_id), total=None, count="")

    def line(self, stage_run_id: str, line: str, progress: tuple[int, int] | None) -> None:
        with self._lock:
            tid = self._tasks.get(stage_run_id)
        if tid is not None and progress is not None:
            done, total = progress
            self.progress.update(tid, total=total, completed=done, count=f"{done}/{total}")

    def finished(self, stage_run_id: str, ok: bool) -> None:
        with self._lock:
            tid = self._tasks.pop(stage_run_id, None)
        if tid is None:
            return
        task = next(t for t in self.progress.tasks if t.id == tid)
        if ok:
            total = task.total or 1  # a full bar, also for a stage that reports no progress
            count = f"{total:.0f}/{total:.0f}" if task.fields["count"] else ""
            self.progress.update(tid, total=total, completed=total, count=count)
        mark = "[green]✓ done[/]" if ok else "[red]✗ failed[/]"
        self.progress.update(tid, description=f"{escape(stage_run_id)} {mark}")
        self.progress.stop_task(tid)  # freezes its elapsed time
        summary = self.progress.make_tasks_table([task])
        self.progress.remove_task(tid)
        if not self.progress.disable:
            self.progress.console.print(summary)
