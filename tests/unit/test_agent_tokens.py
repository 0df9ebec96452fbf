"""The agent loop's tokens, token by token, on a real byte-level BPE tokenizer (a stand-in built here) and a real
model sampling: the ids trained on are the ids sampled (append-only tokenization), and the loss mask covers
the assistant's tokens and nothing else."""

from __future__ import annotations

import pytest

from components.envs import get_env, toolcalls
from components.envs.agent import ChatEncoder, ChatSampler, TemplateError, assistant_spans
from components.envs.base import EpisodeLimits, EpisodeRunner, StepResult
from components.models.backends import HFBackend
from components.models.standin import SIZES, build_standin, domain_texts


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "standin"
    build_standin(path, domain_texts(get_env("calculator"), n_per_level=60), SIZES["tiny"])
    return HFBackend(str(path), prompt_format="chat", progress=False)


class Echo:
    """Three turns whatever the agent writes: each answered by a tool observation holding text the tokenizer must
    meet at a boundary (a newline, digits, a JSON fragment), then done."""

    def __init__(self, question):
        self.question, self.turns = question, 0

    def reset(self):
        return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": self.question}]

    def step(self, action):
        self.turns += 1
        if self.turns == 3:
            return StepResult([], 0.0, True)
        return StepResult([{"role": "tool", "name": "calculate", "content": f'\n408 {{"x": {self.turns}}}\n'}],
                          None, False)


class Recording:
    """The backend as the sampler sees it, keeping every prompt it was given."""

    def __init__(self, backend):
        self.backend, self.prompts = backend, []

    def generate_ids(self, prompt_ids, *args, **kw):
        self.prompts += [list(p) for p in prompt_ids]
        return self.backend.generate_ids(prompt_ids, *args, **kw)


def test_the_ids_trained_on_are_the_ids_sampled_and_only_they_carry_loss(standin):
    tok = standin.tok
    enc = ChatEncoder(tok, "standin")
    backend = Recording(standin)
    sampler = ChatSampler(backend, enc, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0, max_context=256)
    problems = get_env("calculator").sample_problems(2, 4, seed=0)
    records = EpisodeRunner(sampler, toolcalls.parse, EpisodeLimits(max_turns=3)).run([(p, Echo(p.prompt)) for p in problems])
    assert len(backend.prompts) == 3 * len(problems)  # three turns of four episodes, sampled in three batches
    respelled = 0
    for rec in records:
        assert rec.status == "done" and [t.role for t in rec.turns].count("assistant") == 3
        ids, mask = enc.encode(rec.messages, add_generation_prompt=False)
        # Append-only: every prompt the model was given is a prefix of the conversation trained on.
        prompts = [p for p in backend.prompts if ids[:len(p)] == p]
        assert len(prompts) == 3, "a turn's prompt is not a prefix of the final conversation's ids"
        sampled = [list(t.token_ids) for t in rec.turns if t.role == "assistant"]
        # Masked-in tokens are exactly the sampled ones, turn by turn, where the model sampled them.
        spans = assistant_spans(mask)
        assert [ids[a:b] for a, b in spans] == sampled
        assert [a for a, _ in spans] == [len(p) for p in sorted(prompts, key=len)]  # each begins where its prompt ended
        # Everything else is the template's and the environment's: the system and user turns, headers, observations.
        context = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert context.count("<|im_start|>assistant\n") == 3 and context.count("<tool_response>") == 2
        assert "What is" in context and '{"x": 1}' in context
        # Re-tokenizing the sampled text would not give the sampled ids back: the bug this tokenization avoids.
        for t in rec.turns:
            if t.role == "assistant":
                own = list(t.token_ids)[:-1] if t.token_ids[-1] in standin.prompts.eos_ids else list(t.token_ids)
                respelled += tok(t.content, add_special_tokens=False)["input_ids"] != own
    assert respelled > 0, "no sampled turn was re-spelled by re-tokenizing: the test did not meet its case"


def test_trl_trains_on_the_masked_tokens_alone(standin, tmp_path):
    """The rows train_sft hands TRL, after TRL's own preparation: labels are the ids where the mask is 1, else -100."""
    import datasets
    from trl import SFTTrainer

    from trl import SFTConfig

    from components.training.sft import SFTParams, _episode_rows, _sft_config

    env = get_env("calculator")
    episodes = [{"messages": env.reference_episode(p)} for p in env.sample_problems(3, 3, seed=1)]
    params = SFTParams(max_steps=1, batch_size=3, prompt_format="chat", max_length=256)
    rows = _episode_rows(standin.tok, "standin", episodes, params)
    trainer = SFTTrainer(model=standin.model, args=_sft_config(SFTConfig, str(tmp_path), params, True, fp16=False),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=standin.tok)
    enc = ChatEncoder(standin.tok, "standin")
    for row, ex in zip(trainer.train_dataset, episodes, strict=True):
        ids, mask = enc.encode(ex["messages"], add_generation_prompt=False)
        assert row["input_ids"] == ids
        assert row["labels"] == [t if m else -100 for t, m in zip(ids, mask)]
        trained = standin.tok.decode([t for t in row["labels"] if t != -100])
        call, answer = [m["content"] for m in ex["messages"] if m["role"] == "assistant"]
        assert trained == call + "<|im_end|>" + answer + "<|im_end|>"  # the tool's result is not in it


def test_a_template_that_rewrites_the_assistants_text_is_refused(standin):
    tok = standin.tok
    original = tok.chat_template
    try:
        tok.chat_template = original.replace("message['content'] + '<|im_end|>'", "message['content'] | trim + '<|im_end|>'")
        enc = ChatEncoder(tok, "trimming-model")
        with pytest.raises(TemplateError, match="trimming-model.*assistant turn 2"):
            enc.encode([{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                        {"role": "assistant", "content": " 4 "}])
    finally:
        tok.chat_template = original


def test_grpo_sees_an_episode_as_prompt_then_masked_completion_with_each_turns_advantage(standin):
    """An episode as recipe grpo hands it to TRL: the ids before the first assistant token are the prompt, the
    rest the completion with env_mask on the assistant's tokens, and each turn's tokens carry its own advantage."""
    from components.training.grpo import episode_rollout

    enc = ChatEncoder(standin.tok, "standin")
    messages = get_env("calculator").reference_episode(get_env("calculator").sample_problems(3, 1, seed=2)[0])
    ids, mask = enc.encode(messages, add_generation_prompt=False)
    r = episode_rollout(enc, "t", "g", messages, 1.0, [0.5, -0.25])
    assert r["prompt_ids"] + r["completion_ids"] == ids and r["env_mask"] == mask[len(r["prompt_ids"]):]
    assert r["env_mask"][0] == 1 and 1 not in mask[:len(r["prompt_ids"])]
    turns = [a for a, m in zip(r["advantage"], r["env_mask"], strict=True) if m]
    first_turn = len(standin.tok([m for m in messages if m["role"] == "assistant"][0]["content"],
                                 add_special_tokens=False)["input_ids"]) + 1  # its content and turn end
    assert turns == [0.5] * first_turn + [-0.25] * (len(turns) - first_turn)
    assert episode_rollout(enc, "t", "g", messages, 1.0, [0.5, 0.5])["advantage"] == 0.5
    with pytest.raises(ValueError, match="episode t has 2 assistant turns in its tokens and 1 turn advantages"):
        episode_rollout(enc, "t", "g", messages, 1.0, [0.5])


def test_dpo_on_episodes_sums_each_sides_log_probabilities_over_its_sampled_turns_alone(standin, tmp_path):
    """Two sampled episodes of one problem as TRL's DPO batch: the ids are the conversations as sampled, and the
    completion mask that the log-probabilities sum over is 1 on the assistant's sampled ids and 0 on the prompt,
    the headers and the tool's observations. Then train_dpo trains on such pairs and ranks chosen first."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from components.training.dpo import (AssistantMaskCollator, DPOParams, _dpo_config, _episode_trainer,
                                         episode_pair_rows, train_dpo)

    tok = standin.tok
    enc = ChatEncoder(tok, "standin")
    sampler = ChatSampler(standin, enc, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=3, max_context=256)
    problems = get_env("calculator").sample_problems(2, 3, seed=4)
    records = EpisodeRunner(sampler, toolcalls.parse, EpisodeLimits(max_turns=3)).run(
        [(p, Echo(p.prompt)) for p in problems for _ in range(2)])
    pairs = [{"chosen": a.messages, "rejected": b.messages} for a, b in zip(records[::2], records[1::2], strict=True)]
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    params = DPOParams(max_steps=1, batch_size=3, prompt_format="chat", max_length=512)
    rows = episode_pair_rows(tok, "standin", pairs, params)
    # A model of its own: TRL patches the forward of the model it is given, and the fixture's is shared.
    model = AutoModelForCausalLM.from_pretrained(standin.model.name_or_path)
    trainer = _episode_trainer(DPOTrainer)(model=model, args=_dpo_config(DPOConfig, str(tmp_path), params, True,
                                                                         fp16=False),
                                           train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    collate = AssistantMaskCollator(trainer.data_collator)
    batch = collate([trainer.train_dataset[i] for i in range(len(pairs))])
    sides = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    for j, messages in enumerate(sides):
        ids, mask = enc.encode(messages, add_generation_prompt=False)
        assert batch["input_ids"][j, :len(ids)].tolist() == ids
        assert batch["completion_mask"][j].tolist() == mask + [0] * (batch["input_ids"].shape[1] - len(ids))
        trained = [t for t, m in zip(ids, mask) if m]
        record = records[2 * (j % len(pairs)) + j // len(pairs)]
        assert trained == [i for t in record.turns if t.role == "assistant" for i in t.token_ids]
        assert "<tool_response>" not in tok.decode(trained)  # the observations carry no loss
    # TRL's own mask would have put the observations in: the override is what keeps them out.
    assert (trainer.data_collator([trainer.train_dataset[0]])["completion_mask"].sum()
            > batch["completion_mask"][0].sum())
    with pytest.raises(ValueError, match=r"pairs\[0\]: the chosen and rejected episodes open with different"):
        episode_pair_rows(tok, "standin", [{"chosen": pairs[0]["chosen"], "rejected": pairs[1]["rejected"]}], params)

    metrics = train_dpo(standin.model.name_or_path, None, pairs, str(tmp_path / "dpo"),
                        DPOParams(max_steps=6, batch_size=3, learning_rate=1e-3, prompt_format="chat",
                                  max_length=512, logging_steps=1))
    assert metrics["pairs"] == len(pairs) and metrics["steps"] == 6 and metrics["truncated"] == 0
    assert metrics["rewards/accuracies"] == 1.0 and metrics["rewards/margins"] > 0


def test_the_implicit_prm_rewards_each_turn_by_the_log_ratio_over_the_ids_it_sampled(standin, tmp_path):
    """An episode's implicit turn rewards: beta * (log pi - log pi_ref) summed over each assistant turn's sampled
    ids in the conversation as sampled, recomputed here by one forward pass each; nothing from the observations."""
    import torch

    from components.rewards import save_checkpoint
    from components.rewards.implicit import implicit_turn_rewards

    tok = standin.tok
    enc = ChatEncoder(tok, "standin")
    sampler = ChatSampler(standin, enc, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=5, max_context=256)
    problems = get_env("calculator").sample_problems(2, 3, seed=6)
    chats = [r.messages for r in EpisodeRunner(sampler, toolcalls.parse, EpisodeLimits(max_turns=3)).run(
        [(p, Echo(p.prompt)) for p in problems])]
    from transformers import AutoModelForCausalLM

    # Models of their own, loaded from the files: a trainer built on the fixture's model patches its forward.
    policy, reference = tmp_path / "policy", AutoModelForCausalLM.from_pretrained(standin.model.name_or_path).eval()
    moved = AutoModelForCausalLM.from_pretrained(standin.model.name_or_path)
    with torch.no_grad():
        for w in moved.parameters():
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    save_checkpoint(moved, tok, str(policy))
    rewards = implicit_turn_rewards(str(policy), standin.model.name_or_path, chats, beta=0.5, device_name="cpu")
    for chat, got in zip(chats, rewards, strict=True):
        ids, mask = enc.encode(chat, add_generation_prompt=False)
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = [m(input_ids=x).logits[0, :-1].float().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
                    for m in (moved.eval(), reference)]
        per_token = 0.5 * (logp[0] - logp[1])  # token t at index t - 1
        turns = [float(per_token[a - 1:b - 1].sum()) for a, b in assistant_spans(mask)]
        assert len(got) == len(turns) == 3
        assert got == pytest.approx(turns, abs=1e-4) and any(abs(v) > 1e-3 for v in got)
    same = implicit_turn_rewards(standin.model.name_or_path, standin.model.name_or_path, chats[:1], device_name="cpu")
    assert same == [[0.0, 0.0, 0.0]]


def test_the_samplers_confidence_scores_each_turn_by_its_least_likely_sampled_id(standin):
    """score.reward_model=confidence on episodes: each assistant turn scores exp of the lowest log-probability among
    the ids it sampled, in the conversation as sampled, recomputed here by one forward pass each; the observations'
    tokens count for nothing."""
    import math

    import torch

    from components.rewards import load_reward_model

    enc = ChatEncoder(standin.tok, "standin")
    sampler = ChatSampler(standin, enc, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=7, max_context=256)
    problems = get_env("calculator").sample_problems(2, 3, seed=8)
    chats = [r.messages for r in EpisodeRunner(sampler, toolcalls.parse, EpisodeLimits(max_turns=3)).run(
        [(p, Echo(p.prompt)) for p in problems])]
    rm = load_reward_model("confidence", standin.model.name_or_path)
    got = rm.score_episodes(chats, batch_size=2)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(standin.model.name_or_path).eval()
    for chat, scores in zip(chats, got, strict=True):
        ids, mask = enc.encode(chat, add_generation_prompt=False)
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = model(input_ids=x).logits[0, :-1].float().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
        turns = [math.exp(float(logp[a - 1:b - 1].min())) for a, b in assistant_spans(mask)]
        assert len(scores) == len(turns) == sum(m["role"] == "assistant" for m in chat) > 0
        assert scores == pytest.approx(turns, rel=1e-4) and all(0 < v <= 1 for v in scores)


def test_a_replay_is_measured_as_sft_encodes_it_against_max_length(standin):
    """filter.hindsight and filter.variants replay episodes on other tasks, whose observations can be longer than
    the source's: the filter leaves out those SFT could not take whole (train_policy.max_length), measured on the
    stored turns with the policy's chat template, as `train_sft` encodes them."""
    from components.envs.code import TASKS, CodeEnv
    from components.envs.hindsight import longer_than, replay
    from components.envs.rollout import EpisodeBatch, conversations

    env = CodeEnv(revise_fraction=1.0)  # a slipped try first: its failing tests' observation is long
    short, long_ = env.task(1, TASKS[1][0], {"k": 2, "c": 1, "m": 3}), env.task(4, TASKS[4][4], {"k": 3, "c": 1, "m": 11})
    batch = EpisodeBatch()
    for p in (short, long_):
        rec = replay(env, p, env.reference_episode(p))
        assert rec.right
        batch.add_episode(env, rec, 0, experiment="e", round=1, purpose="variant", policy_model_id="e/p", seed=0,
                          temperature=1.0, top_p=1.0, max_new_tokens=120)
    enc = ChatEncoder(standin.tok, "standin")
    chats = conversations(batch.tables["turns"])
    n = {tid: len(enc.encode(m, add_generation_prompt=False)[0]) for tid, m in chats.items()}
    lo, hi = sorted(n.values())
    assert lo < hi
    [long_id] = [tid for tid, k in n.items() if k == hi]
    assert longer_than(batch.tables, enc, lo) == {long_id}
    assert longer_than(batch.tables, enc, hi) == set()  # max_length itself fits
    assert longer_than(batch.tables, enc, lo - 1) == set(n)
