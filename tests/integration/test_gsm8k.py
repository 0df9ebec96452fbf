"""configs/gsm8k.yaml, 2 rounds, through the real Prefect flow, MLflow and DuckDB, on a stand-in model built
with `coevo build-model` (BPE tokenizer trained on GSM8K, a chat template, a random Qwen2): the mechanics
of the real-model path, not learning (a CPU cannot teach a 0.65M-parameter model GSM8K).

    .venv/bin/python -m pytest tests/integration/test_gsm8k.py -q
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import GSM8K_DATA as GSM8K
from tests.conftest import REPO, run_coevo

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def gsm8k_run(prefect_server, tmp_path_factory):
    from flows.evolution import self_evolution

    assert GSM8K.is_dir(), f"{GSM8K}: the GSM8K subset that ships with the repo is missing"
    w = tmp_path_factory.mktemp("gsm8k")
    config = REPO / "configs" / "gsm8k.yaml"
    data = [f"domain.options.train_path={GSM8K / 'train.jsonl'}", f"domain.options.test_path={GSM8K / 'test.jsonl'}"]
    model = w / "standin-gsm8k"
    # The micro size, not the default small: this test shows mechanics, and a CPU without AVX-512 emulates bf16 math
    # (10x slower than float32 on an AVX2 EPYC), where the small stand-in's 20 bootstrap steps took 386 s.
    run_coevo("build-model", str(model), "--config", str(config), *[x for d in data for x in ("--set", d)],
              "--size", "micro", "--positions", "1024", check=True)
    overrides = [f"workdir={w}", f"policy.model={model}", *data]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def _safetensors_dtypes(model_dir: Path) -> set[str]:
    dtypes = set()
    for f in model_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return dtypes


def test_two_rounds_commit_every_stage_with_rows(gsm8k_run):
    cfg, store = gsm8k_run
    runs = {(r["round"], r["stage"]): r["status"] for r in store.stage_runs(cfg.experiment)}
    assert runs[(0, "bootstrap")] == runs[(0, "evaluate")] == "committed"
    for r in (1, 2):
        for stage in ("generate", "verify", "score", "filter", "train_policy", "evaluate"):
            assert runs[(r, stage)] == "committed", (r, stage)
    n = dict(store.query("SELECT round, count(*) FROM trajectories WHERE experiment_id=? AND purpose='train' "
                         "GROUP BY 1", [cfg.experiment])[1])
    assert n[1] > 0 and n[2] > 0
    ev = store.query("SELECT count(DISTINCT level) FROM evaluations WHERE experiment_id=? AND round=2 AND level>=0",
                     [cfg.experiment])[1][0][0]
    assert ev == len(range(2, 9))  # GSM8K's levels: 2-8 lines of worked solution


def test_nothing_is_cut_silently(gsm8k_run):
    cfg, store = gsm8k_run
    summary = store.round_summary(cfg.experiment)
    assert [s["round"] for s in summary] == [0, 1, 2] and all(s["truncated"] == 0 for s in summary)
    # Counted, not merely absent: every training stage reports its count.
    for r in store.stage_runs(cfg.experiment):
        if r["stage"] in ("bootstrap", "train_policy") and r["status"] == "committed":
            m = json.loads(r["metrics_json"])
            if m.get("steps", 0):
                assert m["truncated"] == 0 and m["truncated_fraction"] == 0.0, r["stage_run_id"]
        if r["stage"] == "generate" and r["status"] == "committed":
            assert json.loads(r["metrics_json"])["truncated_prompts"] == 0
    longest = store.query("SELECT max(num_tokens) FROM trajectories WHERE experiment_id=? AND purpose='train'",
                          [cfg.experiment])[1][0][0]
    assert 0 < longest <= cfg.generate.max_new_tokens


def test_the_policy_speaks_chat_in_bf16_with_merged_lora(gsm8k_run):
    cfg, store = gsm8k_run
    for r in (0, 1, 2):
        m = Path(store.committed_model(cfg.experiment, r, "policy")["uri"])
        tok = json.loads((m / "tokenizer_config.json").read_text())
        # Chat training: a completion ends at the template's turn end, which is the EOS sampling stops at.
        assert tok["eos_token"] == "<|im_end|>" and tok.get("chat_template") or (m / "chat_template.jinja").is_file()
        assert _safetensors_dtypes(m) == {"BF16"}, r
        assert not (m / "adapter_config.json").exists()  # LoRA merged: any HF or vLLM loader reads it
    completions = [c for (c,) in store.query("SELECT completion FROM trajectories WHERE experiment_id=?",
                                             [cfg.experiment])[1]]
    assert completions and not any("<|im_start|>" in c or "<|im_end|>" in c for c in completions)
    # Round 0 trained LoRA adapters on every chat-rendered demonstration; a later round trains where its
    # random-weight policy happened to get an answer right, and carries the policy over (still bf16) where not.
    boot = json.loads(store.committed_run(cfg.experiment, 0, "bootstrap")["metrics_json"])
    assert boot["steps"] == cfg.bootstrap.steps and boot["examples"] == 7 * cfg.bootstrap.problems_per_level
    for r in (1, 2):
        tp = json.loads(store.committed_run(cfg.experiment, r, "train_policy")["metrics_json"])
        assert tp["steps"] == (cfg.train_policy.steps if tp["examples"] else 0), r
