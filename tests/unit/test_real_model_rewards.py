"""The reward models on a real-shaped model: the tiny stand-in (byte-level BPE, ChatML template, Qwen2), trained
for real on CPU a few steps at a time. Step ends are found in the policy's own tokenization of the whole text;
chat prompts reach the PRM and ORM trainers and scorers; truncation is counted and refused past its allowance;
bf16 weights stay bf16; LoRA PRMs (both heads) save merged checkpoints the scorer reads.

    .venv/bin/python -m pytest tests/unit/test_real_model_rewards.py -q
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from components.models.prompts import PromptFormat, render_prompt
from components.models.standin import IM_END, SIZES, build_standin, domain_texts
from components.models.tiny import TinyLlamaConfig, create_tiny_llama, load_policy
from components.models.tokenizer import build_char_tokenizer
from components.rewards.orm import ORMParams, ORMScorer, train_orm
from components.rewards.prm import PRMParams, PRMScorer, encode_steps, prm_head, tokenize_steps, train_prm
from components.training.common import TruncationError
from components.training.lora import LoraParams
from components.training.sft import SFTParams, train_sft

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT = PromptFormat("chat")
LONG_PROMPT = "1+2+3+4+5+6+7+8+9\n"
LONG_STEPS = [f"{sum(range(1, k + 2))}+{k + 2}={sum(range(1, k + 3))}." for k in range(8)] + ["#### 45"]


def _texts() -> list[str]:
    """Arithmetic, plus worked steps that end in ".": a run of symbols takes the step's newline with it, so the BPE
    learns the merge ".\\n" that a step's end falls inside (arith alone ends every step with a digit, which Qwen2's
    split keeps apart from the newline)."""
    return [*domain_texts("arith", n_per_level=50),
            *(f"{a}+{b}\n{a}+{b}={a + b}.\n#### {a + b}\n" for a in range(10) for b in range(10))]


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    return build_standin(tmp_path_factory.mktemp("standin") / "model", _texts(), SIZES["tiny"], seed=0)


def _prm_examples(n: int) -> list[dict]:
    """`n` three-step trajectories, every other one wrong from its first step."""
    out = []
    for i in range(n):
        a, b, c, off = i % 10, (i * 3) % 10, (i * 7) % 10, i % 2
        s = a + b + off
        out.append({"prompt": f"{a}+{b}-{c}\n", "completions": [f"{a}+{b}={s}.", f"{s}-{c}={s - c}.", f"#### {s - c}"],
                    "labels": [not off] * 3})
    return out


def _orm_examples(n: int) -> list[dict]:
    return [{"prompt": f"{a}+{b}\n", "completion": f"{a}+{b}={a + b + off}\n#### {a + b + off}\n", "label": not off}
            for a, b in ((i % 10, (i * 3) % 10) for i in range(n)) for off in (0, 1)]


def _dtypes(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def _per_step(tok, prompt: str, steps: list[str], sep: str = "\n") -> tuple[list[int], list[int]]:
    """The old tokenization: prompt, each step and the separator tokenized apart, then concatenated."""
    prompt_ids, *step_ids, sep_ids = tok([prompt, *steps, sep], add_special_tokens=False)["input_ids"]
    ids, ends = list(prompt_ids), []
    for s in step_ids:
        ids += s + sep_ids
        ends.append(len(ids) - 1)
    return ids, ends


# -- step tokenization ---------------------------------------------------------------------------

def test_step_ends_are_read_from_the_policys_own_tokens(standin, tmp_path):
    tok = AutoTokenizer.from_pretrained(standin)
    steps = ["3+4=7.", "7-2=5.", "#### 5"]
    for fmt in (PromptFormat(), CHAT):
        prompt = render_prompt(tok, "3+4-2\n", fmt)
        text = prompt + "".join(s + "\n" for s in steps)
        ids, ends, prompt_len = encode_steps(tok, prompt, steps)
        assert ids == tok(text)["input_ids"]  # what the policy's tokenizer call gives for the whole text
        assert [tok.decode(ids[e]) for e in ends] == [".\n", ".\n", "\n"]  # the merge holds the step's end
        assert [tok.decode(ids[: e + 1]) for e in ends] == [prompt + "".join(s + "\n" for s in steps[:k + 1])
                                                            for k in range(3)]
        assert tok.decode(ids[:prompt_len]) == prompt
        assert _per_step(tok, prompt, steps)[0] != ids  # tokenized apart, "." and "\n" are two tokens
        assert tokenize_steps(tok, prompt, steps) == (ids, ends)
    # A tokenizer that adds a BOS (Llama's): the ids carry it, and the step ends move with it.
    llama = AutoTokenizer.from_pretrained(build_standin(
        tmp_path / "llama", domain_texts("arith", levels=[1, 2], n_per_level=20), SIZES["tiny"], arch="llama"))
    ids, ends, prompt_len = encode_steps(llama, "3+4\n", ["3+4=7", "#### 7"])
    assert ids == llama("3+4\n3+4=7\n#### 7\n")["input_ids"] and ids[0] == llama.bos_token_id
    assert prompt_len == 1 + len(llama("3+4\n", add_special_tokens=False)["input_ids"])
    assert [llama.decode(ids[e]) for e in ends] == ["\n", "\n"]


def test_char_tokenizer_step_ends_are_as_before():
    tok = build_char_tokenizer()
    for prompt, steps, sep in [("3+4-2\n", ["3+4=7", "7-2=5", "#### 5"], "\n"), ("1+2\n", ["1+2=3", ""], "\n"),
                               ("a", ["b c", "d"], " ; "), ("x\n", [], "\n")]:
        assert tokenize_steps(tok, prompt, steps, sep) == _per_step(tok, prompt, steps, sep)


# -- PRM -------------------------------------------------------------------------------------------

def test_chat_prm_trains_and_scores_the_rendered_text(standin, tmp_path):
    out = tmp_path / "prm"
    m = train_prm(str(standin), _prm_examples(16), str(out), PRMParams(
        max_steps=3, batch_size=8, learning_rate=1e-2, logging_steps=1, prompt_format=CHAT))
    assert m["steps"] == 3 and m["examples"] == 16 and m["labelled_steps"] == 48
    assert m["truncated"] == 0 and m["truncated_fraction"] == 0.0 and math.isfinite(m["final_loss"])
    ex = _prm_examples(4)
    prompts, steps = [e["prompt"] for e in ex], [e["completions"] for e in ex]
    scorer = PRMScorer(str(out), prompt_format="chat")
    scores = scorer.score_steps(prompts, steps)
    assert [len(s) for s in scores] == [3] * 4 and all(0 < p < 1 for s in scores for p in s)
    # By hand: the chat-rendered text, as the policy's tokenizer reads it, the scores at each step's end.
    tok = AutoTokenizer.from_pretrained(standin)
    ids, ends, _ = encode_steps(tok, render_prompt(tok, prompts[0], CHAT), steps[0])
    with torch.no_grad():
        probs = scorer.model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)[:, 1]
    assert scores[0] == pytest.approx(probs[ends].tolist(), abs=1e-5)
    assert PRMScorer(str(out)).score_steps(prompts[:1], steps[:1])[0] != pytest.approx(scores[0], abs=1e-4)  # raw


def test_chat_needs_a_chat_template_and_names_the_model(tmp_path):
    char = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                             tmp_path / "char", seed=0)
    match = f"{char}: prompt_format is 'chat' but its tokenizer has no chat_template"
    with pytest.raises(ValueError, match=match):
        train_prm(str(char), _prm_examples(2), str(tmp_path / "prm"), PRMParams(max_steps=1, prompt_format=CHAT))
    with pytest.raises(ValueError, match=match):
        train_orm(str(char), _orm_examples(2), str(tmp_path / "orm"), ORMParams(max_steps=1, prompt_format=CHAT))
    with pytest.raises(ValueError, match=match):
        PRMScorer(str(char), prompt_format="chat")
    assert not (tmp_path / "prm").exists() and not (tmp_path / "orm").exists()


def test_prm_truncation_is_counted_refused_and_scored_as_far_as_it_fits(standin, tmp_path):
    long = {"prompt": LONG_PROMPT, "completions": LONG_STEPS, "labels": [True] * len(LONG_STEPS)}
    data = _prm_examples(6) + [long] * 2
    tok = AutoTokenizer.from_pretrained(standin)
    limit = 90
    # Raw, every trajectory fits; rendered as chat, the long ones do not: the trainer counts what it reads.
    assert max(len(encode_steps(tok, e["prompt"], e["completions"]).ids) for e in data) <= limit
    chat = [encode_steps(tok, render_prompt(tok, e["prompt"], CHAT), e["completions"]) for e in data]
    assert max(len(c.ids) for c in chat[:6]) <= limit < min(len(c.ids) for c in chat[6:])
    with pytest.raises(TruncationError, match=r"^2 of 8 trajectories \(25\.0%\) exceed train_reward\.max_length=90 "
                                              r"tokens; raise train_reward\.max_length or allow it with "
                                              r"train_reward\.max_truncated_fraction"):
        train_prm(str(standin), data, str(tmp_path / "no"), PRMParams(max_steps=1, max_length=limit,
                                                                      prompt_format=CHAT))
    assert not (tmp_path / "no").exists()  # refused before training
    m = train_prm(str(standin), data, str(tmp_path / "yes"), PRMParams(
        max_steps=1, batch_size=8, logging_steps=1, max_length=limit, max_truncated_fraction=0.25, prompt_format=CHAT))
    assert m["truncated"] == 2 and m["truncated_fraction"] == 0.25
    fit = sum(e < limit for e in chat[-1].ends)
    assert 0 < fit < len(LONG_STEPS) and m["labelled_steps"] == 6 * 3 + 2 * fit  # the cut steps' labels are dropped
    scorer = PRMScorer(str(tmp_path / "yes"), prompt_format="chat", max_length=limit)
    scores = scorer.score_steps([LONG_PROMPT, data[0]["prompt"]], [LONG_STEPS, data[0]["completions"]])
    assert [len(s) for s in scores] == [fit, 3] and scorer.truncated == 1
    full = PRMScorer(str(tmp_path / "yes"), prompt_format="chat").score_steps([LONG_PROMPT], [LONG_STEPS])[0]
    assert scores[0] == pytest.approx(full[:fit], abs=1e-5)  # causal: what fits scores as in the whole text


def test_bf16_prm_saves_bf16_and_scores(standin, tmp_path):
    for head in ("classifier", "likelihood"):
        out = tmp_path / head
        m = train_prm(str(standin), _prm_examples(8), str(out), PRMParams(
            max_steps=2, batch_size=8, logging_steps=1, head=head, dtype="bfloat16"))
        assert _dtypes(out) == {"BF16"} and math.isfinite(m["final_loss"])
        scorer = PRMScorer(str(out), dtype="auto")
        assert scorer.model.dtype == torch.bfloat16
        scores = scorer.score_steps(["3+4\n"], [["3+4=7.", "#### 7"]])
        assert len(scores[0]) == 2 and all(0 <= p <= 1 for p in scores[0])
    assert _dtypes(standin) == {"F32"}  # the default stays float32


@pytest.mark.parametrize("head", ["classifier", "likelihood"])
def test_lora_prm_saves_a_merged_checkpoint_the_scorer_reads(standin, tmp_path, head):
    out = tmp_path / "prm"
    m = train_prm(str(standin), _prm_examples(8), str(out), PRMParams(
        max_steps=2, batch_size=8, learning_rate=1e-2, logging_steps=1, head=head, prompt_format=CHAT,
        lora=LoraParams(r=4, alpha=8)))
    assert m["steps"] == 2 and math.isfinite(m["final_loss"])
    assert not (out / "adapter_config.json").exists() and _dtypes(out) == {"F32"}
    assert prm_head(str(out)) == head
    base = dict(AutoModelForCausalLM.from_pretrained(str(standin)).state_dict())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    q, emb = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"
    assert not torch.equal(saved[q], base[q])  # the adapters, merged in
    assert torch.equal(saved[emb], base[emb])  # not adapted
    if head == "classifier":
        assert {k for k in saved if not k.startswith("model.")} == {"score.weight", "score.bias"}  # no peft names
        assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "bad", "1": "good"}
    else:
        assert not [k for k in saved if "lora" in k or "calibration" in k]
        assert json.loads((out / "config.json").read_text())["prm_calibration"] == [m["calibration_scale"],
                                                                                   m["calibration_bias"]]
    scores = PRMScorer(str(out), prompt_format="chat").score_steps(["3+4\n"], [["3+4=7.", "#### 7"]])
    assert len(scores[0]) == 2 and all(0 <= p <= 1 for p in scores[0])


def test_a_policy_saved_as_an_adapter_is_merged_under_a_new_head(standin, tmp_path):
    policy = tmp_path / "policy"
    train_sft(str(standin), [{"prompt": "3+4\n", "completion": "3+4=7\n#### 7\n"}] * 4, str(policy), SFTParams(
        max_steps=1, batch_size=4, learning_rate=1e-2, warmup_ratio=0.0, logging_steps=1,
        lora=LoraParams(r=4, merge=False)))
    assert (policy / "adapter_config.json").is_file()
    merged = load_policy(policy)[0].state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    # A step at lr 1e-9 leaves the backbone as it starts: the base with the policy's adapter in it.
    train_prm(str(policy), _prm_examples(4), str(tmp_path / "prm"), PRMParams(max_steps=1, batch_size=4,
                                                                               learning_rate=1e-9))
    train_orm(str(policy), _orm_examples(2), str(tmp_path / "orm"), ORMParams(max_steps=1, batch_size=2,
                                                                              learning_rate=1e-9))
    for out in ("prm", "orm"):
        with safe_open(str(tmp_path / out / "model.safetensors"), framework="pt") as f:
            assert not [k for k in f.keys() if "lora" in k]
            assert torch.allclose(f.get_tensor(q), merged[q])
    assert not torch.equal(merged[q], AutoModelForCausalLM.from_pretrained(str(standin)).state_dict()[q])


def test_prm_lora_adapter_only_is_refused():
    with pytest.raises(ValueError, match=r"lora\.merge=False: a reward model is saved merged"):
        PRMParams(lora={"r": 4, "merge": False})


# -- ORM -------------------------------------------------------------------------------------------

def test_chat_orm_trains_counts_truncation_and_scores_at_the_turn_end(standin, tmp_path):
    long = "\n".join(LONG_STEPS) + "\n"
    data = _orm_examples(6) + [{"prompt": LONG_PROMPT, "completion": long, "label": ok} for ok in (True, False)]
    tok = AutoTokenizer.from_pretrained(standin)
    limit = 90  # the long pair fits raw, not rendered as chat
    assert len(tok(LONG_PROMPT + long + tok.eos_token)["input_ids"]) <= limit
    assert len(tok(render_prompt(tok, LONG_PROMPT, CHAT) + long + IM_END)["input_ids"]) > limit
    with pytest.raises(TruncationError, match=r"^1 of 7 pairs \(14\.3%\) exceed train_reward\.max_length=90 tokens"):
        train_orm(str(standin), data, str(tmp_path / "no"), ORMParams(max_steps=1, max_length=limit,
                                                                      prompt_format=CHAT))
    out = tmp_path / "orm"
    m = train_orm(str(standin), data, str(out), ORMParams(
        max_steps=2, batch_size=4, logging_steps=1, max_length=limit, max_truncated_fraction=0.2, prompt_format=CHAT))
    assert m["truncated"] == 1 and m["truncated_fraction"] == pytest.approx(1 / 7)
    assert m["pairs"] == 6  # TRL dropped the one counted: both count the same tokens
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.eos_token == IM_END  # a chat completion ends with the turn end, and the reward is read there
    scorer = ORMScorer(str(out), prompt_format="chat", max_length=limit)
    prompts, completions = [d["prompt"] for d in data[:2]], [d["completion"] for d in data[:2]]
    scores = scorer.score_completions(prompts + [LONG_PROMPT], completions + [long])
    assert scorer.truncated == 1 and all(math.isfinite(s) for s in scores)
    ids = saved(render_prompt(saved, prompts[0], CHAT) + completions[0] + IM_END, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reward = AutoModelForSequenceClassification.from_pretrained(out)(input_ids=ids).logits[0, 0]
    assert scores[0] == pytest.approx(float(reward), abs=1e-5)
