"""What a training stage trains on, as pure functions: round 0's demonstrations, a round's new examples
mixed with replayed ones, and how many steps that is worth (0: the policy carries over unchanged)."""

from __future__ import annotations

import math
import random
from typing import Any

from components.config import BootstrapConfig
from components.domains.base import Domain, unique_problems
from components.generation import problem_row, trajectory_id
from components.seeding import derive_seed


def demonstrations(domain: Domain, b: BootstrapConfig, seed: int, experiment: str, solve: bool = True,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Round 0's gold demonstrations as `problems`, `trajectories` (purpose 'demo') and `selections` rows:
    `problems_per_level` at each of `b.levels` (None: every level of the domain), plus seed demos of `b.seed_levels` making up
    `b.seed_fraction` of the whole; deterministic given `seed`. `solve=False` leaves each `completion` None, for
    an environment whose episodes make it (`envs.rollout.demonstration_episodes`): its reference episode runs its
    tools (the code environment's in its sandbox), which would run twice."""
    problems = []
    for level in domain.levels() if b.levels is None else b.levels:
        problems += domain.sample_problems(level, b.problems_per_level, seed=derive_seed(seed, 0, "demo", level))
    n_seed_total = round(len(problems) * b.seed_fraction / max(1.0 - b.seed_fraction, 1e-9))
    per_seed_level = n_seed_total // max(len(b.seed_levels), 1)
    for level in b.seed_levels:
        problems += domain.sample_problems(level, per_seed_level, seed=derive_seed(seed, 0, "seed_demo", level))
    problems = unique_problems(problems)
    trajs, sels = [], []
    for p in problems:
        tid = trajectory_id(experiment, 0, "demo", p.problem_id, 0)
        trajs.append({
            "trajectory_id": tid, "experiment_id": experiment, "round": 0, "purpose": "demo",
            "problem_id": p.problem_id, "level": p.level, "policy_model_id": None, "sample_index": 0,
            "prompt": p.prompt, "completion": domain.reference_solution(p) if solve else None, "answer": p.answer,
            "num_tokens": 0, "finish_reason": "reference", "temperature": None, "top_p": None, "max_new_tokens": None,
            "seed": None, "token_ids": None,
        })
        sels.append({"trajectory_id": tid, "experiment_id": experiment, "round": 0, "purpose": "policy_sft",
                     "selected": True, "rank": 0, "reason": "gold demonstration", "pair_id": None})
    return [problem_row(p, "train") for p in problems], trajs, sels


def replay_mix(new: dict[str, dict[str, Any]], pool: dict[str, dict[str, Any]], ratio: float,
               seed: int) -> list[tuple[str, dict[str, Any], str]]:
    """A round's training examples: every new selection (id order), then `ratio` x as many replayed from
    `pool` (earlier rounds' selections), a seeded sample; each as (trajectory id, row, 'new' | 'replay').

    >>> new = {"b": {"round": 2}, "a": {"round": 2}}
    >>> pool = {f"p{i}": {"round": 1} for i in range(5)}
    >>> [(t, use) for t, _, use in replay_mix(new, pool, 1.0, seed=0)][:2]
    [('a', 'new'), ('b', 'new')]
    >>> sum(use == "replay" for _, _, use in replay_mix(new, pool, 1.0, seed=0)), len(replay_mix(new, {}, 1.0, 0))
    (2, 2)
    """
    n_replay = min(len(pool), round(ratio * len(new)))
    replay = random.Random(seed).sample(sorted(pool), n_replay)
    return [(tid, new[tid], "new") for tid in sorted(new)] + [(tid, pool[tid], "replay") for tid in replay]


def sft_steps(max_steps: int, epochs: float | None, n_examples: int, batch_size: int) -> int:
    """Optimizer steps for a round: `max_steps`, capped at `epochs` passes over the examples. 0 when nothing
    was kept: the round carries its policy over unchanged, as ReST does, and the next round samples again.

    >>> sft_steps(300, 3.0, 100, 64), sft_steps(300, None, 100, 64), sft_steps(300, 3.0, 0, 64)
    (5, 300, 0)
    """
    if n_examples == 0:
        return 0
    return max_steps if epochs is None else min(max_steps, math.ceil(epochs * n_examples / batch_size))
