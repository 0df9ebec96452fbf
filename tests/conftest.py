"""Shared fixtures. Tests use the real parts: DuckDB files, Prefect's local server, MLflow's SQLite store."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# One torch thread per stage job, as the fault tests run them: results are then the same whatever
# else the machine is doing, and two runs sharing two cores do not spin against each other.
os.environ.setdefault("COEVO_TORCH_THREADS", "1")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def prefect_server():
    """Prefect's real local server (temporary, SQLite), for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@dataclass(frozen=True)
class MicroWorkdir:
    path: Path
    experiments: tuple[str, str] = ("micro", "micro-b")

    @property
    def config(self) -> Path:
        return REPO / "configs" / "micro.yaml"

    def overrides(self, experiment: str = "micro") -> list[str]:
        return [f"workdir={self.path}", *MICRO_B] if experiment == "micro-b" else [f"workdir={self.path}"]


# The second experiment, so `coevo compare` has two to put side by side: another seed, shorter training.
MICRO_B = ["experiment=micro-b", "seed=1", "bootstrap.steps=100", "train_policy.steps=40"]


@pytest.fixture(scope="session")
def micro_workdir(prefect_server, tmp_path_factory) -> MicroWorkdir:
    """One workdir with two micro experiments, run once per session through the real `self_evolution`
    flow (Prefect's local server, MLflow on the workdir's SQLite store, DuckDB), shared by the
    integration, operator and notebook tests, which only read it."""
    from flows.evolution import self_evolution

    w = MicroWorkdir(tmp_path_factory.mktemp("micro"))
    for exp in w.experiments:
        self_evolution(config_path=str(w.config), overrides=w.overrides(exp))
    return w
