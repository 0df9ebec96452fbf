"""The stand-in model: a BPE tokenizer trained on arith text and a random Qwen2/Llama, saved and reloaded
as a hub checkpoint would be. Real tokenizers, real models, tiny sizes: the whole file takes seconds."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.domains import get_domain
from components.models.standin import (IM_END, SIZES, StandinConfig, build_standin, copy_batch, copy_vocab,
                                       domain_texts, param_count)
from tests.conftest import run_coevo

ARITH = get_domain("arith")
# Held-out problems, so the round trip is checked on text the tokenizer was not trained on.
SOLUTIONS = [p.prompt + ARITH.reference_solution(p) for level in ARITH.levels() for p in ARITH.test_set(level)[:5]]
LONG = max(SOLUTIONS, key=len)


def _build(out: Path, seed: int = 0, **fields) -> Path:
    return build_standin(out, domain_texts("arith", n_per_level=100), SIZES["tiny"], seed=seed, **fields)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen2") / "model")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("llama") / "model", arch="llama")


@pytest.fixture(scope="module")
def tok(qwen2):
    return AutoTokenizer.from_pretrained(qwen2)


def test_reloads_as_a_hub_checkpoint(qwen2, tok):
    model = AutoModelForCausalLM.from_pretrained(qwen2)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert (qwen2 / "model.safetensors").is_file() and not (qwen2 / "pytorch_model.bin").exists()


def test_special_tokens_are_distinct_and_after_the_bpe_vocabulary(qwen2, tok):
    ids = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    assert None not in ids and len(ids) == 3
    assert min(ids) >= len(tok) - 5, "Qwen2 keeps its special tokens at the end, so pad is not id 0"
    gen = AutoModelForCausalLM.from_pretrained(qwen2).generation_config
    assert gen.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]
    assert gen.pad_token_id == tok.pad_token_id


def test_chat_template_is_chatml(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "3+4\n"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4\n<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "3+4\n"}], add_generation_prompt=True)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2, "the markers are single tokens"


def test_round_trip_is_exact(tok):
    for text in SOLUTIONS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, text
    assert tok.encode("3+4\n")[0] != tok.bos_token_id, "Qwen2 adds no BOS"


def test_bpe_merged(tok):
    merged = [t for t in tok.get_vocab() if len(t) > 1 and t not in tok.all_special_tokens]
    assert "####" in merged
    assert len(tok.encode(LONG)) < len(LONG)


def test_the_loader_applies_the_trained_merges(qwen2, tok):
    """AutoTokenizer loads a qwen2 checkpoint as Qwen2Tokenizer, which rebuilds the pre-tokenizer from its
    own code: the ids must still be those of the tokenizer.json that was trained."""
    trained = Tokenizer.from_file(str(qwen2 / "tokenizer.json"))
    for text in SOLUTIONS:
        assert tok.encode(text) == trained.encode(text).ids


def test_parameter_count(qwen2):
    model = AutoModelForCausalLM.from_pretrained(qwen2)
    n = param_count(qwen2)
    assert n == sum(p.numel() for p in model.parameters())
    assert 50_000 < n < 200_000  # tiny: 2 layers of width 64 over ~265 tokens, head tied


def test_sizes_grow_in_order_and_suit_vllm():
    """micro < mini < small in width and depth; every size but tiny has heads of at least 32 dimensions, the least
    vLLM's CPU attention takes (the stand-ins the vLLM tests and runs load)."""
    order = [SIZES[s] for s in ("tiny", "micro", "mini", "small")]
    assert [c.hidden_size for c in order] == sorted({c.hidden_size for c in order})
    assert [c.num_layers for c in order[1:]] == sorted({c.num_layers for c in order[1:]})  # tiny's depth is micro's
    for name, cfg in SIZES.items():
        if name != "tiny":
            assert cfg.hidden_size // cfg.num_heads >= 32, name


def test_same_seed_same_bytes(qwen2, tmp_path):
    again, other = _build(tmp_path / "again", seed=0), _build(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(qwen2 / name), name
    assert _sha256(other / "model.safetensors") != _sha256(qwen2 / "model.safetensors")


def test_generate_runs_on_cpu(qwen2, tok, one_torch_thread):
    model = AutoModelForCausalLM.from_pretrained(qwen2).eval()
    batch = tok(["3+4\n"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 1 and batch["input_ids"].shape[1] < out.shape[1] <= batch["input_ids"].shape[1] + 6


def test_llama_adds_bos_and_keeps_digit_runs(llama):
    tok = AutoTokenizer.from_pretrained(llama)
    assert type(AutoModelForCausalLM.from_pretrained(llama)).__name__ == "LlamaForCausalLM"
    ids = tok.encode(LONG)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == LONG
    assert "10" in tok.get_vocab(), "Llama 3 splits numbers into runs of up to three digits"


def test_refuses_a_non_empty_folder_and_a_bad_config(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        _build(tmp_path)
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        StandinConfig(arch="gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        _build(tmp_path / "new", num_kv_heads=3)


def test_cli_builds_a_loadable_model(tmp_path):
    out = tmp_path / "standin"
    r = run_coevo("build-model", str(out), "--domain", "arith", "--size", "tiny", "--per-level", "50",
                  "--copy-steps", "3", check=True, timeout=300)
    assert "parameters" in r.stdout and "vocabulary 265" in r.stdout
    assert "[copy pretraining] step 3/3, loss" in r.stdout
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|endoftext|>"


def test_cli_bad_input_exits_2(tmp_path):
    r = run_coevo("build-model", str(tmp_path / "m"), "--arch", "gpt2", timeout=120)
    assert r.returncode == 2 and "gpt2" in r.stderr
    assert not (tmp_path / "m").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    r = run_coevo("build-model", str(tmp_path / "full"), timeout=120)
    assert r.returncode == 2 and "full" in r.stderr and "not an empty folder" in r.stderr


def _copied(model_dir: Path) -> float:
    """The share of the returning digits of fresh `copy_batch` sequences that the model's argmax gets right."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    right = total = 0
    for x, y in copy_batch(*copy_vocab(tok), random.Random(99), 32, (32, 96)):
        with torch.no_grad():
            guess = model(input_ids=torch.tensor([x])).logits[0, :-1].argmax(-1).tolist()
        pairs = [(g, t) for g, t in zip(guess, y[1:]) if t != -100]
        right += sum(g == t for g, t in pairs)
        total += len(pairs)
    return right / total


def test_copy_pretraining_makes_the_init_copy_numbers_from_its_context(qwen2, tmp_path, one_torch_thread):
    """600 steps on 24-64 tokens: .04 of the digits right before, .72 after (.72 after 1000, so it has
    passed the jump where copying forms, at 300-600 steps), on longer sequences than it trained on."""
    copier = _build(tmp_path / "copier", copy_steps=600, copy_lengths=(24, 64))
    before, after = _copied(qwen2), _copied(copier)
    assert before < 0.2, before
    assert after > 0.5, (before, after)
