"""The CLI as a user meets it: bad input gives a clear message, a non-zero exit and nothing written;
telemetry is off without `make`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, TELEMETRY_OFF, coevo_env, run_coevo


def coevo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A bare environment, as a fresh shell: nothing inherited from the test process."""
    return run_coevo(*args, cwd=cwd, base={}, env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "HOME": str(cwd)},
                     timeout=120)


# `coevo --help` through main(), then the variables as every later import (Prefect, MLflow) sees them.
_ENV_AFTER_MAIN = """
import json, os, sys
from flows import cli
names, sys.argv = sys.argv[1:], ["coevo", "--help"]
try:
    cli.main()
except SystemExit:
    pass
print(json.dumps({k: os.environ.get(k) for k in names}))
"""


def _env_after_main(tmp_path: Path, **exported: str) -> dict[str, str | None]:
    """Only `exported` of the telemetry variables are in the child's environment when it starts."""
    env = coevo_env(base={}, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **exported},
                    unset=[k for k in TELEMETRY_OFF if k not in exported])
    assert {k for k in TELEMETRY_OFF if k in env} == set(exported)
    p = subprocess.run([sys.executable, "-c", _ENV_AFTER_MAIN, *TELEMETRY_OFF], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


def test_the_cli_turns_telemetry_off_itself(tmp_path):
    """Run outside `make`, with none of the variables exported, the CLI still makes no outside calls."""
    assert _env_after_main(tmp_path) == TELEMETRY_OFF


def test_an_exported_telemetry_setting_wins(tmp_path):
    got = _env_after_main(tmp_path, DO_NOT_TRACK="0", HF_HUB_OFFLINE="0")
    assert got == {**TELEMETRY_OFF, "DO_NOT_TRACK": "0", "HF_HUB_OFFLINE": "0"}


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
    assert "policy.model: no model folder './no/such/model'" in " ".join(r.stderr.split())
    _nothing_written(tmp_path)


def test_a_config_whose_model_is_not_built_yet_is_refused_at_load(tmp_path):
    """A new user's first try: configs/gsm8k.yaml before `coevo build-model`. The run is refused before any
    stage, naming the field and the command that builds the stand-in; a missing data file likewise."""
    r = coevo("run", "--config", str(REPO / "configs/gsm8k.yaml"), "--set", f"workdir={tmp_path / 'wd'}",
              "--set", f"domain.options.test_path={tmp_path / 'gone.jsonl'}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    said = " ".join(r.stderr.split())
    assert ("policy.model: 'workdir/standin-gsm8k' is neither a local folder nor in the Hugging Face cache" in said
            and "`coevo build-model workdir/standin-gsm8k --domain gsm8k`" in said), said
    assert f"domain.options.test_path: no such file '{tmp_path / 'gone.jsonl'}'" in said
    assert "Traceback" not in r.stderr
    _nothing_written(tmp_path)


def test_query_refuses_writes(tmp_path):
    from components.store import Store

    Store(tmp_path / "wd" / "store").init()
    r = coevo("query", "DELETE FROM trajectories", "--workdir", str(tmp_path / "wd"), cwd=tmp_path)
    assert r.returncode == 2
    assert "read-only" in r.stderr and "DELETE" in r.stderr
    r = coevo("query", "SELEC 1", "--workdir", str(tmp_path / "wd"), cwd=tmp_path)
    assert r.returncode == 2
    assert "Parser Error" in r.stderr and "SELEC 1" in r.stderr and "Traceback" not in r.stderr


def test_query_as_of_a_point_that_names_no_commit_exits_2(tmp_path):
    from components.store import Store

    Store(tmp_path / "wd" / "store").init()
    r = coevo("query", "SELECT 1", "--as-of", "exp/r3/generate", "--workdir", str(tmp_path / "wd"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--as-of 'exp/r3/generate': no commit of experiment 'exp'" in " ".join(r.stderr.split()), r.stderr


def test_query_without_store(tmp_path):
    r = coevo("query", "SELECT 1", "--workdir", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert r.returncode == 2
    assert "no store at" in r.stderr
    assert not (tmp_path / "nowhere").exists()


def test_every_commands_help_renders():
    """Rich reads `[...]` in help text as markup: one unescaped bracket made `coevo query --help` crash."""
    from typer.testing import CliRunner

    from flows.cli import app

    runner = CliRunner()
    commands = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]
    assert "query" in commands and "build-model" in commands
    for name in commands:
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (name, result.output, result.exception)
        assert "Usage" in result.output, name
    assert "/r<round>[/<stage>[/a<attempt>]]" in runner.invoke(app, ["query", "--help"], env={"COLUMNS": "200"}).output
