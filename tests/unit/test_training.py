"""components.training.sft: TRL SFT on real tiny models: it learns, it memorises, it is deterministic."""

from __future__ import annotations

import hashlib

import pytest

from components.models.backends import HFBackend
from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from components.training.sft import SFTParams, train_sft

SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=192)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    return str(create_tiny_llama(SMALL, tmp_path_factory.mktemp("init"), seed=0))


def _examples(n: int) -> list[dict[str, str]]:
    out = []
    for i in range(n):
        a, b, c = i % 10, (i * 7) % 10, (i * 3) % 10
        out.append({"prompt": f"{a}+{b}-{c}\n", "completion": f"{a}+{b}={a + b}\n{a + b}-{c}={a + b - c}\n"
                                                               f"#### {a + b - c}\n"})
    return out


def _sha(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_sft_reduces_loss_and_saves_safetensors_only(init, tmp_path):
    seen: list[tuple[int, int, float]] = []
    m = train_sft(init, _examples(50), str(tmp_path / "out"),
                  SFTParams(max_steps=30, batch_size=16, learning_rate=3e-3, logging_steps=10),
                  progress_callback=lambda step, total, loss: seen.append((step, total, loss)))
    assert m["steps"] == 30  # 30 x 16 > 50 examples: the Trainer runs ~10 epochs to reach max_steps
    assert m["final_loss"] < m["first_loss"]
    assert m["tokens_seen"] > 30 * 16 * 20 and m["runtime_s"] > 0
    assert [s for s, _, _ in seen] == [1, 10, 20, 30] and {t for _, t, _ in seen} == {30}
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]


def test_sft_memorises_a_fixed_example(init, tmp_path):
    ex = {"prompt": "7-9+4\n", "completion": "7-9=-2\n-2+4=2\n#### 2\n"}
    train_sft(init, [ex], str(tmp_path / "out"),
              SFTParams(max_steps=150, batch_size=8, learning_rate=3e-3, warmup_ratio=0.0, logging_steps=150))
    backend = HFBackend(str(tmp_path / "out"), progress=False)
    (sample,), = backend.generate([ex["prompt"]], n=1, temperature=0.0, top_p=1.0, max_new_tokens=40, seed=0)
    assert sample.text == ex["completion"]
    assert sample.finish_reason == "stop"  # EOS was trained in: the model stops by itself


def test_sft_is_deterministic(init, tmp_path):
    params = SFTParams(max_steps=15, batch_size=8, learning_rate=3e-3, seed=5, logging_steps=15)
    data = _examples(40)
    train_sft(init, data, str(tmp_path / "a"), params)
    train_sft(init, data, str(tmp_path / "b"), params)
    train_sft(init, data, str(tmp_path / "c"), SFTParams(**{**params.__dict__, "seed": 6}))
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b")
    assert _sha(tmp_path / "a") != _sha(tmp_path / "c")  # the seed drives the data order


def test_sft_params_validate():
    with pytest.raises(ValueError, match="warmup_ratio"):
        SFTParams(warmup_ratio=1.5)
    with pytest.raises(ValueError, match="max_steps"):
        SFTParams(max_steps=0)


def test_sft_rejects_empty_data(init, tmp_path):
    with pytest.raises(ValueError, match="no examples"):
        train_sft(init, [], str(tmp_path / "out"), SFTParams(max_steps=1))
