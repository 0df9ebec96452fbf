"""SIGTERM to `coevo run`, as a scheduler stops a job or a user runs `kill`: the command ends, and with it everything it
started: the temporary Prefect server and the stage job that was running (here a new interpreter, warm jobs off).
Before, the server kept running after the command was gone."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, alive, coevo_cmd, coevo_env
from tests.fault.conftest import cmdline, descendants, find_job, kill_tree

pytestmark = pytest.mark.slow


def test_sigterm_ends_the_run_with_its_prefect_server_and_its_stage_job(tmp_path):
    workdir, log = tmp_path / "w", tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(coevo_cmd("run", "--config", "configs/micro.yaml", "--set", f"workdir={workdir}"),
                               cwd=REPO, env=coevo_env(tmp_path / "prefect", env={"COEVO_WARM_JOBS": "0"}), stdout=out,
                               stderr=subprocess.STDOUT)
    started: dict[int, str] = {}
    try:
        job = find_job(workdir / "micro" / "r0" / "bootstrap" / "a1.spec.json", timeout_s=240)
        assert job is not None, log.read_text()[-3000:]
        started = {pid: cmdline(pid).decode(errors="replace") for pid in descendants(run.pid)}
        assert any("uvicorn" in c and "prefect.server" in c for c in started.values()), started
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (alive(job) or any(map(alive, started))):
            time.sleep(0.2)
        left = {pid: c for pid, c in started.items() if alive(pid)}
        assert not alive(job) and not left, left
        assert "Stopping temporary server" in log.read_text()
    finally:
        if run.poll() is None:
            kill_tree(run.pid)
        for pid in started:  # what a failed check left behind
            if alive(pid):
                kill_tree(pid)
