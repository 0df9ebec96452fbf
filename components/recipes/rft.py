"""`rft`: rejection-sampling fine-tuning (STaR, ReST-EM), the baseline every other recipe is measured against.

    coevo run --config configs/arith.yaml

Each round samples the policy, keeps the right answers the verifier (and, with `filter.check_steps`, the
domain's step checker) accepts, deduplicated, and fine-tunes on them with replay. No reward model: the
ranker is the verifier outcome, the trainer SFT.
"""

from __future__ import annotations

from components.recipes import Recipe, grpo_settings


def check(cfg) -> None:
    if cfg.train_reward.enabled:
        raise ValueError("recipe 'rft' uses no reward model: set recipe=coevo, or train_reward.enabled=false")
    if cfg.train_policy.method == "grpo":
        raise ValueError("train_policy.method=grpo needs the grpo recipe's groups and advantages: set recipe=grpo")


RECIPE = Recipe(name="rft", stages=("generate", "verify", "score", "filter", "train_policy", "evaluate"),
                description="outcome filter only, no reward model (STaR / ReST-EM)", check=check, unused=grpo_settings)
