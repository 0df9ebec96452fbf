"""components.models: the char tokenizer, the from-scratch tiny Llama, load_policy and the HF backend.

Real tiny models throughout; the backend tests use one briefly trained so that it emits EOS.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.models.backends import HFBackend, Sample, get_backend
from components.models.tiny import TinyLlamaConfig, create_tiny_llama, load_policy
from components.models.tokenizer import build_char_tokenizer
from components.training.sft import SFTParams, train_sft

SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=192)
PROMPTS = ["3+4\n", "1+2\n", "9-5\n", "2+2\n"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A small model trained for a few seconds on one-step sums: it answers in the format and stops."""
    root = tmp_path_factory.mktemp("policy")
    init = create_tiny_llama(SMALL, root / "init", seed=0)
    examples = [{"prompt": f"{a}+{b}\n", "completion": f"{a}+{b}={a + b}\n#### {a + b}\n"}
                for a in range(10) for b in range(10)]
    train_sft(str(init), examples, str(root / "sft"),
              SFTParams(max_steps=80, batch_size=32, learning_rate=3e-3, logging_steps=80))
    return str(root / "sft")


# -- tokenizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["3+4-2+5\n", "3+4=7\n7-2=5\n5+5=10\n#### 10\n", "  two  spaces\n\n",
                                  "a , b . c ! 'q' n't", "~`!@#$%^&*()_+{}|:\"<>?[]\\;',./"])
def test_tokenizer_round_trips_one_token_per_char(text):
    tok = build_char_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, and nothing added (no BOS, no EOS)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_saves_and_reloads_with_auto_tokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)  # no trust_remote_code: plain tokenizer.json
    text = "7-9=-2\n#### -2\n"
    assert again.encode(text) == tok.encode(text)
    assert again.decode(again.encode(text) + [again.eos_token_id], skip_special_tokens=True) == text
    assert (again.pad_token, again.bos_token, again.eos_token, again.unk_token) == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert again.pad_token_id == 0 and len(again) == 100
    assert again.encode("\t") == [again.unk_token_id]


# -- tiny llama and load_policy -------------------------------------------------------------

def test_create_tiny_llama_writes_safetensors_only_and_loads(tmp_path):
    out = create_tiny_llama(TinyLlamaConfig(), tmp_path / "m", seed=0)
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.vocab_size == 100
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0


def test_create_tiny_llama_is_seeded(tmp_path):
    a = create_tiny_llama(SMALL, tmp_path / "a", seed=3)
    b = create_tiny_llama(SMALL, tmp_path / "b", seed=3)
    c = create_tiny_llama(SMALL, tmp_path / "c", seed=4)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)


def test_load_policy_pads_left_and_evaluates(tmp_path):
    model, tok = load_policy(create_tiny_llama(SMALL, tmp_path / "m", seed=0))
    assert tok.padding_side == "left" and tok.pad_token_id == 0 and not model.training


@pytest.mark.parametrize("path", ["/nonexistent/policy", "./missing-model", "workdir/exp/r0/model"])
def test_load_policy_missing_local_path_names_it(path):
    with pytest.raises(FileNotFoundError, match=f"policy model path not found: {path}"):
        load_policy(path)


# -- HF backend --------------------------------------------------------------------------------

def test_hf_backend_same_seed_same_samples(trained):
    backend = HFBackend(trained, batch_size=8, progress=False)
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=24)
    a = backend.generate(PROMPTS, seed=7, **kw)
    b = backend.generate(PROMPTS, seed=7, **kw)
    c = backend.generate(PROMPTS, seed=8, **kw)
    assert a == b
    assert a != c
    assert [len(per) for per in a] == [3] * len(PROMPTS)
    assert all(isinstance(s, Sample) and s.num_tokens > 0 for per in a for s in per)


def test_hf_backend_leaves_the_callers_rng_alone(trained):
    backend = HFBackend(trained, batch_size=8, progress=False)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    backend.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_hf_backend_greedy_is_deterministic_and_stops_at_eos(trained):
    backend = get_backend("hf", trained, batch_size=3, progress=False)
    a = backend.generate(PROMPTS, n=2, temperature=0.0, top_p=1.0, max_new_tokens=24, seed=0)
    b = backend.generate(PROMPTS, n=2, temperature=0.0, top_p=0.5, max_new_tokens=24, seed=99)
    assert a == b
    for per in a:
        assert per[0] == per[1]  # greedy: every copy of a prompt is the same
    s = a[0][0]
    assert s.finish_reason == "stop" and "#### " in s.text and not s.text.endswith("<eos>")
    assert s.num_tokens == len(s.text) + 1  # one token per char, plus the EOS


def test_hf_backend_length_and_stop_strings(trained):
    backend = HFBackend(trained, batch_size=8, progress=False)
    short = backend.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, max_new_tokens=3, seed=0)[0][0]
    assert short == Sample(short.text, 3, "length") and len(short.text) == 3
    cut = backend.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, max_new_tokens=24, seed=0,
                           stop=["####"])[0][0]
    assert cut.finish_reason == "stop" and "#" not in cut.text and cut.text.endswith("\n")


def test_hf_backend_batching_does_not_change_greedy_output(trained):
    one = HFBackend(trained, batch_size=1, progress=False)
    many = HFBackend(trained, batch_size=64, progress=False)
    prompts = PROMPTS + ["3+4-2\n", "9\n"]  # mixed lengths: left padding inside a batch
    kw = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=24, seed=0)
    assert one.generate(prompts, **kw) == many.generate(prompts, **kw)


def test_get_backend_rejects_unknown_and_explains_missing_vllm(trained, monkeypatch):
    with pytest.raises(ValueError, match="unknown generation backend"):
        get_backend("nope", trained)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vllm is not installed, whether or not it is here
    with pytest.raises(ImportError, match="backend 'vllm' needs the vllm package.*make vllm"):
        get_backend("vllm", trained)
