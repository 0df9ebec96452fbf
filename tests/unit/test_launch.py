"""components.jobs.launch: how a stage job is started."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest


def test_a_stage_job_can_run_in_another_environment(monkeypatch):
    from components.jobs.launch import job_command

    assert job_command("generate", Path("s.json"))[0] == sys.executable
    monkeypatch.setenv("COEVO_JOB_PYTHON_GENERATE", "/opt/vllm/bin/python")
    assert job_command("generate", Path("s.json")) == ["/opt/vllm/bin/python", "-m", "components.jobs", "generate",
                                                      "--spec", "s.json"]
    assert job_command("evaluate", Path("s.json"))[0] == sys.executable


def test_the_sampling_stages_run_in_vllms_environment_under_the_vllm_backend(monkeypatch, tmp_path):
    from components.config import load_config
    from components.jobs import launch

    monkeypatch.delenv("COEVO_VLLM_PYTHON", raising=False)
    hf = load_config("configs/micro.yaml")
    vllm = load_config("configs/micro.yaml", ["generate.backend=vllm"])
    venv = tmp_path / ".venv-vllm"
    monkeypatch.setattr(launch, "VLLM_VENV", venv)
    assert launch.job_python(vllm, "generate") == sys.executable  # no vLLM environment: the job says what is missing
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    sampling = {s: launch.job_python(vllm, s) for s in ("generate", "score", "evaluate")}
    assert sampling == dict.fromkeys(sampling, str(venv / "bin" / "python"))
    assert {launch.job_python(vllm, s) for s in ("bootstrap", "verify", "filter", "train_policy", "train_reward")} \
        == {sys.executable}
    assert launch.job_python(hf, "generate") == sys.executable
    monkeypatch.setenv("COEVO_VLLM_PYTHON", "/gpu/bin/python")
    assert launch.job_python(vllm, "score") == "/gpu/bin/python"
    monkeypatch.setenv("COEVO_JOB_PYTHON_SCORE", "/other/bin/python")  # the per-stage override wins
    assert launch.job_python(vllm, "score") == "/other/bin/python"


def test_a_job_that_fails_transiently_is_retried_and_one_that_raises_is_not(tmp_path):
    from components.jobs.launch import EXIT_TRANSIENT, StageJobError, run_job

    def fake_python(code: int) -> str:  # an interpreter whose job prints an error and exits with `code`
        script = tmp_path / f"exit{code}"
        script.write_text(f"#!/bin/sh\necho 'error: backend said so'\nexit {code}\n")
        script.chmod(0o755)
        return str(script)

    for code, transient in ((EXIT_TRANSIENT, True), (1, False), (2, False)):
        try:
            run_job("generate", Path("s.json"), lambda _: None, 30, python=fake_python(code))
        except StageJobError as e:
            assert e.transient is transient and e.returncode == code and "backend said so" in str(e)
        else:
            raise AssertionError(f"exit {code} did not fail the job")


def test_a_job_in_another_interpreter_gets_a_temporary_folder_removed_after_it(tmp_path, monkeypatch):
    """A job run by another interpreter (vLLM's environment) writes its temporary files in a folder of its own,
    removed when the job ends, failed or not."""
    import tempfile

    from components.jobs.launch import StageJobError, run_job

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen, failed = tmp_path / "seen", []
    for code in (0, 1):
        script = tmp_path / f"python{code}"
        script.write_text(f'#!/bin/sh\necho "$TMPDIR" >> {seen}\n'
                          f'touch "${{TMPDIR:-/nonexistent}}/ipc-socket"\nexit {code}\n')
        script.chmod(0o755)
        try:
            run_job("generate", Path("s.json"), lambda _: None, 30, python=str(script))
        except StageJobError:
            failed.append(code)
    assert failed == [1]
    folders = seen.read_text().split()
    assert len(folders) == 2 and all(Path(f).parent == scratch and Path(f).name.startswith("coevo-job-")
                                     for f in folders), folders
    assert not list(scratch.iterdir())


def test_a_launcher_interrupted_while_its_job_runs_ends_the_job():
    """A SIGTERM to `coevo run` raises SystemExit in the launcher (flows/cli.py) while it waits on a job. The
    launcher kills the job: one that prints nothing for a while (a vLLM engine loading, a long step) would
    otherwise outlive the command until its next write to the closed pipe."""
    from components.jobs.launch import _run

    def interrupt(signum, frame):
        raise SystemExit(143)

    pids: list[int] = []
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(SystemExit):
            _run("generate", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), lambda line: None,
                 120.0, pids.append)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(pids) == 1
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pids[0], 0)
