"""Experiment configuration: one typed section per stage, loaded from YAML with dotted overrides.

    from components.config import load_config
    cfg = load_config("configs/arith.yaml", overrides=["rounds=2", "train_policy.steps=50"])

Unknown keys and wrong types fail at load time with the field path and what was expected.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.domains import DOMAINS


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and field."""


class _Section(BaseModel):
    # extra="forbid": a typo in a key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DomainConfig(_Section):
    name: str = Field("arith", description="Domain: 'arith', 'gsm8k', 'jsonl' (your own file), or a dotted path 'pkg.module:Class'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the domain's constructor.")


class TinyModelConfig(_Section):
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(384, ge=8)
    max_position_embeddings: int = Field(256, ge=16)


class LoraConfig(_Section):
    """Train LoRA adapters (peft) instead of every weight."""

    r: int = Field(8, ge=1, description="Adapter rank.")
    alpha: int = Field(16, ge=1, description="Scale: the update is alpha / r times the adapter product.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = Field(
        "all-linear", description="Module names (or 'all-linear', or a regex) that get adapters.")
    merge: bool = Field(True, description="Save merged weights (any HF or vLLM loader reads them); false saves the "
                                          "adapter beside its base, which the HF backend loads.")


class PolicyConfig(_Section):
    model: str | None = Field(
        None, description="HF model name or local path. Null bootstraps a tiny Llama from scratch (round 0)."
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Architecture of the from-scratch model.")
    prompt_format: Literal["raw", "chat"] = Field(
        "raw", description="raw: the domain's prompt as it is; chat: one user turn through the tokenizer's chat "
                           "template (instruct models). Sampling, SFT and DPO render alike.")
    system_prompt: str | None = Field(None, description="prompt_format=chat: a system turn before the user's.")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Weights trained, saved and sampled: auto keeps the checkpoint's own; float16 needs "
                               "a GPU and LoRA.")
    lora: LoraConfig | None = Field(None, description="Null: full fine-tuning.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward: less memory, slower.")
    max_truncated_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of training examples (or prompts) allowed over their max_length "
                                         "before a stage fails; every cut one is counted either way.")

    @model_validator(mode="after")
    def _system_needs_chat(self) -> "PolicyConfig":
        if self.system_prompt is not None and self.prompt_format != "chat":
            raise ValueError("policy.system_prompt needs policy.prompt_format=chat")
        return self


class BootstrapConfig(_Section):
    """Round 0: supervised training on gold demonstrations before self-improvement starts."""

    levels: list[int] | None = Field(
        None, description="Levels with full demonstrations; null: every level of the domain; []: no demonstrations.")
    problems_per_level: int = Field(2000, ge=1)
    seed_levels: list[int] = Field(
        default_factory=list,
        description="Harder levels given a few seed demonstrations: length extrapolation does not come free.",
    )
    seed_fraction: float = Field(0.03, ge=0.0, le=1.0, description="Seed demos as a fraction of all demos.")
    steps: int = Field(600, ge=0, description="SFT steps on the demonstrations. 0: round 0's policy is `policy.model` "
                                              "as it is (not retrained, not re-saved); the demonstrations are still "
                                              "stored, for replay.")
    batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(2e-3, gt=0)
    max_length: int = Field(256, ge=2, description="Tokens of prompt + completion; longer demos are counted.")
    gradient_accumulation_steps: int = Field(1, ge=1)


class SearchConfig(_Section):
    """PRM-guided step-level sampling (components/search/step_search.py): needs a previous round's PRM."""

    method: Literal["prm_step"] = "prm_step"
    max_tries: int = Field(4, ge=1, description="Draws of one step at most; the best-scored is kept.")
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="A step the PRM scores at least this is kept at once.")
    max_steps: int = Field(32, ge=1, description="Steps per sample at most.")
    redraw_temperature: float | None = Field(
        None, ge=0.0, description="Temperature of the redraws of a step the PRM rejects (null: generate.temperature): "
                                  "higher explores away from the flagged mistake.")


class MCTSSection(_Section):
    """MCTS over steps as generate's sampler (components/search/): each problem's tree is searched; its best
    terminal leaves, then nodes completed by their rollouts, are the round's trajectories; every node goes to
    the store's `nodes` table."""

    simulations: int = Field(16, ge=1, description="Selection rounds per tree.")
    expansions: int = Field(4, ge=1, description="K candidate steps drawn for each expanded leaf (the tree's width).")
    c_puct: float = Field(1.5, ge=0.0, description="PUCT's exploration weight: Q + c_puct * prior * sqrt(N) / (1 + n).")
    fpu: float = Field(0.0, ge=0.0, le=1.0, description="The Q an unvisited child counts as.")
    max_depth: int = Field(16, ge=1, description="Steps per solution at most; a leaf this deep is never expanded.")
    max_step_tokens: int = Field(32, ge=1, description="Tokens of one drawn step at most.")
    token_budget: int | None = Field(
        None, ge=1, description="Generated tokens per problem (expansions, duplicate draws and rollouts), pooled over "
                                "the round's trees; the search stops when they are spent. Null: simulations only.")
    widening: float = Field(
        0.0, ge=0.0, lt=1.0, description="Progressive widening's alpha: a node visited N times draws K more steps "
                                         "once floor(N ** alpha) exceeds the times it has drawn, so a search whose "
                                         "paths have all ended keeps drawing. 0: each node draws once.")
    value: Literal["rollouts", "prm"] = Field(
        "rollouts", description="What values a prefix that is not terminal: 'rollouts' (the share of `rollouts` "
                                "completions from it the verifier accepts) or 'prm' (the previous round's PRM on its "
                                "last step; round 1, with no PRM yet, uses rollouts).")
    rollouts: int = Field(2, ge=0, description="Completions per valued prefix.")

    _at: ClassVar[str] = "generate.mcts"  # where the section sits, for its errors

    @model_validator(mode="after")
    def _sources(self) -> MCTSSection:
        one = self.expansions * self.max_step_tokens
        if self.token_budget is not None and self.token_budget < one:
            raise ValueError(f"{self._at}.token_budget ({self.token_budget}) is less than one expansion "
                             f"(expansions x max_step_tokens = {self.expansions} x {self.max_step_tokens} = {one}): "
                             "raise it, or set it to null")
        if self.rollouts < 1:
            why = ("round 1 has no PRM yet" if self.value == "prm" else "value=rollouts")
            raise ValueError(f"{self._at} has no value source: {why} and rollouts=0; set {self._at}.rollouts >= 1")
        return self


class LabelSearchSection(MCTSSection):
    """MCTS in score, for a round that did not sample by MCTS: each problem's tree starts from the round's own
    solutions (each a path of steps, backed up with its verifier's reward), and the simulations draw K steps
    beside theirs, valued by rollouts (or the previous PRM). The trees go to `nodes` with purpose 'label'."""

    _at: ClassVar[str] = "score.tree.search"


class GenerateConfig(_Section):
    backend: str = Field("hf", description="What samples in generate, score and evaluate: 'hf' (transformers "
                                           "generate), 'vllm' (the offline engine in the job, run in .venv-vllm: "
                                           "`make vllm`), 'openai' (an OpenAI-compatible server such as `vllm serve`; "
                                           "base_url in backend_options), or a dotted path 'pkg.module:Class' to a "
                                           "components.models.backends.GenerationBackend.")
    backend_options: dict[str, Any] = Field(default_factory=dict, description="Extra constructor options for the "
                                                                              "backend (components/models/).")
    problems_per_level: int = Field(200, ge=1, description="Problems sampled per curriculum level per round.")
    samples_per_problem: int = Field(4, ge=1)
    temperature: float = Field(0.8, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(96, ge=1)
    batch_size: int = Field(256, ge=1)
    search: SearchConfig | None = Field(
        None, description="Null: plain sampling. Otherwise each sample is built step by step, the previous "
                          "round's PRM judging each step (recipe coevo; round 1, with no PRM yet, samples plainly).")
    mcts: MCTSSection | None = Field(
        None, exclude_if=lambda v: v is None,  # unset, older experiments' config hashes stay as they were
        description="Null: plain sampling. Otherwise one MCTS tree per problem (PUCT over steps, the verifier at "
                    "terminal nodes), and up to samples_per_problem solutions from it become the problem's "
                    "trajectories: its best terminal leaves, then nodes completed by the rollouts that valued them.")
    until_correct: int | None = Field(
        None, ge=1, description="Null: samples_per_problem for every problem. Otherwise rejection sampling in waves "
                                "(DART-Math): each wave draws wave_size samples for the problems with fewer than "
                                "this many verified right answers so far, until samples_per_problem are drawn. A "
                                "problem the policy solves at once costs one draw; the hard ones get the rest.")
    wave_size: int = Field(1, ge=1, description="Samples per problem per wave when until_correct is set.")
    max_prompt_length: int | None = Field(
        None, ge=1, description="Prompts over this many tokens lose their start, and are counted; null: no limit.")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v not in ("hf", "vllm", "openai") and ":" not in v:
            raise ValueError(f"unknown backend {v!r}: use hf, vllm, openai or a dotted path 'pkg.module:Class'")
        return v

    @model_validator(mode="after")
    def _waves(self) -> GenerateConfig:
        if self.until_correct is not None and self.until_correct > self.samples_per_problem:
            raise ValueError(f"generate.until_correct ({self.until_correct}) can never be met with "
                             f"samples_per_problem={self.samples_per_problem}: lower it or draw more")
        if self.mcts is not None and (self.search is not None or self.until_correct is not None):
            other = "generate.search" if self.search is not None else "generate.until_correct"
            raise ValueError(f"generate.mcts is a sampler of its own: set {other}=null, or generate.mcts=null")
        if self.wave_size > self.samples_per_problem:
            raise ValueError(f"generate.wave_size ({self.wave_size}) exceeds samples_per_problem "
                             f"({self.samples_per_problem})")
        return self


class VerifyConfig(_Section):
    verifier: str | None = Field(None, description="Dotted path to a verifier function; null uses the domain's.")


class TreeLabelsSection(_Section):
    """Step labels and step pairs from an MCTS tree (components/search/training.py): generate.mcts's, with no
    rollouts beyond the search's own, or one score grows around the round's solutions (`search`)."""

    pair_margin: float = Field(
        0.25, ge=0.0, le=1.0, description="filter.step_dpo_pairs: a wrong answer pairs with a right one of its tree "
                                          "where their paths part at siblings whose Q differs by at least this.")
    min_visits: int = Field(1, ge=1, description="Both siblings of a pair visited at least this many times.")
    label_unsolved: bool = Field(
        False, description="Label every step of an answer whose tree holds no known right solution (all bad). Off: "
                           "only its final step, as first_error labels an answer it does not search; the policy "
                           "could not finish from those steps, which does not make them wrong (on one micro round, "
                           "64 of 158 such steps were right).")
    search: LabelSearchSection | None = Field(
        None, exclude_if=lambda v: v is None,  # unset, older experiments' config hashes stay as they were
        description="Null: the trees are generate.mcts's. Otherwise, for a round that samples without MCTS, score "
                    "grows one tree per problem from the round's solutions (their steps seeded as paths) with these "
                    "MCTS settings, and labels from it.")


# score.reward_model's built-in values; any other value is a dotted path to a user's reward model.
REWARD_MODEL_NAMES = ("none", "prm", "orm", "implicit", "confidence", "env")


class EnvRead(NamedTuple):
    """A filter setting that asks the environment to read its tasks."""
    method: str  # the environment method it needs
    what: str  # what that method does, for errors
    sft: str  # what the setting does to SFT's examples, for errors
    off: str  # the value that turns it off


ENV_READS = {
    "hindsight": EnvRead("hindsight", "relabels wrong episodes with the task they solved", "adds relabeled episodes to",
                         "false"),
    "max_per_value": EnvRead("constants", "counts the constants a task asks for", "caps the episodes of", "null"),
    "variants": EnvRead("variants", "poses right episodes again with other constants", "adds variant episodes to",
                        "null"),
}


class ScoreConfig(_Section):
    """Step labels (Monte Carlo rollouts, oracle) and reward-model scores for the round's trajectories."""

    reward_model: str = Field(
        "none", description="The previous round's reward model scores every step and trajectory; 'none' scores "
                            "by verifier outcome only (round 1 of a coevo run has no previous reward model yet). "
                            "'prm' or 'orm': the one train_reward trained. 'implicit': no reward model to train; "
                            "the step reward is beta * log(policy / round-0 policy) summed over the step (Free "
                            "Process Rewards, PRIME), from round 2 on. 'confidence': no reward model to train; a "
                            "step scores the probability of its least likely token under the policy that sampled "
                            "it, every round (as DeepConf judges traces). 'env': an environment's own turn rewards "
                            "(StepResult.reward; a turn given none scores 0). A dotted path 'pkg.module:Class' "
                            "builds a components.rewards.RewardModel that trains nothing, every round.")

    @field_validator("reward_model")
    @classmethod
    def _known_reward_model(cls, v: str) -> str:
        if v not in REWARD_MODEL_NAMES and ":" not in v:
            raise ValueError(f"unknown reward model {v!r}: use {', '.join(REWARD_MODEL_NAMES)} or a dotted path "
                             "'pkg.module:Class'")
        return v
    confidence_model: str | None = Field(
        None, exclude_if=lambda v: v is None,  # left out of to_dict at its default: older configs hash as they did
        description="reward_model=confidence: the model whose confidence scores the steps, an HF name or a local "
                    "path with its own tokenizer, fixed for the whole run (it never trains), in score and in "
                    "evaluate's best-of-N; null: the policy that sampled the round. A judge that did not write the "
                    "answers: a larger model fine-tuned on the same demonstrations ranks unsound right answers below "
                    "sound ones where the sampler cannot (docs/prm-without-checker.md).")
    implicit_beta: float = Field(0.05, gt=0.0, description="beta of the implicit PRM (PRIME's value).")
    mc_rollouts: int = Field(
        0, ge=0, description="k completions per step prefix, verified (Math-Shepherd); 0 = no Monte Carlo labels.")
    mc_max_trajectories: int | None = Field(
        None, ge=1, description="Label at most this many distinct trajectories per round (a seeded sample, half "
                                "correct and half incorrect where possible): rollouts cost k tokens per step. "
                                "With first_error it caps the wrong trajectories searched; the free labels are "
                                "not capped.")
    mc_strategy: Literal["every_prefix", "first_error"] = Field(
        "every_prefix", description="every_prefix: k rollouts from every step prefix, soft and hard labels "
                                    "(Math-Shepherd). first_error: hard labels only; a right answer labels its own "
                                    "steps good, and a binary search rolls out O(log n) prefixes of each wrong one "
                                    "to find its first dead step (OmegaPRM). The search needs an alive root: a "
                                    "wrong answer to a problem no sample of the round solved is not searched, "
                                    "and only its final step is labelled (bad).")
    mc_search_unsolved: bool = Field(
        False, description="first_error: search wrong answers to problems no sample of the round solved too. "
                           "Their dead prefixes mark where the policy can no longer finish, often before the "
                           "error (on the arith benchmark 29-46% of the steps so labelled bad were right), at "
                           "the cost of rollouts; off, only their final step is labelled.")
    mc_temperature: float = Field(0.8, ge=0.0)
    mc_max_new_tokens: int | None = Field(None, ge=1, description="Null: generate.max_new_tokens.")
    tree: TreeLabelsSection | None = Field(
        None, exclude_if=lambda v: v is None,
        description="Label each solution's steps from an MCTS tree (generate.mcts's, or one score grows: "
                    "score.tree.search): tree_soft is the node's Q, tree_hard is 1 where a right solution passed "
                    "through the node (train_reward.label_source tree_soft or tree_hard trains the PRM on them); and with "
                    "filter.step_dpo_pairs, pair wrong answers with right ones that part at siblings (MCTS-DPO).")
    oracle_labels: bool = Field(
        True, description="Store the domain's exact step labels (source 'oracle') where it has them: for "
                          "evaluation only, never for training.")


class FilterConfig(_Section):
    keep: Literal["correct"] = "correct"
    rank_by: Literal["min", "last", "mean"] = Field(
        "min", description="Reward-model aggregate that ranks correct trajectories (coevo); where a round has no "
                           "reward-model scores yet, the mean Monte Carlo value of the steps ranks them.")
    drop_mc_bad_steps: bool = Field(
        False, description="Drop a right answer when a step's Monte Carlo hard label is 0: no rollout from that "
                           "step reached the answer, so the step is likely wrong (Math-Shepherd).")
    min_step_score: float | None = Field(
        None, ge=0.0, le=1.0, description="Drop a right answer whose weakest step the judge (see judge) scores "
                                          "below this: the step reward model as a learned step checker. With "
                                          "judge=previous it is the one score.reward_model runs (the previous "
                                          "round's PRM: no effect before one exists; the implicit PRM; the "
                                          "sampler's confidence, round 1 too). Under recipe grpo the round's reward "
                                          "model judges which right answers self-imitation "
                                          "(train_policy.grpo.ptx_pool) trains on; their rewards are left alone.")
    judge: Literal["previous", "round", "round_and_previous"] = Field(
        "previous", exclude_if=lambda v: v == "previous",
        description="Which PRM judges the round's right answers against min_step_score. 'previous': the previous "
                    "round's (from round 2). 'round': this round's, from round 1, which train_reward trains without "
                    "them, on wrong answers' labels, the demonstrations and right answers an earlier filter kept; "
                    "it also re-judges train_policy's replay pool, so what an earlier judge let in can drop out. "
                    "'round_and_previous': as 'round', but from round 2 a right answer is dropped only where the "
                    "previous round's PRM (score.reward_model=prm) also scores its weakest step below its own "
                    "threshold, set by the same rule; the replay pool is re-judged by this round's alone.")
    judge_max_drop: float | None = Field(
        None, gt=0.0, lt=1.0, exclude_if=lambda v: v is None,
        description="Calibrate min_step_score on what the judge judges: where more than this share of the round's "
                    "right answers (or of a re-judged replay pool) score a step below min_step_score, the threshold "
                    "drops to the score that drops this share, the least familiar answers first. Unset: the fixed "
                    "threshold.")
    dpo_pairs: bool = Field(False, description="Also select DPO pairs: per problem, the best-scored correct "
                                               "trajectory against the worst-scored incorrect one.")
    max_pairs_per_problem: int = Field(1, ge=1)
    step_dpo_pairs: bool = Field(
        False, description="Also select step-level pairs: from the Monte Carlo search (score.mc_strategy=first_error), "
                           "at each searched wrong answer's first dead step, a continuation that succeeded from the "
                           "live prefix against the failed one (Step-DPO); from the MCTS tree (score.tree), a right "
                           "answer against a wrong one that parts from it at siblings apart in Q (MCTS-DPO). "
                           "train_policy.method dpo or sft+dpo trains on them.")
    max_groups: int | None = Field(
        None, ge=1, exclude_if=lambda v: v is None,
        description="recipe grpo: train on at most this many groups whose rewards differ (a seeded sample).")
    dedup: bool = Field(True, description="Drop repeated completions of the same problem.")
    max_per_problem: int = Field(4, ge=1)
    hindsight: bool = Field(
        False, exclude_if=lambda v: not v,
        description="Relabel wrong episodes in hindsight: where the environment can name the task a wrong answer "
                    "solved (code: the asked template with the constants the program wrote, in the template's "
                    "ranges, never a held-out task), the episode's turns are replayed on that task and, when right "
                    "there, join the round's right answers as a trajectory of purpose 'hindsight' "
                    "(components/envs/hindsight.py). Environments with a `hindsight` method; not under recipe grpo.")
    variants: int | None = Field(
        None, ge=1, exclude_if=lambda v: v is None,
        description="Pose each of the round's right episodes again this many times with other constants: where the "
                    "environment can (code: the final answer is the asked template's program with the asked "
                    "constants), it draws the template's constants anew, writes that program with them in each of "
                    "the episode's turns, replays the turns on that task (the tools run again) and keeps the replay "
                    "where it is right, as a trajectory of purpose 'variant' (components/envs/hindsight.py; never a "
                    "held-out task). A prompt's numbers and its program's then agree on values the policy did not "
                    "pick. Environments with a `variants` method; train_policy.method sft only. A replay longer "
                    "than train_policy.max_length is left out, as a relabel is.")
    max_per_value: int | None = Field(
        None, ge=1, exclude_if=lambda v: v is None,
        description="Select at most this many episodes a round whose task asks for one value of one constant of "
                    "one template (code: the k of `(a(i) * k + 1) % m`): the policy's favourite constant, which its "
                    "hindsight relabels over-represent (a relabel's goal is what the policy wrote), then cannot "
                    "flood what it trains on, and it learns to copy the asked one. Sampled right answers go before "
                    "relabels, a problem's first before its second. Environments with a `constants` method; "
                    "train_policy.method sft only.")

    @property
    def replays(self) -> bool:
        """The filter stores episodes of its own, replayed on other tasks (filter.hindsight, filter.variants)."""
        return self.hindsight or self.variants is not None

    @property
    def judges_in_round(self) -> bool:
        """This round's PRM judges the round's right answers (filter.judge round or round_and_previous)."""
        return self.judge != "previous"

    check_steps: bool = Field(
        False, description="Also drop right answers whose worked steps do not check out against the problem "
                           "(the domain's step checker, run like rStar-Math's code execution; it compares with no "
                           "gold solution). Under recipe grpo such a right answer earns 0, a wrong answer's reward "
                           "(or its own, train_policy.grpo.unsound_reward), self-imitation leaves it out, and "
                           "`advantages.steps_checked` records the verdict. Ignored where a domain has none.",
    )


class DPOConfig(_Section):
    """Preference training of the policy on the filter's pairs (TRL DPOTrainer, Rafailov et al. 2023)."""

    steps: int = Field(100, ge=1)
    batch_size: int = Field(32, ge=1, description="Pairs per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0)
    beta: float = Field(0.1, gt=0, description="DPO temperature: how far the policy may move from the reference.")
    reference: Literal["previous", "initial"] = Field(
        "previous", description="The frozen reference: the previous round's policy, or the round-0 model.")
    sft_weight: float = Field(0.0, ge=0, description="NLL on the chosen completion added to the loss (RPO).")
    max_length: int = Field(256, ge=2, description="Tokens of prompt + completion; longer pairs are counted.")


class GRPOSection(_Section):
    """Policy-gradient training on the round's groups (recipe grpo; TRL GRPOTrainer, components/training/grpo.py)."""

    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="TRL's loss: how token losses are averaged (dapo: over the batch's tokens; grpo: per "
                            "sequence; dr_grpo: by a constant; bnpo: over the local batch's tokens).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage = reward - group mean, divided by the group's std ('group'), the round's "
                             "('batch'), or not at all ('none', Dr. GRPO).")
    groups_per_step: int = Field(4, ge=1, description="Groups (problems) per optimizer step.")
    num_iterations: int = Field(1, ge=1, description="Passes over the round's rollouts (GRPO's mu); each step "
                                                     "after the first trains on rollouts one step staler.")
    learning_rate: float = Field(1e-5, gt=0)
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="The learning rate over a round's optimizer steps: constant, or decayed to 0 "
                                "(cosine, linear), which ends each round annealed as SFT's rounds end "
                                "(docs/grpo.md, 'Why').",
        exclude_if=lambda v: v == "constant")  # so configs from before it hash as they did
    epsilon: float = Field(0.2, gt=0, description="The importance ratio's clip (PPO), low side.")
    epsilon_high: float | None = Field(None, gt=0, description="The clip's high side where it differs (DAPO: 0.28).")
    beta: float = Field(0.0, ge=0, description="KL penalty to the reference; 0 loads no reference.")
    ptx_weight: float = Field(
        0.0, ge=0, allow_inf_nan=False, exclude_if=lambda v: v == 0.0,
        description="PPO-ptx (InstructGPT): each forward pass adds this weight times the NLL of ptx_batch_size "
                    "round-0 demonstrations to the policy-gradient loss, which anchors the policy as rft's replay "
                    "does (docs/grpo.md). 0: the rollouts alone.")
    ptx_batch_size: int = Field(8, ge=1, exclude_if=lambda v: v == 8,
                                description="Demonstrations per forward pass (one group's) under ptx_weight > 0.")
    ptx_pool: Literal["demonstrations", "right_answers", "all_right_answers"] = Field(
        "demonstrations", exclude_if=lambda v: v == "demonstrations",
        description="What PPO-ptx's NLL trains on. 'demonstrations': the round-0 demonstrations. 'right_answers': "
                    "half of each ptx batch is the round's own right answers, every group's (those without a "
                    "learning signal too), deduplicated, minus those whose steps fail filter.check_steps where it "
                    "is set: self-imitation (Oh et al. 2018), rft's SFT data beside the policy gradient; the other "
                    "half the demonstrations. 'all_right_answers': the same over this round and every earlier "
                    "one, as rft replays its earlier selections. Needs ptx_weight > 0.")
    unsound_reward: Literal["zero", "outcome"] = Field(
        "zero", exclude_if=lambda v: v == "zero",
        description="What a right answer earns whose steps fail filter.check_steps. 'zero': a wrong answer's reward, "
                    "the checker as a reward. 'outcome': its outcome reward, so the checker only keeps it out of "
                    "self-imitation (ptx_pool), as filter.min_step_score's judge does.")
    reference: Literal["previous", "initial"] | None = Field(
        None, description="The reference beta > 0 pulls towards: the previous round's policy or the round-0 model.")
    shaping_weight: float = Field(
        0.0, ge=0, description="Dense reward. credit=trajectory: this weight times the round's reward-model score "
                               "(score.reward_model, e.g. implicit) is added to each rollout's outcome reward before "
                               "the group normalises it. credit=step: the weight on each step's normalised step "
                               "rewards (see credit). 0: outcome only.")
    shaping_aggregate: Literal["min", "mean", "last"] = Field(
        "mean", description="Which of the reward model's step-score aggregates shapes the reward (credit=trajectory).")
    credit: Literal["trajectory", "step"] = Field(
        "trajectory", exclude_if=lambda v: v == "trajectory",
        description="Which tokens share an advantage. 'trajectory': all of a rollout's, shaped by shaping_weight x "
                    "the reward model's aggregate. 'step': each step its own, the rollout's outcome advantage plus "
                    "shaping_weight x the sum of its group-normalised step rewards from that step on (DeepSeekMath's "
                    "process supervision); the step rewards are the round's reward-model step scores, else its "
                    "Monte Carlo mc_soft labels, and a group whose outcomes are equal trains where they differ.")

    @model_validator(mode="after")
    def _ptx_pool_needs_a_weight(self) -> "GRPOSection":
        if self.ptx_pool != "demonstrations" and self.ptx_weight == 0:
            raise ValueError(f"train_policy.grpo.ptx_pool={self.ptx_pool} trains on nothing at ptx_weight=0: set "
                             "train_policy.grpo.ptx_weight > 0 (e.g. 1)")
        return self


_GRPO_DEFAULT = GRPOSection()


class _TrainingProcesses(_Section):
    """How many processes train together: the training sections' `processes` and `strategy`.

    Both are left out of `to_dict` (so of `config_hash`, specs and MLflow params) at their defaults: a config
    written before they existed hashes as it did. Set otherwise they are content: N processes reduce each
    batch in another order, so the numbers differ in their last bits."""

    section: ClassVar[str] = ""

    processes: int = Field(
        1, ge=1, exclude_if=lambda v: v == 1,
        description="Processes that train together, one per GPU (CPU processes on the gloo backend where there is "
                    "none): the job runs under `accelerate launch --num_processes N`, each process trains on "
                    "batch_size / N examples of every batch (the global batch stays batch_size), and only the "
                    "first writes the stage's outputs. It must divide every batch size the section trains with.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", exclude_if=lambda v: v == "ddp",
        description="processes > 1: 'ddp', every process holds the whole model (DistributedDataParallel); 'fsdp', "
                    "weights, gradients and optimizer state sharded over the processes (FSDP2; CUDA GPUs and "
                    "full fine-tuning only).")

    def _batches(self) -> dict[str, int]:
        """The batch sizes this section trains with, by their config key."""
        return {}

    @model_validator(mode="after")
    def _processes_split_every_batch(self) -> "_TrainingProcesses":
        n, where = self.processes, f"{self.section}.processes"
        for key, batch in self._batches().items():
            if n > batch:
                raise ValueError(f"{where}={n} exceeds {key}={batch}: each process trains on batch / processes "
                                 "examples of every batch, at least one")
            if batch % n:
                raise ValueError(f"{where}={n} must divide {key}={batch}: each process trains on an equal share "
                                 "(batch / processes) of every batch, so the global batch stays the same")
        if self.strategy == "fsdp" and n < 2:
            raise ValueError(f"{self.section}.strategy=fsdp shards the model over processes: set {where} >= 2")
        return self


class TrainPolicyConfig(_TrainingProcesses):
    section: ClassVar[str] = "train_policy"

    method: Literal["sft", "dpo", "sft+dpo", "grpo"] = Field(
        "sft", description="'sft' on the selected trajectories; 'dpo' on the filter's pairs; 'sft+dpo' both, "
                           "SFT first; 'grpo', a clipped policy gradient on the round's groups (recipe grpo).")
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    grpo: GRPOSection = Field(default_factory=GRPOSection, exclude_if=lambda v: v == _GRPO_DEFAULT)
    init: Literal["previous", "base"] = Field(
        "previous", description="Continue from the previous round's policy, or restart from the round-0 model (ReST-EM)."
    )
    steps: int = Field(300, ge=1, description="Upper bound on optimizer steps per round.")
    epochs: float | None = Field(
        3.0, gt=0, description="Passes over the round's examples; caps `steps` so small rounds do not overfit."
    )
    batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(5e-4, gt=0)
    replay_ratio: float = Field(
        1.0, ge=0.0,
        description="Replayed examples from earlier rounds (round-0 demos included) per new example; "
                    "without replay the policy forgets the levels the curriculum no longer samples.",
    )
    max_length: int = Field(256, ge=2, description="Tokens of prompt + completion; longer examples are counted.")
    gradient_accumulation_steps: int = Field(1, ge=1)

    def _batches(self) -> dict[str, int]:
        return {"train_policy.batch_size": self.batch_size} | (
            {"train_policy.dpo.batch_size": self.dpo.batch_size} if self.method != "sft" else {})


class TrainRewardConfig(_TrainingProcesses):
    """The round's process reward model, trained on Monte Carlo step labels (and optionally an ORM)."""

    section: ClassVar[str] = "train_reward"

    enabled: bool = False
    label_source: Literal["mc_hard", "mc_soft", "tree_hard", "tree_soft"] = Field(
        "mc_hard", description="Math-Shepherd hard labels (any rollout right) or soft ones thresholded; tree_hard "
                               "or tree_soft: score.tree's labels from the MCTS tree (a right solution through the "
                               "step; its node's Q thresholded).")
    soft_threshold: float = Field(0.5, gt=0.0, le=1.0, description="mc_soft or tree_soft >= this is a good step.")
    window_rounds: int | None = Field(
        None, ge=1, description="Train on the labels of the last W rounds; null: all rounds so far.")
    demos: bool = Field(
        False, description="Also train on the round-0 demonstrations with every step good: gold solutions the "
                           "policy bootstrapped on, covering the levels the curriculum has moved past (which "
                           "held-out evaluation still samples); they add no wrong steps.")
    consensus_filter: bool = Field(
        False, description="Keep a label only where the previous PRM agrees with it (Zhang et al. 2025, The "
                           "Lessons of Developing PRMs); labels the previous PRM did not score are kept.")
    init: Literal["previous", "policy"] = Field(
        "previous", description="Warm-start from the previous round's PRM, or start a new PRM each round from its "
                                "backbone (train_reward.model).")
    model: str | None = Field(
        None, exclude_if=lambda v: v is None,  # left out of to_dict at its default: older configs hash as they did
        description="The backbone a new PRM (and the ORM) starts from: an HF name or a local path, with its own "
                    "tokenizer; null: the policy that sampled the round. A new PRM starts in round 1, and in every "
                    "round with init: policy.")
    head: Literal["classifier", "likelihood"] = Field(
        "classifier", description="classifier: a token-classification head reads each step's separator (TRL's "
                                  "PRM); likelihood: a step scores sigmoid(scale * min log p + bias) over its tokens "
                                  "under the backbone's own LM head, the labels fine-tuning the whole model "
                                  "(components/rewards/prm.py).")
    lm_weight: float = Field(0.0, ge=0.0, description="head=likelihood: weight of the language-model loss on "
                                                      "all-good trajectories, which keeps the PRM a language model.")
    steps: int = Field(300, ge=1)
    batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    orm: bool = Field(False, description="Also train an outcome reward model (TRL RewardTrainer) on outcome "
                                         "pairs, for ORM best-of-N.")
    orm_steps: int = Field(200, ge=1)
    max_length: int = Field(256, ge=2, description="Tokens of prompt + steps (PRM) or prompt + completion (ORM); "
                                                   "longer ones are counted (policy.max_truncated_fraction).")
    lora: LoraConfig | None = Field(None, description="Train the PRM with LoRA adapters (saved merged); null: in full.")

    def _batches(self) -> dict[str, int]:
        return {"train_reward.batch_size": self.batch_size}  # the ORM's (ORMParams) is checked when it trains

    @model_validator(mode="after")
    def _lm_weight_needs_an_lm(self) -> "TrainRewardConfig":
        if self.lm_weight and self.head != "likelihood":
            raise ValueError("train_reward.lm_weight trains the PRM's language-model head: set "
                             "train_reward.head=likelihood, or lm_weight=0")
        return self


class EvalSearchConfig(_Section):
    """Accuracy against compute on one held-out level (components/search/curves.py): greedy, maj@N and PRM
    best-of-N from the evaluation's samples, PRM beam search and MCTS guided by the round's PRM."""

    budgets: list[int] = Field(default_factory=lambda: [2, 4, 8],
                               description="N per point: samples for maj@N and best-of-N, beams for beam search; "
                                           "MCTS gets the tokens N samples spent.")
    methods: list[Literal["beam", "mcts"]] = Field(default_factory=lambda: ["beam", "mcts"])
    level: int | None = Field(None, description="The level the curve is drawn on; null: the hardest evaluated.")
    problems: int | None = Field(None, ge=1, description="Its first this many held-out problems; null: all of them.")
    expansions: int = Field(4, ge=1, description="Candidate steps per beam or per expanded MCTS leaf.")
    max_step_tokens: int = Field(32, ge=1)
    max_depth: int = Field(16, ge=1, description="Steps per solution at most.")
    c_puct: float = Field(1.5, ge=0.0)

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v) or len(set(v)) != len(v):
            raise ValueError(f"evaluate.search.budgets must be distinct integers >= 1, got {v}")
        return sorted(v)


class EvaluateConfig(_Section):
    levels: list[int] | None = Field(None, description="Levels to evaluate; null means all domain levels.")
    problems_per_level: int = Field(100, ge=1, description="Held-out problems per level (from the fixed test set).")
    maj_k: int = Field(4, ge=1, description="Samples per problem for maj@k.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature for maj@k.")
    max_new_tokens: int = Field(96, ge=1)
    best_of_n: list[int] = Field(
        default_factory=list, description="N for reward-model best-of-N and maj@N (e.g. [4, 8, 16]); needs the "
                                          "round's reward model. Samples per problem = max(maj_k, max N).")
    search: EvalSearchConfig | None = Field(
        None, exclude_if=lambda v: v is None,  # unset, older experiments' config hashes stay as they were
        description="Null: no compute curve. Otherwise each round with a PRM draws accuracy against generated "
                    "tokens for greedy, maj@N, PRM best-of-N, beam search and MCTS (samples per problem >= the "
                    "largest budget).")


class CurriculumConfig(_Section):
    """Pick levels near the edge of learnability: pass rate neither near 0 nor near 1."""

    low: float = Field(0.03, ge=0.0, le=1.0)
    high: float = Field(0.95, ge=0.0, le=1.0)
    max_levels: int = Field(3, ge=1, description="At most this many levels per round, hardest-learnable first.")
    floor_from_samples: bool = Field(
        False, exclude_if=lambda v: not v,
        description="A level the last round sampled stays above `low` while its samples solved at least `low` of "
                    "its problems, whatever its held-out greedy rate: the hardest level being climbed is not "
                    "dropped for good when one held-out task turns wrong. The ceiling (`high`) stays held-out.")

    @model_validator(mode="after")
    def _order(self) -> CurriculumConfig:
        if self.low >= self.high:
            raise ValueError(f"curriculum.low ({self.low}) must be below curriculum.high ({self.high})")
        return self


class TrackingConfig(_Section):
    enabled: bool = True
    tracking_uri: str | None = Field(
        None, description="MLflow URI; null uses $MLFLOW_TRACKING_URI or sqlite:///<workdir>/mlflow.db."
    )
    experiment_name: str | None = Field(None, description="MLflow experiment; null uses the experiment name.")
    artifact_location: str | None = Field(
        None, exclude_if=lambda v: v is None, description="Artifact root of a new MLflow experiment (s3://…, a path); null: <execution.storage>/"
                          "mlartifacts where storage is a URL, else <workdir>/mlartifacts.")
    register_models: bool = Field(
        True, description="Log each round's policy checkpoint to its round run and register it as a version of "
                          "`<experiment>-policy` (aliases `current` and `best`).",
    )
    trace_episodes: int = Field(
        20, ge=0, exclude_if=lambda v: v == 20,  # the default leaves older experiments' config hashes as they were
        description="An agent environment's round logs this many of its episodes (a fixed sample by id) as "
                    "MLflow traces: a span per turn and tool call, reward and verdict as assessments.")


class ImportConfig(_Section):
    """Existing trajectories to load into the store (`coevo import`, recipe `import`): a JSONL or Parquet file,
    one trajectory a row, or one per (row, model key) in the wide layout (`models`)."""

    path: str = Field(..., description="The file: .jsonl, .json or .parquet.")
    prompt_field: str = Field("question", description="The problem text, matched against the domain's problems.")
    completion_field: str = Field("completion", description="The solution text (simple layout).")
    correct_field: str | None = Field(None, description="A given correctness label, bool or 0/1 (simple layout).")
    step_labels_field: str | None = Field(None, description="Given step labels, one per domain step (simple layout).")
    model_field: str | None = Field(None, description="The model that wrote the row (simple layout).")
    models: list[str] | None = Field(None, description="Wide layout: keys of sub-objects, one trajectory each.")
    nested_completion: str = Field("solution", description="Wide layout: the solution's key in each sub-object.")
    nested_correct: str | None = Field("is_correct", description="Wide layout: the label's key in each sub-object.")
    nested_step_labels: str | None = None
    purpose: Literal["train", "eval"] = Field(
        "train", description="'eval' for trajectories on held-out problems; an import with test problems must say so.")


# Where a stage job runs, not what it computes: left out of `config_hash`, so an experiment started on a laptop
# resumes on a cluster (and back) as the same experiment.
PLACEMENT = ("pool", "gpu_pool", "stage_pools", "worker_timeout_s", "heartbeat_timeout_s", "warm_workers", "storage",
             "catalog")


class ExecutionConfig(_Section):
    """How stage jobs are split and where they run (`docs/operating.md`, "Past one machine")."""

    shards: int = Field(1, ge=1, description="Jobs that `generate`, `verify`, `score` and `evaluate` each split "
                                             "their problems into, each with its own seed; the stage commits once "
                                             "over all of them. Results depend on it (the seeds do).")
    pool: str | None = Field(None, description="Prefect work pool that runs every stage job (a flow run of the "
                                               "`stage-job` deployment); null runs each as a local subprocess. "
                                               "COEVO_POOL overrides it.")
    gpu_pool: str | None = Field(None, description="Pool of the GPU stages (`Stage.gpu`); null: `pool`. "
                                                   "COEVO_GPU_POOL overrides it.")
    stage_pools: dict[str, str] = Field(default_factory=dict, description="Pool per stage, over `pool` and "
                                        "`gpu_pool`; the name `local` runs that stage as a local subprocess.")
    worker_timeout_s: int = Field(120, ge=1, description="How long a stage job may wait for a worker of its pool "
                                                         "to pick it up before the stage fails, naming the pool.")
    heartbeat_timeout_s: int = Field(60, ge=5, description="A pool job whose heartbeat file is older than this "
                                                           "is taken for lost (its worker died) and retried.")
    warm_workers: bool = Field(True, description="On a `process` pool, each flow run forks from a server of its "
                                                 "worker's that imported Prefect and torch once (`python -m "
                                                 "flows.warm_engine`, flows/warm_engine.py), which needs the "
                                                 "project's `python` first on the worker's PATH; false: Prefect's "
                                                 "`python -m prefect.engine`, a new interpreter per flow run.")
    storage: str | None = Field(None, description="Where stage outputs, specs and checkpoints lie, as an fsspec URL "
                                                  "(s3://bucket/prefix) or a shared path that every worker mounts; "
                                                  "null: the workdir. MLflow's SQLite and the embedded store stay in the "
                                                  "workdir. Credentials come from the environment, never from here "
                                                  "(components/storage.py). COEVO_STORAGE overrides it.")

    catalog: str | None = Field(None, description="The store's DuckLake catalog: null, the embedded one "
                                                  "(`<workdir>/store/catalog.sqlite`, data in `<workdir>/store/data`); "
                                                  "`postgres:host=… port=… dbname=…` (libpq's keywords), a shared one "
                                                  "whose data lies in `<storage>/store/` (a bucket every reader "
                                                  "reaches). Passwords come from PGPASSWORD or ~/.pgpass, never from "
                                                  "here. COEVO_CATALOG overrides it (components/store/lake.py).")

    @field_validator("catalog")
    @classmethod
    def _catalog(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        if not v.startswith("postgres:"):
            raise ValueError(f"{v!r}: expected null (the embedded store) or postgres:<libpq connection string>")
        if "password=" in v.lower():
            raise ValueError("postgres:…password=…: the password goes in PGPASSWORD or ~/.pgpass, never in a "
                             "config, which the store and MLflow record")
        return v

    @field_validator("storage")
    @classmethod
    def _storage_url(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        if "://" in v:
            scheme, rest = v.split("://", 1)
            if "@" in rest.split("/", 1)[0]:
                raise ValueError(f"{scheme}://<credentials>@…: credentials go in the environment "
                                 "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), never in a config, which the store "
                                 "and MLflow record")
            import fsspec

            if scheme != "file" and scheme not in fsspec.available_protocols():
                raise ValueError(f"{v!r}: fsspec knows no protocol {scheme!r}")
        return v.rstrip("/")

    @field_validator("stage_pools")
    @classmethod
    def _stages_exist(cls, v: dict[str, str]) -> dict[str, str]:
        from components.stages import STAGES

        if unknown := sorted(set(v) - set(STAGES)):
            raise ValueError(f"names no stage: {unknown}; the stages are {sorted(STAGES)}")
        return v


class ExperimentConfig(_Section):
    experiment: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Experiment name; names the workdir folder.")
    seed: int = 0
    workdir: str = Field("workdir", description="Root for stage outputs, the DuckDB store and the MLflow store.")
    recipe: str = Field(
        "rft", description="Which stages a round runs (components/recipes/): 'rft', outcome filter only, no reward "
                           "model (STaR / ReST-EM); 'coevo', a PRM trained on Monte Carlo step labels ranks the "
                           "data, and policy and PRM improve together; 'grpo', a group-relative policy gradient "
                           "on each round's own samples; or a dotted path 'pkg.module:RECIPE'.")
    rounds: int = Field(4, ge=0, description="Self-improvement rounds after round 0 (bootstrap).")
    stage_timeout_s: int = Field(3600, ge=1)
    stage_retries: int = Field(1, ge=0, description="Retries for transient stage failures (killed process, OOM).")
    domain: DomainConfig = Field(default_factory=DomainConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    train_policy: TrainPolicyConfig = Field(default_factory=TrainPolicyConfig)
    train_reward: TrainRewardConfig = Field(default_factory=TrainRewardConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    imports: list[ImportConfig] = Field(default_factory=list, description="Trajectories `coevo import` loads.")

    @field_validator("workdir")
    @classmethod
    def _workdir_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("workdir must not be empty")
        return v

    @model_validator(mode="after")
    def _scoring_needs_reward_model(self) -> ExperimentConfig:
        if self.score.reward_model in ("prm", "orm") and not self.train_reward.enabled:
            raise ValueError(
                f"score.reward_model={self.score.reward_model!r} needs a reward model: set train_reward.enabled=true"
            )
        if self.score.confidence_model is not None and self.score.reward_model != "confidence":
            raise ValueError(f"score.confidence_model names the model whose confidence scores the steps; "
                             f"score.reward_model={self.score.reward_model!r} does not read it: set "
                             "score.reward_model=confidence, or score.confidence_model=null")
        if self.score.reward_model == "orm" and not self.train_reward.orm:
            raise ValueError("score.reward_model='orm' needs an ORM: set train_reward.orm=true")
        if self.score.reward_model == "env" and self.domain.name in DOMAINS:
            raise ValueError(f"score.reward_model='env' reads the turn rewards an environment gives; "
                             f"domain.name={self.domain.name!r} is a text domain with none: use an environment "
                             "(calculator, sql, code, or one of your own)")
        if self.filter.judges_in_round:
            where = f"filter.judge={self.filter.judge}: this round's PRM judges its right answers"
            if not self.train_reward.enabled or self.train_policy.method == "grpo":
                raise ValueError(f"{where}, which train_reward trains in the round (recipe coevo): set "
                                 "train_reward.enabled=true, or filter.judge=previous")
            if self.filter.min_step_score is None:
                raise ValueError(f"{where} against filter.min_step_score: set it (e.g. 0.5)")
            if self.filter.judge == "round_and_previous" and self.score.reward_model != "prm":
                raise ValueError(f"{where}, with the previous round's as a second opinion, which the score stage runs "
                                 f"as score.reward_model=prm (got {self.score.reward_model}): set it, or "
                                 "filter.judge=round")
        rm = self.score.reward_model
        if self.filter.min_step_score is not None and self.filter.judge == "previous" and rm in ("none", "orm"):
            raise ValueError(f"filter.min_step_score={self.filter.min_step_score} drops right answers by their weakest "
                             f"step, and score.reward_model={rm} scores no steps: set score.reward_model=prm (with "
                             "train_reward.enabled), implicit, confidence, or a step reward model by dotted path"
                             + ("" if self.train_policy.method == "grpo" else "; or filter.judge=round (recipe coevo)"))
        for setting, read in ENV_READS.items():
            if getattr(self.filter, setting) not in (False, None) and self.train_policy.method != "sft":
                raise ValueError(f"filter.{setting} {read.sft} what SFT trains on, and train_policy.method="
                                 f"{self.train_policy.method!r} does not train on them: use recipe rft or coevo with "
                                 f"train_policy.method=sft, or set filter.{setting}={read.off}")
        if self.filter.judge_max_drop is not None and self.filter.min_step_score is None:
            raise ValueError("filter.judge_max_drop caps the share of right answers filter.min_step_score drops: "
                             "set filter.min_step_score too (e.g. 0.5)")
        tree_labels = self.train_reward.label_source.startswith("tree_")
        if self.train_reward.enabled and not tree_labels and self.score.mc_rollouts < 1:
            raise ValueError(f"train_reward.label_source={self.train_reward.label_source} needs Monte Carlo step "
                             "labels to train on: set score.mc_rollouts >= 1 (or score.tree, with generate.mcts or "
                             "score.tree.search, and label_source tree_hard or tree_soft)")
        if self.train_reward.enabled and tree_labels and self.score.tree is None:
            raise ValueError(f"train_reward.label_source={self.train_reward.label_source} trains on the MCTS tree's "
                             "labels: set score.tree (e.g. score.tree={pair_margin: 0.25}) with generate.mcts, or "
                             "with score.tree.search (e.g. {simulations: 8, rollouts: 2}) to grow it in score")
        if self.score.tree is not None and self.generate.mcts is None and self.score.tree.search is None:
            raise ValueError("score.tree labels steps from an MCTS tree: set generate.mcts (the round's own trees), or "
                             "score.tree.search to grow one in score around the round's solutions, or score.tree=null")
        if self.score.tree is not None and self.generate.mcts is not None and self.score.tree.search is not None:
            raise ValueError("score.tree.search grows trees for a round that samples without MCTS; generate.mcts "
                             "already grows this round's: set score.tree.search=null")
        if self.bootstrap.steps == 0 and self.policy.model is None:
            raise ValueError("bootstrap.steps=0 starts from a given model as it is: set policy.model to an HF name "
                             "or a local path, or bootstrap.steps > 0 to train a tiny model from scratch")
        from components.recipes import get_recipe

        get_recipe(self.recipe).check(self)
        self._check_agent_environment()
        if self.train_policy.method not in ("sft", "grpo") and not (self.filter.dpo_pairs or self.filter.step_dpo_pairs):
            raise ValueError(f"train_policy.method={self.train_policy.method!r} trains on pairs: set "
                             "filter.dpo_pairs=true or filter.step_dpo_pairs=true")
        mc_pairs = self.score.mc_strategy == "first_error" and self.score.mc_rollouts >= 1
        if self.filter.step_dpo_pairs and not (mc_pairs or self.score.tree is not None):
            raise ValueError("filter.step_dpo_pairs takes its pairs from the Monte Carlo search or the MCTS tree: set "
                             "score.mc_strategy=first_error and score.mc_rollouts >= 1, or score.tree (with "
                             "generate.mcts or score.tree.search)")
        if self.filter.step_dpo_pairs and self.train_policy.method == "sft":
            raise ValueError("filter.step_dpo_pairs selects pairs that only DPO trains on: set "
                             "train_policy.method=sft+dpo (or dpo)")
        if self.score.mc_strategy == "first_error" and self.train_reward.label_source == "mc_soft":
            raise ValueError("score.mc_strategy='first_error' gives hard labels only: set "
                             "train_reward.label_source=mc_hard, or score.mc_strategy=every_prefix")
        if self.score.mc_search_unsolved and self.score.mc_strategy != "first_error":
            raise ValueError("score.mc_search_unsolved applies to first_error labels (every_prefix rolls out every "
                             "prefix anyway): set score.mc_strategy=first_error, or mc_search_unsolved=false")
        if self.generate.search is not None and not self.train_reward.enabled:
            raise ValueError("generate.search is guided by the previous round's PRM: set train_reward.enabled=true "
                             "(recipe coevo), or generate.search=null")
        if self.generate.mcts is not None and self.generate.mcts.value == "prm" and not self.train_reward.enabled:
            raise ValueError("generate.mcts.value=prm values prefixes with the previous round's PRM: set "
                             "train_reward.enabled=true (recipe coevo), or generate.mcts.value=rollouts")
        ts = self.score.tree.search if self.score.tree is not None else None
        if ts is not None and ts.value == "prm" and not self.train_reward.enabled:
            raise ValueError("score.tree.search.value=prm values prefixes with the previous round's PRM: set "
                             "train_reward.enabled=true (recipe coevo), or score.tree.search.value=rollouts")
        if self.evaluate.search is not None and not self.train_reward.enabled:
            raise ValueError("evaluate.search guides beam search and MCTS with the round's PRM, which held-out "
                             "problems need (the verifier would read their answers): set train_reward.enabled=true "
                             "(recipe coevo), or evaluate.search=null")
        es = self.evaluate.search
        if es is not None and es.level is not None and self.evaluate.levels and es.level not in self.evaluate.levels:
            raise ValueError(f"evaluate.search.level={es.level} is not among evaluate.levels={self.evaluate.levels}: "
                             "the curve is drawn on evaluated problems")
        if (self.evaluate.best_of_n and not self.train_reward.enabled
                and self.score.reward_model not in ("implicit", "confidence")):
            raise ValueError("evaluate.best_of_n ranks samples with the round's reward model: set "
                             "train_reward.enabled=true (recipe coevo), score.reward_model=implicit or confidence, or "
                             "best_of_n=[]")
        return self

    def _check_agent_environment(self) -> None:
        """An environment (calculator, sql, code) runs episodes in chat turns; what the agent loop does not do yet
        is refused here, naming the setting, rather than failing a stage later."""
        from components.envs import ENVS
        from components.instantiate import locate

        for setting, read in ENV_READS.items():
            if getattr(self.filter, setting) in (False, None):
                continue
            if self.domain.name not in ENVS:
                raise ValueError(f"filter.{setting} {read.what}, an environment's (code), and domain.name="
                                 f"{self.domain.name!r} is not one: set filter.{setting}={read.off}")
            if not callable(getattr(locate(ENVS[self.domain.name]), read.method, None)):
                raise ValueError(f"filter.{setting} {read.what}, and {self.domain.name!r} cannot name them: set "
                                 f"filter.{setting}={read.off} (the code environment reads its generated tasks)")
        if self.domain.name not in ENVS:
            return
        where = f"domain.name={self.domain.name!r} is an agent environment"
        if self.policy.prompt_format != "chat" or self.policy.model is None:
            raise ValueError(f"{where}: its turns are chat messages with tool calls; set policy.prompt_format=chat and "
                             "policy.model to a model with a chat template (`coevo build-model --domain "
                             f"{self.domain.name}` makes a stand-in)")
        rm = self.score.reward_model
        if self.filter.step_dpo_pairs and self.score.tree is None:
            raise ValueError(f"{where}: filter.step_dpo_pairs takes an environment's pairs from its turn trees, two "
                             "stored episodes that part at sibling turns; Monte Carlo turn labels keep no winning "
                             "continuation to pair with: set score.tree (with generate.mcts or score.tree.search)")
        if rm not in REWARD_MODEL_NAMES:
            raise ValueError(f"{where}: the agent loop does not support score.reward_model={rm} yet; MCTS over turns "
                             "(generate.mcts, and score.tree on its trees), Monte Carlo turn labels (score.mc_rollouts, "
                             "mc_strategy every_prefix or first_error), turn trees grown in score (score.tree.search), the "
                             "PRM, the implicit PRM, the sampler's confidence, the ORM, best-of-N, PRM-guided turns "
                             "(generate.search), the compute curve over turns (evaluate.search), DPO on episodes and "
                             "on a turn tree's step pairs, waves until right (generate.until_correct), grpo's step "
                             "credit and filter.check_steps (the environment's check_episode) work")

    def check_startable(self, model: bool = True) -> None:
        """Raise ConfigError, naming the field, where the experiment could not start on this machine: a model
        (policy.model, train_reward.model, score.confidence_model) that is neither a local folder nor in the Hugging
        Face cache while the hub is off (HF_HUB_OFFLINE), or a data file the domain names that does not exist. Load-time
        validation cannot say this (the same config may start on another machine), so the CLI and the flows call it
        before any stage runs; `model=False` once round 0 has taken the model in (the store then names its files)."""
        problems = [p for p in (_model_problem("policy.model", self.policy.model, self.domain.name) if model else None,
                                _model_problem("train_reward.model", self.train_reward.model, self.domain.name),
                                _model_problem("score.confidence_model", self.score.confidence_model,
                                               self.domain.name),
                                *_data_problems(self.domain.name, self.domain.options)) if p]
        if problems:
            raise ConfigError("this experiment cannot start here:\n  " + "\n  ".join(problems))

    # -- derived -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def config_hash(self) -> str:
        """Stable hash over the semantic content (key order and YAML formatting do not matter). Where jobs run
        (`PLACEMENT`) is not content; an experiment whose `execution` is all defaults hashes as it did before
        the section existed."""
        body = self.to_dict()
        execution = {k: v for k, v in body.pop("execution").items() if k not in PLACEMENT}
        if execution != {"shards": 1}:
            body["execution"] = execution
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def extends(self, stored_json: str) -> bool:
        """Whether the store may take this config in place of the stored one (`config_json` of `experiments`)
        for a started experiment: the same config with more rounds, or one written before fields were added
        (read today, those take their defaults, and a field is only ever added with the default that keeps
        the old behaviour). No stage reads `rounds` (a round's content depends on the seed, the round and
        the stage), so committed rounds stay valid when an experiment grows."""
        try:
            stored = type(self).model_validate_json(stored_json).to_dict()
        except ValidationError:  # a field since removed or changed: not the same experiment
            return False
        mine, raw = self.to_dict(), json.loads(stored_json)
        for d in (stored, mine, raw):  # where jobs run may change between runs of one experiment
            if "execution" in d:
                d["execution"] = {k: v for k, v in d["execution"].items() if k not in PLACEMENT}
        if stored["rounds"] > mine["rounds"] or {**stored, "rounds": mine["rounds"]} != mine:
            return False
        return stored["rounds"] < mine["rounds"] or raw != mine

    def flat(self) -> dict[str, Any]:
        """Flattened `a.b.c -> value` view, for MLflow params."""
        return flatten(self.to_dict())

    @property
    def experiment_dir(self) -> Path:
        return Path(self.workdir) / self.experiment

    @property
    def storage_dir(self) -> str:
        """Where the experiment's attempt folders lie: `execution.storage` (or COEVO_STORAGE), else the workdir."""
        import os

        from components.storage import join

        return join(os.environ.get("COEVO_STORAGE") or self.execution.storage or self.workdir, self.experiment)

    @property
    def store_path(self) -> str | Path:
        """The store (`components.store.Store`): COEVO_CATALOG or `execution.catalog`, else `<workdir>/store`."""
        import os

        return os.environ.get("COEVO_CATALOG") or self.execution.catalog or Path(self.workdir) / "store"

    @property
    def store_data_path(self) -> str | None:
        """Where a new shared store keeps its data files: `<storage>/store/` (the embedded one: its own folder)."""
        import os

        from components.storage import join

        shared = os.environ.get("COEVO_STORAGE") or self.execution.storage
        if not isinstance(self.store_path, str) or not shared:
            return None
        return join(shared, "store") + "/"


def hub_offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _model_problem(field: str, name: str | None, domain: str) -> str | None:
    """Why the model `field` names cannot be loaded here, or None: a local folder must hold a checkpoint, and
    anything else is a hub name that must be cached while the hub is off (`coevo run` turns it off)."""
    if name is None:
        return None
    from components.models.checkpoint import check_checkpoint

    path = Path(name).expanduser()
    if path.is_dir():
        try:
            check_checkpoint(path, name)
        except FileNotFoundError as e:
            return f"{field}: {e}"
        return None
    if path.exists():
        return f"{field}: {name!r} is a file, not a model folder"
    build = f"`coevo build-model {name} --domain {domain}` builds a stand-in there"
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        return f"{field}: no model folder {name!r} ({path.resolve()}); {build}"
    if not hub_offline():
        return None  # a hub name, downloaded when the first stage loads it
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - any miss: not cached (offline, gated, misspelt)
        return (f"{field}: {name!r} is neither a local folder nor in the Hugging Face cache, and the hub is off "
                f"(HF_HUB_OFFLINE=1); {build}, or `hf download {name}` where the hub is reachable")
    return None


def _data_problems(domain: str, options: dict[str, Any]) -> list[str]:
    """The domain's data files (`domain.options.*_path`, and the jsonl domain's `train`/`test`) that do not exist."""
    keys = [k for k in options if k.endswith("_path")] + ([k for k in ("train", "test") if k in options]
                                                           if domain == "jsonl" else [])
    return [f"domain.options.{k}: no such file {options[k]!r} ({Path(str(options[k])).expanduser().resolve()})"
            for k in keys if options[k] is not None and not Path(str(options[k])).expanduser().is_file()]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key (check the spelling; see `coevo config-schema`)")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {path}: {e['msg']}{got_s}")
    return "\n".join(lines)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `a.b.c=value`; the value is parsed as YAML, so `2`, `true`, `[1,2]` get their types."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. train_policy.steps=100")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty key segment")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {e}") from e
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def load_config_dict(data: dict[str, Any], source: str = "<dict>", overrides: list[str] | None = None) -> ExperimentConfig:
    data = json.loads(json.dumps(data))  # deep copy, and rejects non-JSON values early
    for o in overrides or []:
        apply_override(data, o)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"malformed YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections at the top level, got {type(data).__name__}")
    return load_config_dict(data, source=str(path), overrides=overrides)
