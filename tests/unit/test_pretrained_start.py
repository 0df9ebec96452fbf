"""Starting from a given model (`policy.model` with `bootstrap.steps: 0`): the config, the checkpoint checks
and the CLI's refusal of a model folder that cannot be a policy."""

from __future__ import annotations

import pytest

from components.config import ConfigError, load_config_dict
from components.models.checkpoint import check_checkpoint, model_uri, resolve_checkpoint
from tests.conftest import REPO, run_coevo


def test_no_bootstrap_needs_a_model():
    with pytest.raises(ConfigError, match="bootstrap.steps=0 starts from a given model.*set policy.model"):
        load_config_dict({"experiment": "x", "bootstrap": {"steps": 0}})
    cfg = load_config_dict({"experiment": "x", "bootstrap": {"steps": 0}, "policy": {"model": "org/name"}})
    assert cfg.bootstrap.levels is None and cfg.bootstrap.seed_levels == []  # the domain's own levels


def _folder(tmp_path, *names):
    d = tmp_path / "m"
    d.mkdir(parents=True)
    for n in names:
        (d / n).write_text("{}")
    return d


def test_a_folder_without_a_tokenizer_is_refused_naming_what_is_missing(tmp_path):
    d = _folder(tmp_path, "config.json", "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"is missing a tokenizer \(one of tokenizer.json"):
        check_checkpoint(d)
    with pytest.raises(FileNotFoundError, match=r"is missing config.json and weights"):
        check_checkpoint(_folder(tmp_path / "x", "tokenizer.json"))
    check_checkpoint(_folder(tmp_path / "y", "config.json", "model.safetensors", "tokenizer.json"))


def test_a_hub_name_must_be_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not in the local HF cache"):
        resolve_checkpoint("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        resolve_checkpoint(str(tmp_path / "missing"))


def test_a_model_is_named_to_stages_by_its_absolute_folder_or_its_hub_name(tmp_path, monkeypatch):
    d = _folder(tmp_path, "config.json")
    monkeypatch.chdir(tmp_path)
    assert model_uri("m") == model_uri("./m/") == str(d.resolve())  # a relative folder, as a stage elsewhere reads it
    assert model_uri("org/name") == "org/name"  # no such folder here: a hub name, as given


def test_the_cli_refuses_a_model_folder_without_a_tokenizer(tmp_path):
    d = _folder(tmp_path, "config.json", "model.safetensors")
    p = run_coevo("run", "--config", str(REPO / "configs" / "micro.yaml"), "--set", f"workdir={tmp_path / 'w'}",
                  "--set", f"policy.model={d}", "--set", "bootstrap.steps=0", prefect_home=tmp_path / "prefect")
    err = " ".join(p.stderr.split())
    assert p.returncode == 2 and "is missing a tokenizer" in err and str(d) in err, err
    assert not (tmp_path / "w").exists()  # refused before anything was written
