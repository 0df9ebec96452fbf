"""Implicit process rewards: the policy/reference log-ratio, summed per step. No reward model to train.

    rewards = implicit_step_rewards("workdir/.../r2/train_policy/a1/model", "workdir/.../r0/bootstrap/a1/model",
                                    ["3+4-2\\n"], [["3+4=7", "7-2=5", "#### 5"]])   # [[r1, r2, r3]]

"Free Process Rewards without Process Labels" (Yuan et al. 2024, https://arxiv.org/abs/2412.01981)
and PRIME (Cui et al. 2025): a model trained on outcomes defines token rewards
beta * log(pi(y_t | y_<t) / pi_ref(y_t | y_<t)); a step's reward is their sum over its tokens (its
separator included), so the steps' rewards add up to beta times the sequence log-ratio. beta = 0.05 is
PRIME's value. Prompts are rendered in the policy's `prompt_format` and each trajectory is tokenized as
one text (`prm.encode_steps`), so both models read the tokens the policy wrote.

An agent's episode is scored turn by turn (`score_episodes`): the conversation is encoded append-only, as it was
sampled (`envs.agent.ChatEncoder`), and a turn's reward sums the log-ratio over the tokens that assistant turn
wrote. Observations, tool results and the template's headers are the environment's, so they carry none.
"""

from __future__ import annotations

from typing import Any

from components.models.prompts import PromptFormat, check_prompt_format, render_prompt
from components.rewards import device, episode_turns, sequence_logprobs
from components.rewards.prm import STEP_SEPARATOR, encode_steps


class ImplicitPRM:
    """The implicit PRM as a `components.rewards.RewardModel`: `policy_path` scored against `reference_path`."""

    name = "implicit"
    granularity = "step"

    def __init__(self, policy_path: str, reference_path: str | None, beta: float = 0.05,
                 separator: str = STEP_SEPARATOR, prompt_format: PromptFormat | dict[str, Any] | str | None = None):
        if reference_path is None:
            raise ValueError("the implicit PRM needs a reference model")
        self.policy_path, self.reference_path, self.beta, self.separator = policy_path, reference_path, beta, separator
        self.prompt_format = PromptFormat.of(prompt_format)

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:  # noqa: ARG002
        return implicit_step_rewards(self.policy_path, self.reference_path, prompts, steps, beta=self.beta,
                                     separator=self.separator, prompt_format=self.prompt_format)

    def score_episodes(self, chats: list[list[dict[str, Any]]]) -> list[list[float]]:
        return implicit_turn_rewards(self.policy_path, self.reference_path, chats, beta=self.beta)


def _load_pair(policy_path: str, reference_path: str, dev: str, where: str):
    from components.models.tiny import load_policy

    policy, tok = load_policy(policy_path, device=dev)
    reference, ref_tok = load_policy(reference_path, device=dev)
    if tok.get_vocab() != ref_tok.get_vocab():
        raise ValueError(f"{where}: {policy_path} and {reference_path} have different tokenizers; "
                         "a log-ratio needs the same token ids")
    return policy, reference, tok


def _log_ratios(policy: Any, reference: Any, ids: list[list[int]], pad_id: int, beta: float, dev: str,
                batch_size: int) -> list[Any]:
    """Per sequence, beta * (log pi - log pi_ref) of token t at index t - 1."""
    pol, ref = (sequence_logprobs(m, ids, pad_id, dev, batch_size) for m in (policy, reference))
    return [beta * (a - b) for a, b in zip(pol, ref, strict=True)]


def implicit_turn_rewards(policy_path: str, reference_path: str, chats: list[list[dict[str, Any]]], beta: float = 0.05,
                          batch_size: int = 32, device_name: str | None = None) -> list[list[float]]:
    """Per episode, one reward per assistant turn: beta * sum of log pi - log pi_ref over the ids that turn
    sampled, in the conversation as it was sampled."""
    dev = device_name or device()
    policy, reference, tok = _load_pair(policy_path, reference_path, dev, "implicit_turn_rewards")
    ids, spans = episode_turns(tok, policy_path, chats, "implicit_turn_rewards")
    ratios = _log_ratios(policy, reference, ids, tok.pad_token_id, beta, dev, batch_size)
    # Token t's log-ratio sits at index t - 1; a turn never starts at token 0 (the system turn comes first).
    return [[float(ratios[k][a - 1:b - 1].sum()) for a, b in runs] for k, runs in enumerate(spans)]


def implicit_step_rewards(policy_path: str, reference_path: str, prompts: list[str], steps: list[list[str]],
                          beta: float = 0.05, batch_size: int = 64, device_name: str | None = None,
                          separator: str = STEP_SEPARATOR,
                          prompt_format: PromptFormat | dict[str, Any] | str | None = None) -> list[list[float]]:
    """Per trajectory, one reward per step: beta * sum of log pi - log pi_ref over the step's tokens."""
    if len(prompts) != len(steps):
        raise ValueError(f"implicit_step_rewards: {len(prompts)} prompts but {len(steps)} step lists")
    dev = device_name or device()
    policy, reference, tok = _load_pair(policy_path, reference_path, dev, "implicit_step_rewards")
    fmt = PromptFormat.of(prompt_format)
    check_prompt_format(tok, fmt, policy_path)
    # The same tokenisation as the PRM: the rendered prompt and each step then its separator, as one text.
    enc = [encode_steps(tok, render_prompt(tok, p, fmt), s, separator) for p, s in zip(prompts, steps)]
    scored = [i for i, e in enumerate(enc) if e.ends]
    ratios = _log_ratios(policy, reference, [enc[i].ids for i in scored], tok.pad_token_id, beta, dev, batch_size)
    out: list[list[float]] = [[] for _ in prompts]
    for row, i in enumerate(scored):
        # Step j holds tokens (ends[j-1], ends[j]]; token t's log-ratio sits at index t - 1.
        bounds = [enc[i].prompt_len - 1, *enc[i].ends]
        out[i] = [float(ratios[row][max(lo, 0):hi].sum()) for lo, hi in zip(bounds, bounds[1:])]
    return out
