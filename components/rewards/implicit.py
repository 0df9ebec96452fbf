"""Implicit process rewards: the policy/reference log-ratio, summed per step. No reward model to train.

    rewards = implicit_step_rewards("workdir/.../r2/train_policy/a1/model", "workdir/.../r0/bootstrap/a1/model",
                                    ["3+4-2\\n"], [["3+4=7", "7-2=5", "#### 5"]])   # [[r1, r2, r3]]

"Free Process Rewards without Process Labels" (Yuan et al. 2024, https://arxiv.org/abs/2412.01981)
and PRIME (Cui et al. 2025): a model trained on outcomes defines token rewards
beta * log(pi(y_t | y_<t) / pi_ref(y_t | y_<t)); a step's reward is their sum over its tokens (its
separator included), so the steps' rewards add up to beta times the sequence log-ratio. beta = 0.05 is
PRIME's value.
"""

from __future__ import annotations

from components.rewards import device, pad_right, token_logprobs
from components.rewards.prm import STEP_SEPARATOR, tokenize_steps


class ImplicitPRM:
    """The implicit PRM as a `components.rewards.RewardModel`: `policy_path` scored against `reference_path`."""

    name = "implicit"
    granularity = "step"

    def __init__(self, policy_path: str, reference_path: str | None, beta: float = 0.05,
                 separator: str = STEP_SEPARATOR):
        if reference_path is None:
            raise ValueError("the implicit PRM needs a reference model")
        self.policy_path, self.reference_path, self.beta, self.separator = policy_path, reference_path, beta, separator

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:  # noqa: ARG002
        return implicit_step_rewards(self.policy_path, self.reference_path, prompts, steps, beta=self.beta,
                                     separator=self.separator)


def implicit_step_rewards(policy_path: str, reference_path: str, prompts: list[str], steps: list[list[str]],
                          beta: float = 0.05, batch_size: int = 64, device_name: str | None = None,
                          separator: str = STEP_SEPARATOR) -> list[list[float]]:
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
    # The same tokenisation as the PRM and the backends: plain text, each step then its separator.
    enc = [tokenize_steps(tok, p, s, separator) for p, s in zip(prompts, steps)]
    prompt_lens = [len(ids) for ids in tok(prompts, add_special_tokens=False)["input_ids"]]
    order = sorted((i for i, (_, ends) in enumerate(enc) if ends), key=lambda i: len(enc[i][0]))
    out: list[list[float]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        ids, mask = pad_right([enc[i][0] for i in idx], tok.pad_token_id)
        ids, mask = ids.to(dev), mask.to(dev)
        with torch.inference_mode():
            logps = [token_logprobs(m(input_ids=ids, attention_mask=mask).logits, ids) for m in (policy, reference)]
            ratio = (beta * (logps[0] - logps[1])).cpu()
        for row, i in enumerate(idx):
            # Step j holds tokens (ends[j-1], ends[j]]; token t's log-ratio sits at index t - 1.
            bounds = [prompt_lens[i] - 1, *enc[i][1]]
            out[i] = [float(ratio[row, max(lo, 0):hi].sum()) for lo, hi in zip(bounds, bounds[1:])]
    return out
