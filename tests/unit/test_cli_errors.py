"""Bad input: a clear message, a non-zero exit, and nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def coevo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "200",
                               "HOME": str(cwd)}, timeout=120)


def _nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "wd").exists(), "an invalid run must not create its workdir"


def test_malformed_yaml(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"experiment: x\nworkdir: {tmp_path / 'wd'}\ngenerate: {{temperature: 0.8\n")
    r = coevo("run", "--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2
    assert "malformed YAML" in r.stderr and "bad.yaml" in r.stderr and "line" in r.stderr
    _nothing_written(tmp_path)


def test_unknown_key(tmp_path):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(f"experiment: x\nworkdir: {tmp_path / 'wd'}\ntrain_policy: {{stepz: 3}}\n")
    r = coevo("run", "--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2
    assert "train_policy.stepz: unknown key" in r.stderr
    _nothing_written(tmp_path)


def test_wrong_type_in_override(tmp_path):
    r = coevo("run", "--config", str(REPO / "configs/micro.yaml"), "--set", f"workdir={tmp_path / 'wd'}",
              "--set", "rounds=many", cwd=tmp_path)
    assert r.returncode == 2
    assert "rounds:" in r.stderr and "'many'" in r.stderr
    _nothing_written(tmp_path)


def test_the_schema_the_unknown_key_message_points_to(tmp_path):
    import json

    p = coevo("config-schema", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    schema = json.loads(p.stdout)
    assert {"domain", "policy", "generate", "filter", "train_policy", "evaluate"} <= set(schema["properties"])
    assert "check_steps" in schema["$defs"]["FilterConfig"]["properties"]


def test_missing_model_path(tmp_path):
    r = coevo("run", "--config", str(REPO / "configs/micro.yaml"), "--set", f"workdir={tmp_path / 'wd'}",
              "--set", "policy.model=./no/such/model", cwd=tmp_path)
    assert r.returncode == 2
    assert "model path not found: ./no/such/model" in r.stderr
    _nothing_written(tmp_path)


def test_query_refuses_writes(tmp_path):
    from components.store import Store

    Store(tmp_path / "wd" / "coevo.duckdb").init()
    r = coevo("query", "DELETE FROM trajectories", "--workdir", str(tmp_path / "wd"), cwd=tmp_path)
    assert r.returncode == 2
    assert "read-only" in r.stderr and "DELETE" in r.stderr
    r = coevo("query", "SELEC 1", "--workdir", str(tmp_path / "wd"), cwd=tmp_path)
    assert r.returncode == 2
    assert "Parser Error" in r.stderr and "SELEC 1" in r.stderr and "Traceback" not in r.stderr


def test_query_without_store(tmp_path):
    r = coevo("query", "SELECT 1", "--workdir", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert r.returncode == 2
    assert "no store at" in r.stderr
    assert not (tmp_path / "nowhere").exists()
