"""components.training.dpo: TRL DPO on real tiny models: it learns the preference, it is deterministic.

    .venv/bin/python -m pytest tests/unit/test_dpo.py -q

The backbone is random, so the pairs differ only where a few steps can learn it: chosen is the gold
arithmetic solution, rejected the same text with a wrong final answer. The margin is measured here,
from the saved weights, with our own forward pass, not from TRL's logs.
"""

from __future__ import annotations

import hashlib
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.domains.arith import ArithDomain
from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from components.training.dpo import DPOParams, train_dpo

DOMAIN = ArithDomain()
SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small train as fast on one thread, and one thread does not collapse when other
    processes contend for the two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    return str(create_tiny_llama(SMALL, tmp_path_factory.mktemp("init"), seed=0))


def _pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng, out = random.Random(seed), []
    for p in [p for level in (2, 3) for p in DOMAIN.sample_problems(level, n // 2, seed)]:
        gold = DOMAIN.reference_solution(p)
        wrong = int(p.answer) + rng.choice([-3, -2, -1, 1, 2, 3])
        rejected = gold.replace(f"#### {p.answer}\n", f"#### {wrong}\n")
        out.append({"prompt": p.prompt, "chosen": gold, "rejected": rejected})
    assert all(x["chosen"] != x["rejected"] for x in out)
    return out


def _margins(path: str, pairs: list[dict[str, str]]) -> list[float]:
    """log p(chosen + EOS | prompt) - log p(rejected + EOS | prompt), one forward per sequence."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logp(prompt: str, completion: str) -> float:
        prompt_ids = tok(prompt)["input_ids"]
        ids = prompt_ids + tok(completion)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        token_logps = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return float(token_logps[len(prompt_ids) - 1:].sum())  # position t predicts token t + 1

    return [logp(p["prompt"], p["chosen"]) - logp(p["prompt"], p["rejected"]) for p in pairs]


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_dpo_raises_the_chosen_over_rejected_margin(init, tmp_path):
    pairs = _pairs(32)
    ref = str(shutil.copytree(init, tmp_path / "ref"))  # a reference at another path: loaded by us, not TRL
    seen: list[tuple[int, int, float]] = []
    m = train_dpo(init, ref, pairs, str(tmp_path / "out"),
                  DPOParams(max_steps=40, batch_size=8, learning_rate=1e-3, logging_steps=20),
                  progress_callback=lambda step, total, loss: seen.append((step, total, loss)))
    before, after = _margins(init, pairs), _margins(str(tmp_path / "out"), pairs)
    gain = [a - b for a, b in zip(after, before)]
    assert sum(gain) / len(gain) > 1.0, f"mean margin gain {sum(gain) / len(gain):.3f} nats"
    assert sum(g > 0 for g in gain) >= 0.75 * len(gain)
    assert m["rewards/accuracies"] > 0.75 and m["rewards/margins"] > 0
    assert math.isclose(m["first_loss"], math.log(2), rel_tol=1e-4)  # policy == reference at step 1
    assert m["final_loss"] < m["first_loss"] and m["steps"] == 40 and m["pairs"] == 32
    assert [s for s, _, _ in seen] == [1, 20, 40] and {t for _, t, _ in seen} == {40}
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]


def test_dpo_is_deterministic_and_the_policy_path_is_its_own_reference(init, tmp_path):
    pairs, params = _pairs(16), DPOParams(max_steps=4, batch_size=8, learning_rate=1e-3, logging_steps=2)
    for name, ref in (("a", None), ("b", None), ("c", init)):  # None and the policy's own path are the same run
        train_dpo(init, ref, pairs, str(tmp_path / name), params)
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b") == _sha(tmp_path / "c") != _sha(Path(init))


def test_sft_weight_adds_the_chosen_nll(init, tmp_path):
    m = train_dpo(init, None, _pairs(8), str(tmp_path / "out"),
                  DPOParams(max_steps=1, batch_size=8, learning_rate=1e-3, sft_weight=1.0))
    # Step 1: DPO is ln 2 exactly, and a random model's per-token NLL is near ln(vocab 100) = 4.6.
    assert 3.0 < m["first_loss"] - math.log(2) < 6.0


@pytest.mark.parametrize(("pairs", "match"), [
    ([], "no pairs"),
    ([{"prompt": "1+2\n", "chosen": "1+2=3\n#### 3\n"}], r"pairs\[0\] is missing \['rejected'\]"),
    ([{"prompt": "1+2\n", "chosen": "1+2=3\n#### 3\n", "rejected": ""}], r"pairs\[0\] has empty .*'rejected'"),
])
def test_bad_pairs_fail_before_training(init, tmp_path, pairs, match):
    with pytest.raises(ValueError, match=match):
        train_dpo(init, None, pairs, str(tmp_path / "out"), DPOParams(max_steps=1))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"beta": 0.0}, "beta must be > 0"), ({"beta": -0.1}, "beta must be > 0"),
    ({"beta": float("nan")}, "beta must be > 0"), ({"loss_type": "dpo"}, "loss_type must be one of"),
    ({"sft_weight": -1.0}, "sft_weight must be >= 0"), ({"max_steps": 0}, "max_steps"),
    ({"warmup_ratio": 1.0}, "warmup_ratio"),
])
def test_bad_params_fail_at_build(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPOParams(**kwargs)
