"""The MLflow experiment a coevo run logs into, on MLflow's real SQLite store."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from components.config import load_config_dict
from components.tracking import KIND_TRAINING, TAG_KIND, Tracker


def test_experiments_are_marked_model_training_so_the_ui_opens_on_runs(tmp_path):
    cfg = load_config_dict({"experiment": "kind", "workdir": str(tmp_path)})
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    Tracker(cfg)
    assert client.get_experiment_by_name("kind").tags[TAG_KIND] == KIND_TRAINING == "custom_model_development"
    # An experiment made before the tag existed (or by hand, untagged) gets it on the next run.
    old = client.create_experiment("old")
    assert TAG_KIND not in client.get_experiment(old).tags
    Tracker(load_config_dict({"experiment": "old", "workdir": str(tmp_path)}))
    assert client.get_experiment(old).tags[TAG_KIND] == KIND_TRAINING


def test_code_version_is_the_git_sha_unless_the_environment_names_it(monkeypatch):
    import subprocess

    from components.tracking import REPO_ROOT, code_version

    monkeypatch.delenv("COEVO_CODE_VERSION", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert code_version().removesuffix("-dirty") == head.stdout.strip()[:12]
    # An image has no .git: its build names the commit (infra/Dockerfile's CODE_VERSION).
    monkeypatch.setenv("COEVO_CODE_VERSION", "0123456789ab")
    assert code_version() == "0123456789ab"
