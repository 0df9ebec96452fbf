"""The real-model path learns: a Qwen2 stand-in with a BPE tokenizer (`coevo build-model --size micro`, the
width and depth of configs/micro.yaml's char model), bootstrapped through the chat template on
configs/micro.yaml, passes the default's learning test. Round-over-round learning at micro scale moves
less than the spread between CPU kernel paths (docs/default-run.md), so, like the default's test, this
asserts what round 0 teaches, with a margin that holds on any kernel path.

    .venv/bin/python -m pytest tests/integration/test_standin_learns.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, run_coevo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def standin_run(prefect_server, tmp_path_factory):
    from flows.evolution import self_evolution

    w = tmp_path_factory.mktemp("standin")
    model = w / "standin-arith"
    run_coevo("build-model", str(model), "--domain", "arith", "--size", "micro", check=True)
    config = REPO / "configs" / "micro.yaml"
    overrides = [f"workdir={w}", "experiment=standin-arith", "rounds=0", f"policy.model={model}",
                 "policy.prompt_format=chat"]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg), model


def test_the_bootstrap_learns_the_demonstrated_levels_through_chat_and_bpe(standin_run):
    cfg, store, _ = standin_run
    acc = {lv: v for lv, v in store.query("SELECT level, value FROM evaluations WHERE experiment_id=? AND round=0 "
                                          "AND metric='greedy_acc' AND level >= 0", [cfg.experiment])[1]}
    # Measured 0.98 / 0.87 (L3 0.45) on an AMD EPYC; the default char model's test asks the same.
    assert acc[1] >= 0.8 and acc[2] >= 0.5, acc


def test_it_trained_on_chat_rendered_demos_with_the_bpe_tokenizer(standin_run):
    cfg, store, given = standin_run
    m = Path(store.committed_model(cfg.experiment, 0, "policy")["uri"])
    tok = json.loads((m / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>"  # completions ended at the chat turn's end
    assert json.loads((given / "config.json").read_text())["model_type"] == "qwen2"
    boot = json.loads(store.committed_run(cfg.experiment, 0, "bootstrap")["metrics_json"])
    assert boot["truncated"] == 0 and boot["steps"] == cfg.bootstrap.steps
