"""Implicit process rewards: the policy/reference log-ratio, summed per step. No reward model to train.

    rewards = implicit_step_rewards("workdir/.../r2/train_policy/a1/model", "workdir/.../r0/bootstrap/a1/model",
                                    ["3+4-2\\n"], [["3+4=7", "7-2=5", "#### 5"]])   # [[r1, r2, r3]]

"Free Process Rewards without Process Labels" (Yuan et al. 2024, https://arxiv.org/abs/2412.01981)
and PRIME (Cui et al. 2025): a model trained on outcomes defines token rewards
beta * log(pi(y_t | y_<t) / pi_ref(y_t | y_<t)); a step's reward is their sum over its tokens (its
separator included), so the steps' rewards add up to beta times the sequence log-ratio. beta = 0.05 is
PRIME's value. Prompts are rendered in the policy's `prompt_format` and each trajectory is tokenized as
one text (`prm.encode_steps`), so both models read the tokens the policy wrote.
"""

from __future__ import annotations

from typing import Any

from components.models.prompts import PromptFormat, check_prompt_format, render_prompt
from components.rewards import device, pad_right, token_logprobs
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


def implicit_step_rewards(policy_path: str, reference_path: str, prompts: list[str], steps: list[list[str]],
                          beta: float = 0.05, batch_size: int = 64, device_name: str | None = None,
                          separator: str = STEP_SEPARATOR,
                          prompt_format: PromptFormat | dict[str, Any] | str | None = None) -> list[list[float]]:
    """Per trajectory, one reward per step: beta * sum of log pi - log pi_ref over the step's tokens."""
    import torch

    from components.models.tiny import load_policy

    if len(prompts) != len(steps):
        raise ValueError(f"implicit_step_rewards: {len(prompts)} prompts but {len(steps)} step lists")
    dev = device_name or device()
    policy, tok = load_policy(policy_path, device=dev)
    reference, ref_tok = load_policy(reference_path, device=dev)
    if tok.get_vocab() != ref_tok.get_vocab():
        raise ValueError(f"implicit_step_rewards: {policy_path} and {reference_path} have different tokenizers; "
                         "a log-ratio needs the same token ids")
    fmt = PromptFormat.of(prompt_format)
    check_prompt_format(tok, fmt, policy_path)
    # The same tokenisation as the PRM: the rendered prompt and each step then its separator, as one text.
    enc = [encode_steps(tok, render_prompt(tok, p, fmt), s, separator) for p, s in zip(prompts, steps)]
    order = sorted((i for i, e in enumerate(enc) if e.ends), key=lambda i: len(enc[i].ids))
    out: list[list[float]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        ids, mask = pad_right([enc[i].ids for i in idx], tok.pad_token_id)
        ids, mask = ids.to(dev), mask.to(dev)
        with torch.inference_mode():
            logps = [token_logprobs(m(input_ids=ids, attention_mask=mask).logits, ids) for m in (policy, reference)]
            ratio = (beta * (logps[0] - logps[1])).cpu()
        for row, i in enumerate(idx):
            # Step j holds tokens (ends[j-1], ends[j]]; token t's log-ratio sits at index t - 1.
            bounds = [enc[i].prompt_len - 1, *enc[i].ends]
            out[i] = [float(ratio[row, max(lo, 0):hi].sum()) for lo, hi in zip(bounds, bounds[1:])]
    return out
