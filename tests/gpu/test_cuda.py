"""Sampling and training on a CUDA device, checked against the same work on the same machine's CPU: seeded
episodes whose ids are the ids trained on, TRL's GRPO on the stored advantages, DPO on episodes with the
assistant mask, and the implicit PRM's turn rewards.

Skipped where no CUDA device exists (CI, the 2-core VM). On a GPU machine: `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import time

import pytest
import torch

from components.domains.arith import ArithDomain
from components.envs import get_env, toolcalls
from components.envs.agent import ChatEncoder, ChatSampler
from components.envs.base import EpisodeLimits, EpisodeRunner
from components.models.backends import HFBackend
from components.models.standin import SIZES, build_standin, domain_texts
from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from components.rl.advantages import group_advantages
from tests.unit.test_agent_tokens import Echo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192)


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda") / "standin"
    build_standin(path, domain_texts(get_env("calculator"), n_per_level=60), SIZES["tiny"])
    return str(path)


def _episodes(backend: HFBackend, seed: int, copies: int = 1):
    enc = ChatEncoder(backend.tok, "standin")
    sampler = ChatSampler(backend, enc, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=seed, max_context=256)
    problems = get_env("calculator").sample_problems(2, 3, seed=seed)
    return EpisodeRunner(sampler, toolcalls.parse, EpisodeLimits(max_turns=3)).run(
        [(p, Echo(p.prompt)) for p in problems for _ in range(copies)])


def test_episodes_sampled_on_cuda_are_seeded_and_their_ids_are_the_ids_trained_on(standin):
    backend = HFBackend(standin, prompt_format="chat", device="cuda", progress=False)
    assert backend.model.device.type == "cuda"
    first, again = _episodes(backend, seed=0), _episodes(backend, seed=0)
    ids = [[t.token_ids for t in r.turns if t.role == "assistant"] for r in first]
    assert ids == [[t.token_ids for t in r.turns if t.role == "assistant"] for r in again]  # the seed decides
    enc = ChatEncoder(backend.tok, "standin")
    for record, sampled in zip(first, ids, strict=True):
        encoded, mask = enc.encode(record.messages, add_generation_prompt=False)
        assert [t for t, m in zip(encoded, mask) if m] == [i for turn in sampled for i in turn]


def test_grpo_on_cuda_trains_on_the_stored_advantages_as_on_cpu(tmp_path):
    """The same rollouts trained on each device: TRL's advantages equal the stored ones, the sampler's
    log-probabilities agree, and the positive-advantage rollouts gain against the others on both."""
    from components.training.grpo import GRPOParams, train_grpo

    init = str(create_tiny_llama(SMALL, tmp_path / "init", seed=0))
    backend = HFBackend(init, batch_size=64, device="cpu", progress=False)
    problems = ArithDomain().sample_problems(2, 8, seed=0)
    prompt_ids = backend.prompts.encode([p.prompt for p in problems])
    samples = backend.generate_ids(prompt_ids, n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0)
    rollouts = [{"trajectory_id": f"{p.problem_id}-{j}", "group_id": p.problem_id, "prompt_ids": ids,
                 "completion_ids": list(s.token_ids), "outcome": float(j % 2 == 0)}
                for p, ids, group in zip(problems, prompt_ids, samples, strict=True) for j, s in enumerate(group)]
    adv = {a["trajectory_id"]: a for a in group_advantages(rollouts)}
    for r in rollouts:
        r |= {"reward": adv[r["trajectory_id"]]["reward"], "advantage": adv[r["trajectory_id"]]["advantage"]}
    runs = {}
    for name, use_cpu in (("cpu", True), ("cuda", False)):
        t0 = time.perf_counter()
        metrics, rows = train_grpo(init, None, rollouts, str(tmp_path / name),
                                   GRPOParams(num_generations=4, groups_per_step=2, num_iterations=2,
                                              learning_rate=3e-3, use_cpu=use_cpu))
        runs[name] = (metrics, {r["trajectory_id"]: r for r in rows}, time.perf_counter() - t0)
    for name, (metrics, rows, wall) in runs.items():
        assert metrics["steps"] == 8 and metrics["advantage_gap"] < 1e-5, (name, metrics)
        moved = {t: (r["new_logprob"] - r["old_logprob"]) / r["tokens"] for t, r in rows.items()}
        up = [moved[t] for t, a in adv.items() if a["advantage"] > 0]
        down = [moved[t] for t, a in adv.items() if a["advantage"] < 0]
        print(f"{name}: {wall:.2f} s ({metrics['runtime_s']:.2f} s in TRL's train), log-probability per token: "
              f"positive advantages {sum(up) / len(up):+.4f}, negative {sum(down) / len(down):+.4f}, "
              f"clip ratio {metrics['clip_ratio']:.4f}")
        assert sum(up) / len(up) - sum(down) / len(down) > 0.05, name
    cpu, cuda = runs["cpu"][1], runs["cuda"][1]
    old_gap = max(abs(cpu[t]["old_logprob"] - cuda[t]["old_logprob"]) for t in cpu)
    new_gap = max(abs(cpu[t]["new_logprob"] - cuda[t]["new_logprob"]) / cpu[t]["tokens"] for t in cpu)
    print(f"cpu vs cuda: old log-probability max gap {old_gap:.2e}, trained, per token {new_gap:.2e}")
    assert old_gap < 1e-3 and new_gap < 0.05


def test_dpo_on_episodes_and_the_implicit_prm_on_cuda(standin, tmp_path):
    """DPO on pairs of episodes sampled on CUDA trains on CUDA and ranks every chosen side first; the implicit
    PRM's turn rewards from the trained policy are the same on CUDA as on CPU."""
    from components.rewards.implicit import implicit_turn_rewards
    from components.training.dpo import DPOParams, train_dpo

    records = _episodes(HFBackend(standin, prompt_format="chat", device="cuda", progress=False), seed=4, copies=2)
    pairs = [{"chosen": a.messages, "rejected": b.messages} for a, b in zip(records[::2], records[1::2], strict=True)]
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    metrics = train_dpo(standin, None, pairs, str(tmp_path / "dpo"),
                        DPOParams(max_steps=6, batch_size=3, learning_rate=1e-3, prompt_format="chat",
                                  max_length=512, logging_steps=1, use_cpu=False))
    assert metrics["steps"] == 6 and metrics["truncated"] == 0
    assert metrics["rewards/accuracies"] == 1.0 and metrics["rewards/margins"] > 0
    chats = [r.messages for r in records]
    on = {d: implicit_turn_rewards(str(tmp_path / "dpo"), standin, chats, beta=0.5, device_name=d)
          for d in ("cpu", "cuda")}
    flat = {d: [v for turns in rewards for v in turns] for d, rewards in on.items()}
    print("implicit turn rewards, cpu vs cuda: max gap "
          f"{max(abs(a - b) for a, b in zip(flat['cpu'], flat['cuda'], strict=True)):.2e} over {len(flat['cpu'])} turns")
    assert flat["cuda"] == pytest.approx(flat["cpu"], abs=1e-3) and any(abs(v) > 1e-3 for v in flat["cuda"])


def test_bfloat16_sft_on_episodes_trains_and_saves_bfloat16_on_cuda(standin, tmp_path):
    from safetensors import safe_open

    from components.training.sft import SFTParams, train_sft

    env = get_env("calculator")
    episodes = [{"messages": env.reference_episode(p)} for p in env.sample_problems(3, 12, seed=1)]
    metrics = train_sft(standin, episodes, str(tmp_path / "sft"),
                        SFTParams(max_steps=10, batch_size=4, learning_rate=3e-3, prompt_format="chat",
                                  max_length=256, dtype="bfloat16", logging_steps=1, use_cpu=False))
    assert metrics["steps"] == 10 and metrics["final_loss"] < metrics["first_loss"], metrics
    with safe_open(str(tmp_path / "sft" / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
