"""What the run forms and the run page rest on, without a server: the load-time check that an experiment can
start here, the typed fields turned into overrides, and the progress artifact's pace.

The forms themselves (choices from a real workdir, the browser) are tested in tests/ops and tests/ui."""

from __future__ import annotations

import pytest

from components.config import ConfigError, load_config, load_config_dict
from components.progress import TeeSink
from flows.evolution import typed_overrides
from tasks.progress import PrefectProgressSink
from tests.conftest import REPO


def _cfg(**policy):
    return load_config_dict({"experiment": "x", "policy": policy})


def test_a_hub_model_must_be_cached_while_the_hub_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"policy.model: 'org/model' is neither a local folder nor in the Hugging "
                                          r"Face cache.*`coevo build-model org/model --domain arith`"):
        _cfg(model="org/model").check_startable()
    _cfg(model="org/model").check_startable(model=False)  # round 0 took it in: the store names its files
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    _cfg(model="org/model").check_startable()  # online: the first stage downloads it


def test_a_local_model_folder_must_exist_and_hold_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=r"policy.model: no model folder './not/there'"):
        _cfg(model="./not/there").check_startable()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"policy.model: model folder .* is missing weights"):
        _cfg(model=str(folder)).check_startable()
    _cfg(model=None).check_startable()  # a tiny model from scratch needs nothing


def test_the_reward_models_own_backbone_is_checked_as_the_policy_is():
    """train_reward.model is read in every round (a new PRM starts from it), so round 0 having run changes nothing."""
    cfg = load_config(REPO / "configs" / "arith-coevo.yaml", ["train_reward.model=./no/prm"])
    with pytest.raises(ConfigError, match=r"train_reward.model: no model folder './no/prm'"):
        cfg.check_startable(model=False)


def test_the_confidence_judge_is_checked_as_the_policy_is():
    """score.confidence_model is read in every round (it scores each round's steps), as train_reward.model is."""
    cfg = load_config(REPO / "configs" / "arith.yaml", ["score.reward_model=confidence",
                                                         "score.confidence_model=./no/judge"])
    with pytest.raises(ConfigError, match=r"score.confidence_model: no model folder './no/judge'"):
        cfg.check_startable(model=False)


def test_missing_data_files_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "configs" / "gsm8k.yaml", [f"domain.options.train_path={tmp_path / 'no.jsonl'}"])
    with pytest.raises(ConfigError) as e:
        cfg.check_startable(model=False)
    assert str(e.value).splitlines()[1:] == [f"  domain.options.train_path: no such file '{tmp_path / 'no.jsonl'}' "
                                             f"({tmp_path / 'no.jsonl'})"]
    load_config(REPO / "configs" / "gsm8k.yaml").check_startable(model=False)  # the shipped test data is there


def test_typed_fields_become_overrides_and_may_not_be_set_twice():
    assert typed_overrides(None, recipe="grpo", rounds=0, backend="vllm", shards=2, work_pool="gpu") == [
        "recipe=grpo", "rounds=0", "generate.backend=vllm", "execution.shards=2", "execution.pool=gpu"]
    with pytest.raises(ValueError, match=r"set both as a field and in overrides: \['rounds=3'\]"):
        typed_overrides(["rounds=3", "seed=1"], rounds=1)


class _Recorder(PrefectProgressSink):
    """The sink with its Prefect calls recorded instead of sent (the real ones: tests/ui, test_pipeline)."""

    def __init__(self, min_interval_s: float):
        super().__init__(None, None, min_interval_s)
        self.shown: list[tuple[str, float, str]] = []

    def _show(self, stage_run_id: str, percent: float, text: str) -> None:
        import time

        self.shown.append((stage_run_id, percent, text))
        self._artifacts[stage_run_id] = None
        self._shown[stage_run_id] = (time.monotonic(), percent, text)


def test_progress_artifact_pace_and_end():
    sink = _Recorder(min_interval_s=3600)
    tee = TeeSink(None, sink)
    tee.started("e/r1/generate/a1")
    tee.line("e/r1/generate/a1", "[generate] loading the model", None)
    assert sink.shown == []  # nothing to show before the job says how much there is
    for i in range(1, 5):
        tee.line("e/r1/generate/a1", f"[generate] samples {i * 10}/50 (batch {i}/5)", (i * 10, 50))
    tee.finished("e/r1/generate/a1", True)
    assert sink.shown == [("e/r1/generate/a1", 20.0, "e/r1/generate/a1: samples 10/50 (20%)"),
                          ("e/r1/generate/a1", 100.0, "e/r1/generate/a1: samples 50/50 (100%): done")]
    tee.line("e/r1/train_policy/a1", "[train_policy] step 5/10, loss 0.3", (5, 10))
    tee.finished("e/r1/train_policy/a1", False)
    assert sink.shown[-1] == ("e/r1/train_policy/a1", 50.0, "e/r1/train_policy/a1: step 5/10 (50%): failed")
    assert PrefectProgressSink.key("my.exp/r12/train_policy/a3") == "my-exp-r12-train-policy-progress"


def test_an_import_needs_no_model(tmp_path, monkeypatch):
    """`coevo import --config configs/gsm8k.yaml` before `coevo build-model`: recipe import loads no model."""
    from flows.evolution import check_startable

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    over = [f"workdir={tmp_path}", "experiment=imp"]
    with pytest.raises(ConfigError, match="policy.model: 'workdir/standin-gsm8k'"):
        check_startable(load_config(REPO / "configs" / "gsm8k.yaml", over))
    imports = '[{"path": "tests/data/gsm8k/example_model_solutions.jsonl", "models": ["6b_finetuning"]}]'
    check_startable(load_config(REPO / "configs" / "gsm8k.yaml", [*over, "recipe=import", "rounds=0",
                                                                  f"imports={imports}"]))
