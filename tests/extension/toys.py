"""Toy parts that plug into coevo from outside `components/`, by dotted path, as a user's would.

- `SumDomain`: sums of one-digit numbers whose steps are two lines each ("3+4" then "=7"), separated by
  a blank line: a domain with multi-line steps and its own step separator.
- `WellFormedSteps`: a reward model that trains nothing: 1.0 for a step of the domain's two-line form.
- `RECIPE` (`rft-lite`): rft without the score stage; the verifier outcome ranks the right answers.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from components.domains.base import Problem
from components.recipes import Recipe

STEP = re.compile(r"(-?\d+)\+(\d+)\n=(-?\d+)")
ANSWER = re.compile(r"#### (-?\d+)")


@dataclass
class SumDomain:
    max_level: int = 2  # level k: k + 1 numbers to add
    test_size: int = 12
    name: str = field(default="toysum", init=False)
    step_separator: str = field(default="\n\n", init=False)  # a step is "a+b\n=c": two lines

    def levels(self) -> list[int]:
        return list(range(1, self.max_level + 1))

    def _draw(self, rng: random.Random, level: int) -> Problem:
        xs = [rng.randint(0, 9) for _ in range(level + 1)]
        return Problem.make(self.name, level, " ".join(map(str, xs)) + "\n", str(sum(xs)))

    def test_set(self, level: int) -> list[Problem]:
        rng, out = random.Random(f"toysum-test:{level}"), {}
        while len(out) < self.test_size:
            p = self._draw(rng, level)
            out.setdefault(p.problem_id, p)
        return list(out.values())

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        test = {p.prompt for p in self.test_set(level)}
        rng, out = random.Random(f"toysum:{seed}:{level}"), []
        while len(out) < n:
            p = self._draw(rng, level)
            if p.prompt not in test:
                out.append(p)
        return out

    def reference_solution(self, problem: Problem) -> str:
        """>>> SumDomain().reference_solution(Problem.make("toysum", 2, "3 4 5\\n", "12"))
        '3+4\\n=7\\n\\n7+5\\n=12\\n\\n#### 12\\n\\n'
        """
        xs = [int(x) for x in problem.prompt.split()]
        steps, total = [], xs[0]
        for x in xs[1:]:
            steps.append(f"{total}+{x}\n={total + x}")
            total += x
        return "".join(s + self.step_separator for s in [*steps, f"#### {total}"])

    def split_steps(self, completion: str) -> list[str]:
        """Blank-line separated steps, up to and including the '####' one.

        >>> SumDomain().split_steps("3+4\\n=7\\n\\n#### 7\\n\\nmore")
        ['3+4\\n=7', '#### 7']
        """
        steps = []
        for chunk in completion.split(self.step_separator):
            if chunk.strip():
                steps.append(chunk.strip())
                if chunk.strip().startswith("####"):
                    break
        return steps

    def extract_answer(self, completion: str) -> str | None:
        """The answer, only where every step before it has the two-line form: a completion whose steps
        are not separated by blank lines (joined with another separator) has none."""
        steps = self.split_steps(completion)
        if not steps or not all(STEP.fullmatch(s) for s in steps[:-1]):
            return None
        m = ANSWER.fullmatch(steps[-1])
        return m.group(1) if m else None

    def verify(self, completions: list[str], references: list[str]) -> list[float | None]:
        return [float(self.extract_answer(c) == r) for c, r in zip(completions, references)]

    def oracle_step_labels(self, problem: Problem, completion: str) -> list[bool] | None:
        xs, total, out = [int(x) for x in problem.prompt.split()], None, []
        for i, s in enumerate(self.split_steps(completion)):
            m = STEP.fullmatch(s)
            if m:
                a, b, c = map(int, m.groups())
                want_a = xs[0] if i == 0 else total
                out.append(a == want_a and i + 1 < len(xs) and b == xs[i + 1] and c == a + b)
                total = c
            else:
                a = ANSWER.fullmatch(s)
                out.append(bool(a) and str(total if total is not None else xs[0]) == a.group(1) == str(sum(xs)))
        return out

    def check_steps(self, prompt: str, completion: str) -> bool | None:
        return None


class WellFormedSteps:
    """A `components.rewards.RewardModel` that trains nothing: 1.0 for a step of SumDomain's form."""

    name = "well_formed"
    granularity = "step"

    def __init__(self, uri: str | None = None, separator: str = "\n"):
        self.separator = separator

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:
        return [[float(bool(STEP.fullmatch(s) or ANSWER.fullmatch(s))) for s in st] for st in steps]


RECIPE = Recipe(name="rft-lite", stages=("generate", "verify", "filter", "train_policy", "evaluate"),
                description="rft without the score stage: the verifier outcome ranks the right answers")
