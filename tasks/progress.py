"""A running stage's progress on its Prefect task run: a progress artifact, updated as the job reports.

The stage job prints `[generate] samples 256/1024 (batch 1/4)` or `[train_policy] step 50/500`;
`components.progress` parses those lines, and this sink turns them into one progress artifact per stage attempt, keyed
`<experiment>-r<round>-<stage>-progress`, whose description says what is done out of the total. The run
page's Artifacts tab shows it filling up while the job runs.
"""

from __future__ import annotations

import re
import threading
import time
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

from components.progress import progress_text


def artifact_key(text: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes.

    >>> artifact_key("my.exp/r12/train_policy-progress")
    'my-exp-r12-train-policy-progress'
    """
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


class PrefectProgressSink:
    """Progress artifacts for the stage attempts run inside one Prefect task run.

    The artifact appears with the job's first progress line (a stage that reports none gets none) and is
    updated at most every `min_interval_s` seconds, and at the end: 100% done, or where it stopped, failed.
    Flow and task run ids are taken when the sink is made: lines arrive on the jobs' reader threads, which
    carry no Prefect run context.
    """

    def __init__(self, flow_run_id: str | UUID | None, task_run_id: str | UUID | None, min_interval_s: float = 2.0):
        self.flow_run_id, self.task_run_id = flow_run_id, task_run_id
        self.min_interval_s = min_interval_s
        self._artifacts: dict[str, UUID] = {}
        self._shown: dict[str, tuple[float, float, str]] = {}  # stage_run_id -> (when, percent, text)
        self._last: dict[str, tuple[str, int]] = {}  # stage_run_id -> the last line's unit and total
        self._lock = threading.Lock()

    @staticmethod
    def key(stage_run_id: str) -> str:
        """`micro/r1/train_policy/a2` -> `micro-r1-train-policy-progress`."""
        experiment, rnd, stage, _ = stage_run_id.rsplit("/", 3)
        return artifact_key(f"{experiment}-{rnd}-{stage}-progress")

    def started(self, stage_run_id: str) -> None:
        return None  # the artifact waits for the first line that says how much there is to do

    def line(self, stage_run_id: str, line: str, progress: tuple[int, int] | None) -> None:
        if progress is None:
            return
        done, total = progress
        percent = min(100.0, 100.0 * done / total)
        phrase = progress_text(line)
        text = f"{stage_run_id}: {phrase} ({percent:.0f}%)"
        with self._lock:
            self._last[stage_run_id] = (phrase.split()[0], total)
            last = self._shown.get(stage_run_id)
            if last is not None and time.monotonic() - last[0] < self.min_interval_s and done < total:
                self._shown[stage_run_id] = (last[0], percent, text)  # shown at the next update or the end
                return
            self._show(stage_run_id, percent, text)

    def finished(self, stage_run_id: str, ok: bool) -> None:
        with self._lock:
            if stage_run_id not in self._artifacts:
                return
            _, percent, text = self._shown[stage_run_id]
            if ok:  # the job reports every so many steps; a committed one did them all
                word, total = self._last[stage_run_id]
                self._show(stage_run_id, 100.0, f"{stage_run_id}: {word} {total}/{total} (100%): done")
            else:
                self._show(stage_run_id, percent, f"{text}: failed")

    def _show(self, stage_run_id: str, percent: float, text: str) -> None:
        with get_client(sync_client=True) as client:
            artifact = self._artifacts.get(stage_run_id)
            if artifact is None:
                self._artifacts[stage_run_id] = client.create_artifact(ArtifactCreate(
                    type="progress", key=self.key(stage_run_id), description=text, data=percent,
                    flow_run_id=self.flow_run_id, task_run_id=self.task_run_id)).id
            else:
                client.update_artifact(artifact, ArtifactUpdate(data=percent, description=text))
        self._shown[stage_run_id] = (time.monotonic(), percent, text)
