"""One workdir with two micro experiments, run once per session for the operator tests and notebooks.

`micro` is configs/micro.yaml as shipped; `micro-b` is the same with seed 1 and half the training
steps (to keep the suite short), so `coevo compare` has two real experiments to put side by side. Both run through the real `self_evolution` flow under
Prefect's test harness, with MLflow on the workdir's SQLite store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MICRO = REPO / "configs" / "micro.yaml"


@dataclass(frozen=True)
class MicroWorkdir:
    path: Path
    experiments: tuple[str, str] = ("micro", "micro-b")


@pytest.fixture(scope="session")
def micro_workdir(tmp_path_factory) -> MicroWorkdir:
    from prefect.testing.utilities import prefect_test_harness

    from flows.evolution import self_evolution

    workdir = tmp_path_factory.mktemp("ops-micro")
    with prefect_test_harness(server_startup_timeout=120):
        self_evolution(config_path=str(MICRO), overrides=[f"workdir={workdir}"])
        self_evolution(config_path=str(MICRO), overrides=[f"workdir={workdir}", "experiment=micro-b", "seed=1",
                                                          "bootstrap.steps=100", "train_policy.steps=40"])
    return MicroWorkdir(workdir)


def coevo(*args: str, env: dict[str, str] | None = None, check: bool = True,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the `coevo` CLI with the operator commands, in a subprocess, as a user would."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=full_env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"coevo {' '.join(args)} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p
