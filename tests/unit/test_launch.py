"""components.jobs.launch: how a stage job is started."""

from __future__ import annotations

import sys
from pathlib import Path


def test_a_stage_job_can_run_in_another_environment(monkeypatch):
    from components.jobs.launch import job_command

    assert job_command("generate", Path("s.json"))[0] == sys.executable
    monkeypatch.setenv("COEVO_JOB_PYTHON_GENERATE", "/opt/vllm/bin/python")
    assert job_command("generate", Path("s.json")) == ["/opt/vllm/bin/python", "-m", "components.jobs", "generate",
                                                      "--spec", "s.json"]
    assert job_command("evaluate", Path("s.json"))[0] == sys.executable
