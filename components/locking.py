"""One writer per experiment: an flock-ed lock file naming its holder.

The OS releases an flock when its process dies, so a `kill -9`ed flow never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import IO

_HELD: dict[str, tuple[IO[str], int]] = {}  # re-entrant within a process (a flow and its subflows)


class ExperimentLockedError(RuntimeError):
    pass


class ExperimentLock:
    def __init__(self, experiment_dir: Path, holder: str | None = None):
        self.path = Path(experiment_dir) / ".lock"
        self.holder = holder

    def __enter__(self) -> ExperimentLock:
        key = str(self.path.resolve())
        if key in _HELD:
            f, n = _HELD[key]
            _HELD[key] = (f, n + 1)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            who = f.read().strip() or "{}"
            f.close()
            try:
                info = json.loads(who)
            except json.JSONDecodeError:
                info = {}
            raise ExperimentLockedError(
                f"experiment is locked by pid {info.get('pid', '?')} (flow run {info.get('flow_run', '?')}): "
                f"another coevo process is writing {self.path.parent.name}; wait for it or stop it"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "flow_run": self.holder}))
        f.flush()
        _HELD[key] = (f, 1)
        return self

    def __exit__(self, *exc: object) -> None:
        key = str(self.path.resolve())
        f, n = _HELD[key]
        if n > 1:
            _HELD[key] = (f, n - 1)
            return
        del _HELD[key]
        f.seek(0)
        f.truncate()
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
