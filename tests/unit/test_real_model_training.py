"""The trainers and the HF backend on a real-shaped model: the tiny stand-in (byte-level BPE, ChatML template,
Qwen2), trained for real on CPU a few steps at a time. Chat prompts reach TRL and generation stops at the
turn end; truncation is counted and refused past its allowance; bf16 weights stay bf16; LoRA saves merged
or as an adapter that load_policy reads.

    .venv/bin/python -m pytest tests/unit/test_real_model_training.py -q
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.models.backends import HFBackend
from components.models.prompts import PromptFormat, chat_turn_end, render_prompt
from components.models.standin import CHAT_TEMPLATE, EOS, IM_END, SIZES, build_standin, domain_texts
from components.models.tiny import TinyLlamaConfig, create_tiny_llama, load_policy
from components.training.common import TruncationError
from components.training.dpo import DPOParams, train_dpo
from components.training.lora import LoraParams
from components.training.sft import SFTParams, train_sft

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT = PromptFormat("chat")
EX = {"prompt": "7-9+4\n", "completion": "7-9=-2\n-2+4=2\n#### 2\n"}


def _examples(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}\n", "completion": f"{a}+{b}={a + b}\n#### {a + b}\n"}
            for a, b in ((i % 10, (i * 7) % 10) for i in range(n))]


def _dtypes(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def _weights(path: str | Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict())


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    return build_standin(tmp_path_factory.mktemp("standin") / "model", domain_texts("arith", n_per_level=50),
                         SIZES["tiny"], seed=0)


@pytest.fixture(scope="module")
def chat_sft(standin, tmp_path_factory) -> tuple[Path, dict]:
    """The stand-in, chat-trained to answer one prompt: it learns the completion and the turn end."""
    out = tmp_path_factory.mktemp("chat") / "model"
    metrics = train_sft(str(standin), [EX], str(out), SFTParams(
        max_steps=120, batch_size=8, learning_rate=3e-3, warmup_ratio=0.0, logging_steps=120, prompt_format=CHAT))
    return out, metrics


# -- chat prompts ----------------------------------------------------------------------------------

def test_chat_rendering_reaches_the_trainer(standin, chat_sft):
    out, m = chat_sft
    tok = AutoTokenizer.from_pretrained(standin)
    rendered = render_prompt(tok, EX["prompt"], CHAT)
    assert rendered == f"<|im_start|>user\n{EX['prompt']}{IM_END}\n<|im_start|>assistant\n"
    # One example per step (a dataset of one): TRL fed exactly the rendered prompt, the completion, <|im_end|>.
    per_step = len(tok(rendered + EX["completion"] + IM_END)["input_ids"])
    assert m["tokens_seen"] == 120 * per_step
    assert per_step > len(tok(EX["prompt"] + EX["completion"] + EOS)["input_ids"]) + 5  # the template's tokens
    assert m["truncated"] == 0 and m["truncated_fraction"] == 0.0
    # The turn end is the EOS now, as Qwen2.5-Instruct ships it; the old EOS still stops generation.
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.eos_token == IM_END and saved.pad_token == tok.pad_token
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.eos_token_id == saved.eos_token_id
    assert set(model.generation_config.eos_token_id) == {saved.eos_token_id, tok.eos_token_id}


def test_chat_model_generates_through_the_backend_and_stops_at_the_turn_end(chat_sft):
    out, _ = chat_sft
    backend = HFBackend(str(out), progress=False, prompt_format="chat")
    (sample,), = backend.generate([EX["prompt"]], n=1, temperature=0.0, top_p=1.0, max_new_tokens=40, seed=0)
    assert sample.text == EX["completion"] and sample.finish_reason == "stop"
    tok = backend.tok
    assert sample.num_tokens == len(tok(EX["completion"])["input_ids"]) + 1  # the completion, then <|im_end|>
    ids = tok(render_prompt(tok, EX["prompt"], CHAT) + EX["completion"], return_tensors="pt")["input_ids"]
    ids = ids.to(backend.model.device)  # the backend's device: the GPU where one exists
    with torch.no_grad():
        nxt = int(backend.model(ids).logits[0, -1].argmax())
    assert tok.convert_ids_to_tokens(nxt) == IM_END  # what training taught it to end with


def test_chat_needs_a_chat_template_and_names_the_model(tmp_path):
    plain = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                              tmp_path / "char", seed=0)
    with pytest.raises(ValueError, match=f"{plain}: prompt_format is 'chat' but its tokenizer has no chat_template"):
        train_sft(str(plain), [EX], str(tmp_path / "out"), SFTParams(max_steps=1, prompt_format=CHAT))
    with pytest.raises(ValueError, match=f"{plain}: prompt_format is 'chat'"):
        HFBackend(str(plain), progress=False, prompt_format="chat")
    assert not (tmp_path / "out").exists()


def test_a_template_that_writes_the_bos_gets_one_bos(tmp_path):
    """Llama 3's template starts with the BOS its tokenizer adds again: rendered text must not carry it twice."""
    path = build_standin(tmp_path / "llama", domain_texts("arith", levels=[1, 2], n_per_level=20), SIZES["tiny"],
                         arch="llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    ids = tok(render_prompt(tok, "3+4\n", CHAT))["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert chat_turn_end(tok) == IM_END


# -- lengths ---------------------------------------------------------------------------------------

def test_truncation_is_counted_and_refused_past_the_allowance(standin, tmp_path):
    data = _examples(6) + [{"prompt": "1+2+3+4+5+6+7+8+9\n", "completion": "1+2=3\n" * 8 + "#### 45\n"}] * 2
    with pytest.raises(TruncationError, match=r"^2 of 8 examples \(25\.0%\) exceed train_policy\.max_length=24 "
                                              r"tokens; raise train_policy\.max_length or allow it with "
                                              r"train_policy\.max_truncated_fraction"):
        train_sft(str(standin), data, str(tmp_path / "no"), SFTParams(max_steps=1, max_length=24))
    assert not (tmp_path / "no").exists()  # refused before training
    m = train_sft(str(standin), data, str(tmp_path / "yes"),
                  SFTParams(max_steps=1, batch_size=8, max_length=24, max_truncated_fraction=0.25))
    assert m["truncated"] == 2 and m["truncated_fraction"] == 0.25
    assert m["tokens_seen"] == sum(min(24, n) for n in _lengths(standin, data))  # TRL cut them to 24
    pairs = [{"prompt": d["prompt"], "chosen": d["completion"], "rejected": d["completion"] + "1\n"} for d in data]
    with pytest.raises(TruncationError, match=r"2 of 8 pairs \(25\.0%\) exceed my_section\.max_length=24"):
        train_dpo(str(standin), None, pairs, str(tmp_path / "dpo"), DPOParams(max_steps=1, max_length=24,
                                                                              setting="my_section"))


def _lengths(path: Path, data: list[dict[str, str]]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path)
    return [len(tok(d["prompt"] + d["completion"] + tok.eos_token)["input_ids"]) for d in data]


def test_backend_max_prompt_length_cuts_from_the_left_and_counts(chat_sft):
    out, _ = chat_sft
    long_prompt = "1+2+3+4+5+6+7+8+9\n"
    strict = HFBackend(str(out), progress=False, prompt_format="chat", max_prompt_length=30)
    with pytest.raises(TruncationError, match=r"1 of 2 prompts \(50\.0%\) exceed generate\.max_prompt_length=30"):
        strict.generate([EX["prompt"], long_prompt], n=1, temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0)
    lenient = HFBackend(str(out), progress=False, prompt_format="chat", max_prompt_length=30,
                        max_truncated_fraction=0.5)
    a = lenient.generate([EX["prompt"], long_prompt], n=2, temperature=0.0, top_p=1.0, max_new_tokens=40, seed=0)
    assert lenient.truncated_prompts == 1  # per prompt, not per sample
    assert a[0][0].text == EX["completion"]  # the short one is untouched
    assert lenient.prompts._cut([list(range(40)), [1]]) == [list(range(10, 40)), [1]]  # the end of the prompt is kept


# -- dtype -----------------------------------------------------------------------------------------

def test_bf16_training_saves_bf16_and_auto_keeps_it(standin, tmp_path):
    params = dict(max_steps=2, batch_size=4, learning_rate=1e-3, logging_steps=1)
    m = train_sft(str(standin), _examples(8), str(tmp_path / "bf16"), SFTParams(dtype="bfloat16", **params))
    assert _dtypes(tmp_path / "bf16") == {"BF16"} and math.isfinite(m["final_loss"])
    train_sft(str(tmp_path / "bf16"), _examples(8), str(tmp_path / "auto"), SFTParams(dtype="auto", **params))
    assert _dtypes(tmp_path / "auto") == {"BF16"}
    assert _dtypes(standin) == {"F32"}  # the default stays float32
    model, _ = load_policy(tmp_path / "auto", dtype="auto")
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtype": "float16"}, "float16 trains only LoRA adapters"),
    ({"dtype": "float16", "use_cpu": True, "lora": {"r": 4}}, "float16 needs a CUDA device"),
    ({"dtype": "fp32"}, "dtype must be one of float32, bfloat16, float16, auto"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
    ({"max_truncated_fraction": 1.5}, r"max_truncated_fraction must be in \[0, 1\]"),
    ({"lora": {"r": 0}}, "LoraParams.r must be >= 1"),
])
def test_bad_settings_fail_at_build(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTParams(**kwargs)
    with pytest.raises(ValueError, match=match):
        DPOParams(**kwargs)


# -- LoRA ------------------------------------------------------------------------------------------

def test_lora_merged_is_a_plain_checkpoint_with_only_adapted_weights_changed(standin, tmp_path):
    out = tmp_path / "merged"
    m = train_sft(str(standin), _examples(8), str(out), SFTParams(
        max_steps=3, batch_size=4, learning_rate=1e-2, logging_steps=1, lora=LoraParams(r=4, alpha=8),
        gradient_accumulation_steps=2, gradient_checkpointing=True))
    assert m["steps"] == 3 and m["tokens_seen"] == sum(_lengths(standin, _examples(8))) * 3  # 2 x 4 per step
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    base, merged = _weights(standin), _weights(out)
    assert merged.keys() == base.keys()  # no peft prefixes: HF (and vLLM) read it as the base architecture
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])


def test_lora_adapter_dir_loads_through_load_policy(standin, tmp_path):
    out = tmp_path / "adapter"
    train_sft(str(standin), _examples(8), str(out), SFTParams(
        max_steps=3, batch_size=4, learning_rate=1e-2, logging_steps=1,
        lora=LoraParams(r=4, alpha=8, target_modules=["q_proj", "v_proj"], merge=False)))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(standin.resolve())
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    model, tok = load_policy(out)
    assert tok.padding_side == "left" and type(model).__name__ == "Qwen2ForCausalLM"
    loaded, base = dict(model.state_dict()), _weights(standin)
    v, k = "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(loaded[v], base[v])
    assert torch.equal(loaded[k], base[k])  # not a target
    (s,), = HFBackend(str(out), progress=False).generate(["3+4\n"], n=1, temperature=0.0, top_p=1.0,
                                                         max_new_tokens=4, seed=0)
    assert s.num_tokens > 0
    # Trained on again, the adapter folder is a starting point like any checkpoint: adapters chain back to the base.
    train_sft(str(out), _examples(4), str(tmp_path / "again"), SFTParams(
        max_steps=1, batch_size=4, logging_steps=1, lora=LoraParams(r=4, merge=False)))
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        out.resolve())
    load_policy(tmp_path / "again")


def test_lora_dpo_in_chat_uses_the_base_as_reference(standin, tmp_path):
    pairs = [{"prompt": e["prompt"], "chosen": e["completion"], "rejected": e["completion"].replace("#### ", "#### 1")}
             for e in _examples(8)]
    out = tmp_path / "dpo"
    m = train_dpo(str(standin), None, pairs, str(out), DPOParams(
        max_steps=2, batch_size=8, learning_rate=1e-2, logging_steps=1, prompt_format=CHAT,
        lora=LoraParams(r=4, merge=False)))
    assert math.isclose(m["first_loss"], math.log(2), rel_tol=1e-4)  # the adapters start at zero: policy == reference
    assert m["pairs"] == 8 and m["truncated"] == 0
    assert AutoTokenizer.from_pretrained(out).eos_token == IM_END
    model, _ = load_policy(out)
    assert IM_END in AutoTokenizer.from_pretrained(out).convert_ids_to_tokens(model.generation_config.eos_token_id)


def test_lora_target_modules_that_match_nothing_name_the_arch(standin, tmp_path):
    with pytest.raises(ValueError, match=r"train_policy\.lora\.target_modules \['c_attn'\] match no module of "
                                         r"Qwen2ForCausalLM \(qwen2\); its linear modules are down_proj, gate_proj, "
                                         r"k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        train_sft(str(standin), _examples(4), str(tmp_path / "out"),
                  SFTParams(max_steps=1, lora=LoraParams(target_modules=["q_proj", "c_attn"])))
    assert not (tmp_path / "out").exists()
