"""A reward model that knows: arith's exact step labels as step scores, for measuring what step credit could pay.

    --set score.reward_model=benchmarks.oracle_prm:OracleStepPRM

`grpo_vs_rft.py`'s `-oracle` and `-oraclemin` arms use it where `-prm` and `-prmmin` use a trained PRM, so the
difference between the two is what the trained PRM's ranking costs, and the oracle arm's gain over outcome-only
grpo bounds what any PRM's step credit could add there. It follows `components.rewards.RewardModel` (built as
`Class(uri=..., separator=...)`, no checkpoint) and scores a step 1 where `ArithDomain.oracle_step_labels` calls
it right, else 0: the running total before it, the problem's next operation, and the total after it, judged
against the true totals, so a slip and the step that cancels it both score 0. A benchmark's tool, not a product
reward model: no real domain has these labels.

>>> rm = OracleStepPRM(uri=None, separator="\\n")
>>> rm.score(["9+8+5\\n"], ["9+8=16\\n16+6=22\\n#### 22\\n"], [["9+8=16", "16+6=22", "#### 22"]])
[[0.0, 0.0, 1.0]]
"""

from __future__ import annotations

from components.domains.arith import ArithDomain
from components.domains.base import Problem


class OracleStepPRM:
    name = "oracle"
    granularity = "step"

    def __init__(self, uri: str | None = None, separator: str = "\n") -> None:
        self.domain = ArithDomain()
        self.separator = separator

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:
        out = []
        for prompt, completion, these in zip(prompts, completions, steps, strict=True):
            labels = self.domain.oracle_step_labels(Problem.make("arith", 0, prompt, ""), completion)
            if len(labels) != len(these):
                raise ValueError(f"OracleStepPRM: {len(these)} steps given for {completion!r}, but arith splits it "
                                 f"into {len(labels)}")
            out.append([1.0 if ok else 0.0 for ok in labels])
        return out
