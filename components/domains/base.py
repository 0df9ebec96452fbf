"""The `Domain` protocol and the `Problem` record every stage passes around.

A domain supplies problems, a prompt format, step segmentation, answer extraction, a pure verifier
and, where it has one, an oracle step labeler. Implementations: `arith.py`, `gsm8k.py`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


def problem_id(domain: str, prompt: str, answer: str) -> str:
    """Content hash, so the same problem gets the same id in every round, process and machine.

    >>> problem_id("arith", "3+4\\n", "7")
    '9c35f1994a2057fa'
    """
    return hashlib.sha256(f"{domain}\x1f{prompt}\x1f{answer}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Problem:
    problem_id: str  # problem_id(domain, prompt, answer): content hash, stable across runs
    domain: str
    level: int  # difficulty; its meaning is the domain's (arith: number of +/- operations)
    prompt: str  # exactly the text fed to the model, already formatted
    answer: str  # canonical final answer string, what `verify` compares against
    # JSON-serialisable extras; kept out of ==/hash because the id already fixes the content.
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def make(cls, domain: str, level: int, prompt: str, answer: str, meta: dict[str, Any] | None = None) -> Problem:
        return cls(problem_id(domain, prompt, answer), domain, level, prompt, answer, dict(meta or {}))


def unique_problems(problems: list[Problem]) -> list[Problem]:
    """Drop repeats (a small level can have fewer distinct problems than asked for), keeping order."""
    seen: set[str] = set()
    return [p for p in problems if not (p.problem_id in seen or seen.add(p.problem_id))]


def verify_answers(name: str, completions: list[str], references: list[str | None],
                   extract: Callable[[str], str | None], equal: Callable[[str, str], bool]) -> list[float | None]:
    """1.0 where `extract` finds an answer in the completion and it `equal`s the reference, else 0.0; None where the
    reference is None (the problem has no answer to check). `name` names the domain in the length error.

    >>> verify_answers("d", ["#### 7", "7", "x"], ["7", "7", None], lambda c: c[5:] or None, str.__eq__)
    [1.0, 0.0, None]
    """
    if len(completions) != len(references):
        raise ValueError(f"{name}.verify: {len(completions)} completions but {len(references)} references")
    out: list[float | None] = []
    for completion, ref in zip(completions, references):
        if ref is None:
            out.append(None)
            continue
        got = extract(completion)
        out.append(1.0 if got is not None and equal(got, ref) else 0.0)
    return out


@runtime_checkable
class Domain(Protocol):
    name: str
    # What ends each step in a completion: `split_steps` cuts there, and step prefixes (Monte Carlo
    # rollouts, step-by-step search, the PRM's input) are the steps each followed by it.
    step_separator: str

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        """`n` training problems, deterministic given `seed`, never in `test_set(level)`; unique where the space allows."""
        ...

    def test_set(self, level: int) -> list[Problem]:
        """The fixed held-out set for `level`: identical across calls and processes."""
        ...

    def levels(self) -> list[int]:
        ...

    def reference_solution(self, problem: Problem) -> str:
        """Gold worked solution: completion text only, no prompt, no EOS."""
        ...

    def split_steps(self, completion: str) -> list[str]:
        """Segmented steps; the final answer line counts as the last step."""
        ...

    def extract_answer(self, completion: str) -> str | None:
        ...

    def verify(self, completions: list[str], references: list[str]) -> list[float | None]:
        """Pure outcome verifier: 1.0 correct, 0.0 wrong, None not applicable."""
        ...

    def oracle_step_labels(self, problem: Problem, completion: str) -> list[bool] | None:
        """Per step of `split_steps(completion)`: is it correct? None if the domain has no oracle."""
        ...

    def check_steps(self, prompt: str, completion: str) -> bool | None:
        """Does every worked step check out against the problem (executed, not compared with a gold
        solution)? None where the domain has no step checker."""
        ...


def step_verdicts(domain: Domain, trajectories: list[dict[str, Any]],
                  turns: list[dict[str, Any]] | None = None) -> dict[str, bool | None]:
    """The domain's step checker (filter.check_steps) on each trajectory, by id: `check_steps` on its prompt and
    completion, or for an environment's episodes (`turns`: their stored rows) `check_episode` on its turns. None
    where the domain has no checker.

    >>> from components.domains.arith import ArithDomain
    >>> step_verdicts(ArithDomain(), [{"trajectory_id": "a", "prompt": "3+4\\n", "completion": "3+4=7\\n#### 7\\n"}])
    {'a': True}
    """
    episodic = getattr(domain, "check_episode", None)
    if turns is None or episodic is None:
        return {t["trajectory_id"]: domain.check_steps(t["prompt"], t["completion"]) for t in trajectories}
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in turns:
        by_id.setdefault(row["trajectory_id"], []).append(row)
    return {t["trajectory_id"]: episodic(t["prompt"], by_id.get(t["trajectory_id"], [])) for t in trajectories}


class FileProblems:
    """The `Domain` methods of a dataset held in memory: `_train` and `_test` problem lists, read from files
    by the domain (`gsm8k`, `jsonl`), with its `name` and `test_size` (held-out problems per level, None: all)."""

    name: str
    test_size: int | None
    _train: list[Problem]
    _test: list[Problem]

    def levels(self) -> list[int]:
        """Levels with both training and test problems."""
        return sorted({p.level for p in self._train} & {p.level for p in self._test})

    def _check_level(self, level: int) -> None:
        if level not in self.levels():
            raise ValueError(f"{self.name}: level {level} not in {self.levels()}")

    def test_set(self, level: int) -> list[Problem]:
        self._check_level(level)
        return [p for p in self._test if p.level == level][: self.test_size]

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        """`n` training problems at `level`: unique while the pool lasts, then reshuffled repeats."""
        self._check_level(level)
        pool = [p for p in self._train if p.level == level]
        rng = random.Random(f"{self.name}-sample:{seed}:{level}")  # str seeds hash with sha512: stable across processes
        out: list[Problem] = []
        while len(out) < n:
            out.extend(rng.sample(pool, min(len(pool), n - len(out))))
        return out

    def reference_solution(self, problem: Problem) -> str:
        return problem.meta["solution"]
