"""`coevo`: the policy and its process reward model improve each other (after rStar-Math and ReST-MCTS*).

    coevo run --config configs/arith-coevo.yaml

Each round: the policy samples (until right, optionally step by step under the previous PRM); Monte
Carlo rollouts label the steps (the labeller, `score.mc_strategy`); `train_reward` trains the round's
PRM on those labels; the filter keeps right answers ranked by the PRM (the ranker, `filter.rank_by`),
optionally with DPO pairs; the policy trains on them (the trainer, `train_policy.method`); evaluation
adds PRM best-of-N. docs/coevo-recipe.md has what it measured against `rft`.
"""

from __future__ import annotations

from components.recipes import Recipe, grpo_settings


def check(cfg) -> None:
    if not cfg.train_reward.enabled:
        raise ValueError("recipe 'coevo' trains a PRM each round: set train_reward.enabled=true")
    if cfg.train_policy.method == "grpo":
        raise ValueError("train_policy.method=grpo needs the grpo recipe's groups and advantages: set recipe=grpo")


RECIPE = Recipe(name="coevo",
                stages=("generate", "verify", "score", "train_reward", "filter", "train_policy", "evaluate"),
                description="a PRM trained on Monte Carlo step labels ranks the data; policy and PRM co-evolve",
                check=check, unused=grpo_settings)
