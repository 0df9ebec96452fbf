"""Stage outputs in shared storage: a real S3-compatible endpoint on 127.0.0.1 (moto's server, `s3_endpoint`).

The flow writes specs there, jobs read their inputs and models from it and publish to it, and the flow
ingests from it into DuckDB, which stays the index. Credentials come from the environment only.
"""

from __future__ import annotations

import shutil

import pytest

from components import storage
from components.config import load_config
from components.store import Store
from tests.conftest import REPO

MICRO = REPO / "configs" / "micro.yaml"
SMALL = ["bootstrap.steps=10", "bootstrap.problems_per_level=20", "evaluate.problems_per_level=4",
         "tracking.enabled=false"]


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path):
    """The endpoint's credentials in this process's environment, and a cache of this test's own."""
    for k, v in s3_endpoint.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("COEVO_CACHE_DIR", str(tmp_path / "cache"))
    storage._fs.cache_clear()  # a filesystem is built with the credentials of its time
    yield s3_endpoint
    storage._fs.cache_clear()


def test_a_pushed_folder_is_fetched_whole_and_its_manifest_goes_last(s3, tmp_path):
    src = tmp_path / "a1"
    (src / "model").mkdir(parents=True)
    (src / "model" / "config.json").write_text("{}")
    (src / "part-x-00000.parquet").write_bytes(b"PAR1")
    (src / "manifest.json").write_text('{"ok": 1}')
    uri = f"s3://{s3.bucket}/push/r1/generate/a1"
    storage.push(src, uri)
    fs = s3.fs()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{s3.bucket}/push")) == [
        "config.json", "manifest.json", "part-x-00000.parquet"]
    # A fresh machine: nothing in its cache, everything from the bucket.
    got = storage.fetch(uri)
    assert got == storage.local(uri) and got.is_relative_to(tmp_path / "cache")
    assert (got / "model" / "config.json").read_text() == "{}" and (got / "manifest.json").read_text() == '{"ok": 1}'
    assert storage.read_text(uri + "/manifest.json") == '{"ok": 1}'
    # A try that died while pushing left a mirror whose manifest never reached the bucket: a retry starts clean.
    half = f"s3://{s3.bucket}/push/r1/generate/a2"
    storage.local(half).mkdir(parents=True)
    (storage.local(half) / "part-x-00000.parquet").write_bytes(b"old")
    assert not storage.writable_mirror(half).exists()
    assert storage.writable_mirror(uri).exists(), "a published attempt's mirror was cleared"


def test_a_stage_reads_its_model_from_the_bucket_and_the_flow_ingests_from_it(s3, tmp_path):
    """Round 0 through the bucket: bootstrap publishes its model and parts there, the flow commits them; then
    with this machine's cache wiped, evaluate must fetch the model from the bucket to run at all."""
    from components.jobs.launch import run_stage_attempt

    prefix = f"s3://{s3.bucket}/runs"
    cfg = load_config(MICRO, [f"workdir={tmp_path / 'w'}", f"execution.storage={prefix}", *SMALL])
    store = Store.for_config(cfg)
    boot = run_stage_attempt(cfg, store, 0, "bootstrap", code_version=None, log=lambda _: None)
    assert boot.out_dir == f"{prefix}/micro/r0/bootstrap/a1"
    model = store.committed_model("micro", 0)
    assert model["uri"] == f"{prefix}/micro/r0/bootstrap/a1/model", model
    keys = {p.removeprefix(f"{s3.bucket}/runs/micro/") for p in s3.fs().find(f"{s3.bucket}/runs/micro")}
    assert {"r0/bootstrap/a1/manifest.json", "r0/bootstrap/a1/model/model.safetensors",
            "r0/bootstrap/a1.spec.json"} <= keys, sorted(keys)
    assert not (tmp_path / "w" / "micro").exists(), "stage outputs were written to the local workdir"
    shutil.rmtree(tmp_path / "cache")
    ev = run_stage_attempt(cfg, store, 0, "evaluate", code_version=None, log=lambda _: None)
    assert ev.rows["evaluations"] > 0 and store.level_pass_rates("micro", 0)
    assert store.committed_run("micro", 0, "evaluate")["out_dir"] == f"{prefix}/micro/r0/evaluate/a1"


@pytest.mark.parametrize("case", ["wrong secret", "unknown key", "no credentials"])
def test_refused_or_missing_credentials_fail_before_anything_is_recorded(s3, tmp_path, monkeypatch, case):
    from components.jobs.launch import run_stage_attempt
    from components.storage import StorageError

    if case == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    elif case == "unknown key":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY")
    else:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    storage._fs.cache_clear()
    prefix = f"s3://{s3.bucket}/refused-{case.replace(' ', '-')}"
    cfg = load_config(MICRO, [f"workdir={tmp_path}", f"execution.storage={prefix}", *SMALL])
    store = Store.for_config(cfg)
    with pytest.raises(StorageError, match=rf"{prefix}/micro.*credentials.*AWS_ACCESS_KEY_ID"):
        run_stage_attempt(cfg, store, 0, "bootstrap", code_version=None, log=lambda _: None)
    assert store.stage_runs("micro") == [] and not (tmp_path / "micro").exists()
    assert not s3.fs().exists(f"{s3.bucket}/refused-{case.replace(' ', '-')}")


def test_the_cli_names_refused_credentials_and_exits_2(s3, tmp_path):
    from tests.conftest import run_coevo

    env = s3.env(secret="not-the-secret") | {"COEVO_CACHE_DIR": str(tmp_path / "cache")}
    r = run_coevo("run", "--config", str(MICRO), "--set", f"workdir={tmp_path}",
                  "--set", f"execution.storage=s3://{s3.bucket}/cli", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    said = " ".join(r.stderr.split())  # rich wraps long lines
    assert f"writing to s3://{s3.bucket}/cli/micro: storage refused the credentials" in said, said
    assert not (tmp_path / "store").exists()


def test_credentials_in_the_storage_url_are_refused_at_load():
    from components.config import ConfigError

    with pytest.raises(ConfigError, match="credentials go in the environment"):
        load_config(MICRO, ["execution.storage=s3://AKIAX:secret@coevo/runs"])
    cfg = load_config(MICRO, ["execution.storage=s3://coevo/runs/"])
    assert cfg.storage_dir == "s3://coevo/runs/micro"
    assert cfg.config_hash() == load_config(MICRO).config_hash(), "where outputs lie changed the experiment's hash"


def test_mlflow_artifacts_go_to_the_same_bucket(s3, tmp_path):
    from components.tracking import Tracker

    cfg = load_config(MICRO, [f"workdir={tmp_path}", f"execution.storage=s3://{s3.bucket}/ml"])
    tracker = Tracker(cfg)
    assert tracker.client.get_experiment(tracker.mlflow_experiment_id).artifact_location == \
        f"s3://{s3.bucket}/ml/mlartifacts"
    tracker.start({"config_hash": cfg.config_hash()})
    plot = tmp_path / "accuracy.png"
    plot.write_bytes(b"\x89PNG")
    tracker.log_artifact(plot, artifact_path="plots")
    found = s3.fs().find(f"{s3.bucket}/ml/mlartifacts")
    assert any(p.endswith("/plots/accuracy.png") for p in found), found
    assert s3.secret not in (tmp_path / "mlflow.db").read_bytes().decode("latin-1")
