"""`grpo`: online RL in rounds. Each round samples groups, verifies and scores them, computes group-relative
advantages, and trains a clipped policy gradient with TRL's GRPOTrainer on them (Shao et al. 2024; DAPO).

    coevo run --config configs/micro-grpo.yaml

- generate: `samples_per_problem` rollouts per problem, a group, with the sampled token ids stored;
- verify, score: the outcome reward, and the reward model's scores where one is set (`score.reward_model`);
- train_reward (with `train_reward.enabled`): the round's PRM on its Monte Carlo step labels, which shapes the
  next round's rewards (`train_policy.grpo.shaping_weight`, per step with `credit: step`);
- filter: each rollout's advantage (`advantages` in the store); groups whose rewards are all equal are dropped
  (DAPO's dynamic sampling), and `filter.max_groups` caps the rest; with `filter.min_step_score` the reward model
  judges which right answers self-imitation trains on (`selections`, purpose ptx), and with `filter.check_steps` the
  domain's step checker does too (a right answer that fails it earns 0 unless `train_policy.grpo.unsound_reward`
  is outcome);
- train_policy (`method: grpo`): `train_policy.grpo`'s loss on the kept groups, starting from the policy that
  sampled them;
- evaluate.

docs/grpo.md has the SQL that explains an advantage and what a round measured.
"""

from __future__ import annotations

from components.recipes import Recipe, moved_settings


def check(cfg) -> None:
    tp, where = cfg.train_policy, "recipe 'grpo'"
    if tp.method != "grpo":
        raise ValueError(f"{where} trains a policy gradient: set train_policy.method=grpo")
    if cfg.generate.samples_per_problem < 2:
        raise ValueError(f"{where} compares each rollout with its group: set generate.samples_per_problem >= 2 "
                         f"(got {cfg.generate.samples_per_problem})")
    if tp.grpo.beta > 0 and tp.grpo.reference is None:
        raise ValueError(f"train_policy.grpo.beta={tp.grpo.beta} needs a reference model: set "
                         "train_policy.grpo.reference to 'previous' or 'initial', or beta=0")
    g, rm = tp.grpo, cfg.score.reward_model
    if g.credit == "step" and g.shaping_weight == 0:
        raise ValueError("train_policy.grpo.credit=step weights each step's reward by shaping_weight: set "
                         "train_policy.grpo.shaping_weight > 0, or credit=trajectory")
    if g.shaping_weight > 0:
        where_rm = f"train_policy.grpo.shaping_weight={g.shaping_weight} shapes the reward with the round's reward model"
        if rm == "orm" and g.credit == "step":
            raise ValueError("train_policy.grpo.credit=step needs step scores, and an ORM scores whole rollouts: set "
                             "score.reward_model=prm or implicit")
        if rm == "none" and not (g.credit == "step" and cfg.score.mc_rollouts):
            raise ValueError(f"{where_rm}, and score.reward_model=none: set score.reward_model=implicit (or prm with "
                             "train_reward.enabled, or a reward model by dotted path), or credit=step with "
                             "score.mc_rollouts > 0 (Monte Carlo step values)")
    if cfg.filter.min_step_score is not None and g.ptx_pool == "demonstrations":  # config refuses a judge with no steps
        raise ValueError(f"filter.min_step_score={cfg.filter.min_step_score} judges which right answers self-imitation "
                         "trains on, and train_policy.grpo.ptx_pool=demonstrations imitates none: set ptx_pool to "
                         "right_answers or all_right_answers, or leave filter.min_step_score unset")
    if g.unsound_reward != "zero":
        keeps = f"train_policy.grpo.unsound_reward={g.unsound_reward} keeps the step checker out of the reward"
        if not cfg.filter.check_steps:
            raise ValueError(f"{keeps}, and filter.check_steps=false checks nothing: set filter.check_steps=true")
        if g.ptx_pool == "demonstrations":
            raise ValueError(f"{keeps}, so it only judges self-imitation, and "
                             "train_policy.grpo.ptx_pool=demonstrations imitates no right answer: set ptx_pool to "
                             "right_answers or all_right_answers")
    if tp.init != "previous":
        raise ValueError(f"{where} trains the policy that sampled the round: set train_policy.init=previous")
    if cfg.generate.top_p != 1.0:
        raise ValueError(f"{where}: the clipped ratio divides by the sampler's probabilities, which top_p "
                         f"truncates: set generate.top_p=1.0 (got {cfg.generate.top_p})")
    bad = {"generate.search": cfg.generate.search is not None,
           "generate.mcts": cfg.generate.mcts is not None, "score.tree": cfg.score.tree is not None,
           "generate.until_correct": cfg.generate.until_correct is not None,
           "filter.dpo_pairs": cfg.filter.dpo_pairs, "filter.step_dpo_pairs": cfg.filter.step_dpo_pairs,
           "train_policy.processes": tp.processes > 1}
    if any(bad.values()):
        raise ValueError(f"{where} does not use {', '.join(k for k, v in bad.items() if v)}: leave them at their "
                         "defaults")


# rft's settings that recipe grpo never reads, and what it reads instead where it has a counterpart.
UNUSED = {"train_policy.steps": "train_policy.grpo.num_iterations", "train_policy.epochs": None,
          "train_policy.batch_size": "train_policy.grpo.groups_per_step",
          "train_policy.learning_rate": "train_policy.grpo.learning_rate",
          "train_policy.replay_ratio": "train_policy.grpo.ptx_weight", "train_policy.gradient_accumulation_steps": None,
          "filter.dedup": None, "filter.max_per_problem": "filter.max_groups",
          "filter.rank_by": "train_policy.grpo.shaping_aggregate", "filter.drop_mc_bad_steps": None,
          "filter.judge": None,
          "filter.max_pairs_per_problem": None}


def unused(cfg) -> list[str]:
    """The settings of UNUSED that `cfg` moves from their defaults, as "KEY=VALUE (grpo reads ...)".

    >>> from pathlib import Path
    >>> from components.config import load_config
    >>> sql = Path(__file__).parents[2] / "configs" / "sql.yaml"  # an rft config, switched to grpo
    >>> unused(load_config(sql, ["recipe=grpo", "train_policy.method=grpo"]))[:2]
    ['train_policy.steps=80 (grpo reads train_policy.grpo.num_iterations)', 'train_policy.epochs=None']
    """
    return [f"{key}={value!r}" + (f" (grpo reads {UNUSED[key]})" if UNUSED[key] else "")
            for key, value in moved_settings(cfg, list(UNUSED))]


RECIPE = Recipe(name="grpo",
                stages=("generate", "verify", "score", "train_reward", "filter", "train_policy", "evaluate"),
                when={"train_reward": lambda cfg: cfg.train_reward.enabled},
                description="group-relative policy gradient on each round's own samples (TRL GRPOTrainer)",
                check=check, unused=unused)
