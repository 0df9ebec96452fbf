"""The sampler's confidence as a step score: a step scores the probability of its least likely token under the
policy that sampled the round. Nothing to train and no rollouts: one forward pass a trajectory, every round.

    rm = SamplerConfidence("workdir/.../r1/train_policy/a1/model")
    rm.score(["3+4-2\\n"], [""], [["3+4=7", "7-2=5", "#### 5"]])   # [[p1, p2, p3]], each in (0, 1]

A right answer whose steps do not check out got there through a token its own sampler found unlikely: a slip that
a later slip cancels, or a skipped term. So the weakest step (the `min` aggregate: the answer's least likely
token) ranks sound right answers above unsound ones, and `filter.min_step_score` can keep the unsound ones out of
what a round trains on, as DeepConf (Fu et al. 2025) filters reasoning traces by their least confident stretch.
It is the likelihood PRM's rule (`prm.py`, head `likelihood`: a step scores by its least likely token) applied to
the sampler itself, untrained and uncalibrated, and without the PRM's carry-over to later steps: a step is scored
by its own tokens (its separator included), so step credit sees where confidence fell. An agent's episode is
scored turn by turn (`score_episodes`), over the ids each assistant turn sampled.

Measured on arith (docs/grpo.md, "The checker as a judge alone, and the sampler's confidence as one"): it ranks
the checker's sound right answers above the unsound ones at an AUC near 0.9, where the implicit PRM ranks them at
0.49-0.74.
"""

from __future__ import annotations

import math
from typing import Any

from components.models.prompts import PromptFormat
from components.rewards import device, episode_turns, sequence_logprobs
from components.rewards.prm import STEP_SEPARATOR, StepScorer, StepTokens


class SamplerConfidence(StepScorer):
    """`components.rewards.RewardModel` over a policy checkpoint: per step, the probability of its least likely
    token given the prompt (rendered in `prompt_format`) and the steps before it. Trajectories over `max_length`
    tokens are cut, keeping the steps that end within it, and counted in `truncated`."""

    name = "confidence"
    granularity = "step"

    def __init__(self, path: str, device_name: str | None = None, separator: str = STEP_SEPARATOR,
                 prompt_format: PromptFormat | dict[str, Any] | str | None = None, dtype: str = "float32",
                 max_length: int | None = None):
        from components.models.tiny import load_policy

        if max_length is not None and max_length < 1:  # before the model loads
            raise ValueError(f"SamplerConfidence.max_length must be >= 1 or None, got {max_length}")
        self.path, self.device = path, device_name or device()
        self.model, tok = load_policy(path, device=self.device, dtype=dtype)
        self._setup_steps(tok, path, separator, prompt_format, max_length)

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]],  # noqa: ARG002
              batch_size: int = 64) -> list[list[float]]:
        enc = self._encode_steps(prompts, steps)
        scored = [i for i, e in enumerate(enc) if e.ends]
        out: list[list[float]] = [[] for _ in prompts]
        lps = sequence_logprobs(self.model, [enc[i].ids for i in scored], self.pad_id, self.device, batch_size)
        for i, lp in zip(scored, lps, strict=True):
            out[i] = least_likely(lp.tolist(), enc[i])
        return out

    def score_episodes(self, chats: list[list[dict[str, Any]]], batch_size: int = 32) -> list[list[float]]:
        """Per episode, one score per assistant turn: the probability of the least likely id that turn sampled, in
        the conversation encoded append-only as it was sampled (`envs.agent.ChatEncoder`). Observations, tool
        results and the template's headers are the environment's, so they count for nothing."""
        ids, spans = episode_turns(self.tok, self.path, chats, "SamplerConfidence.score_episodes")
        # Token t's log-probability sits at index t - 1; a turn never starts at token 0 (the system turn's).
        lps = sequence_logprobs(self.model, ids, self.pad_id, self.device, batch_size)
        return [[math.exp(float(lp[a - 1:b - 1].min())) for a, b in runs] for lp, runs in zip(lps, spans, strict=True)]


def least_likely(logprobs: list[float], enc: StepTokens) -> list[float]:
    """Per step, exp of the lowest log-probability among its tokens: those after the previous step's end (the
    prompt's, for the first) up to its own end. `logprobs[t - 1]` is token t's (`token_logprobs`).

    >>> lp = [math.log(p) for p in (0.9, 0.9, 0.5, 0.8, 0.1, 0.7)]   # tokens 1-6 of 7; the prompt is tokens 0-1
    >>> [round(p, 3) for p in least_likely(lp, StepTokens(list(range(7)), [4, 6], 2))]
    [0.5, 0.1]
    """
    out, start = [], max(enc.prompt_len, 1)  # token 0 has no log-probability
    for end in enc.ends:
        span = logprobs[start - 1:end] or logprobs[max(end, 1) - 1:max(end, 1)]  # one token ending two steps
        out.append(min(1.0, math.exp(min(span))))
        start = end + 1
    return out
