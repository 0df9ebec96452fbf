"""What most environments share: problems drawn in levels from a seed, and an episode in which the agent
calls tools until it answers in a turn without a call.

An environment built on these supplies `_draw(rng, level) -> Problem` (a problem, deterministic given the
rng), `instructions`, `tools`, `bind(problem) -> ({name: Tool}, context)` (the tools with their implementations
for one episode, and what they share, such as its database) and `score(problem, final_text, context) -> float`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from components.domains.base import Problem
from components.envs import toolcalls
from components.envs.base import Action, EpisodeLimits, Message, StepResult, Tool, call_tools


REFUSALS = 50  # refused draws in a row after which a template is taken to have no new problem left


class LeveledProblems:
    """`levels`, `test_set` and `sample_problems` from `_draw`: the held-out set is drawn from its own seed
    and never appears among training problems.

    It also gives an environment the rest of the `Domain` methods the stages call. An episode's steps are its
    assistant turns, which the agent loop stores itself; its outcome is the environment's `score`, run on the
    episode's last turn (`verify_episodes`), not a text verifier; there is no step checker or oracle."""

    name: str
    max_level: int
    test_size: int
    step_separator: str = "\n"
    cycle_templates: bool = False  # an environment with templates may take them in turn (`_drawn`)

    def reference_solution(self, problem: Problem) -> str:
        """The reference episode's final answer turn."""
        return [m["content"] for m in self.reference_episode(problem) if m["role"] == "assistant"][-1]

    def split_steps(self, completion: str) -> list[str]:
        return [completion]

    def extract_answer(self, text: str) -> str | None:
        return text.strip() or None

    def verify(self, completions: list[str], references: list[str]) -> list[float | None]:
        raise TypeError(f"{self.name} is an environment: its outcome comes from running an episode's answer "
                        "(`score`), which needs the problem, not a text verifier")

    def oracle_step_labels(self, problem: Problem, completion: str) -> None:
        return None

    def check_steps(self, prompt: str, completion: str) -> None:
        return None

    def levels(self) -> list[int]:
        return list(range(1, self.max_level + 1))

    def _check_level(self, level: int) -> None:
        if level not in self.levels():
            raise ValueError(f"{self.name}: level {level} not in {self.levels()}")

    def _draw(self, rng: random.Random, level: int) -> Problem:
        raise NotImplementedError

    def _templates(self, level: int) -> list[Any]:
        """A level's templates, for `cycle_templates`; `_draw(rng, level, template)` draws one of them."""
        raise NotImplementedError(f"{self.name}: no templates to cycle")

    def _drawn(self, seed: str, level: int, n: int, exclude: set[str]) -> list[Problem]:
        """`n` distinct problems of `level` from `seed`, none of `exclude`. With `cycle_templates` the level's
        templates take turns, so N problems hold each of T about N/T times: a refused draw (a duplicate, an excluded
        one) is retried on the same template, and one refused `REFUSALS` times in a row is taken to be spent (one
        without parameters has a single problem) and leaves the turns."""
        rng = random.Random(seed)
        live: list[Any] = list(self._templates(level)) if self.cycle_templates else [None]
        out: list[Problem] = []
        taken = set(exclude)
        turn = refused = 0
        for _ in range(50 * n + 100):
            if len(out) == n or not live:
                break
            template = live[turn % len(live)]
            p = self._draw(rng, level) if template is None else self._draw(rng, level, template)
            if p.problem_id not in taken:
                out.append(p)
                taken.add(p.problem_id)
                turn, refused = turn + 1, 0
            else:
                refused += 1
                if refused == REFUSALS and template is not None:
                    del live[turn % len(live)]
                    refused = 0
        return out

    def test_set(self, level: int) -> list[Problem]:
        self._check_level(level)
        if not hasattr(self, "_tests"):
            self._tests: dict[int, list[Problem]] = {}
        if level not in self._tests:
            # A small level keeps half its problems for training: the space is what many draws find.
            space = len(self._drawn(f"{self.name}-space:{level}", level, 4 * self.test_size, set()))
            self._tests[level] = self._drawn(f"{self.name}-test:{level}", level,
                                             min(self.test_size, max(1, space // 2)), set())
        return self._tests[level]

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        self._check_level(level)
        held_out = {p.problem_id for p in self.test_set(level)}
        return self._drawn(f"{self.name}-sample:{seed}:{level}", level, n, held_out)


class FileProblems(LeveledProblems):
    """Problems read from a file where the environment was given one (`_hold_out` sets `_files`: a fixed tenth,
    by problem id, held out), else drawn in levels. Levels are those with training problems."""

    _files: dict[str, list[Problem]]
    test_size: int | None

    def _hold_out(self, problems: list[Problem]) -> None:
        self._files = {"test": [p for p in problems if int(p.problem_id, 16) % 10 == 0],
                       "train": [p for p in problems if int(p.problem_id, 16) % 10 != 0]}

    def levels(self) -> list[int]:
        if not self._files:
            return super().levels()
        return sorted({p.level for p in self._files["train"]})

    def test_set(self, level: int) -> list[Problem]:
        if not self._files:
            return super().test_set(level)
        self._check_level(level)
        return [p for p in self._files["test"] if p.level == level][: self.test_size]

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        if not self._files:
            return super().sample_problems(level, n, seed)
        self._check_level(level)
        pool = [p for p in self._files["train"] if p.level == level]
        rng = random.Random(f"{self.name}-sample:{seed}:{level}")
        out: list[Problem] = []
        while len(out) < n:
            out.extend(rng.sample(pool, min(len(pool), n - len(out))))
        return out


@dataclass
class ToolEpisode:
    """Turns with tool calls get the tools' observations; the first turn without one is the answer, scored."""
    env: Any
    problem: Problem
    limits: EpisodeLimits
    tools: dict[str, Tool] = field(default_factory=dict)
    context: Any = None
    answered: bool = False

    def reset(self) -> list[Message]:
        self.tools, self.context = self.env.bind(self.problem)
        self.answered = False
        return [{"role": "system", "content": toolcalls.system_prompt(self.env.tools, self.env.instructions)},
                {"role": "user", "content": self.problem.prompt}]

    def step(self, action: Action) -> StepResult:
        if self.answered:
            raise RuntimeError(f"{self.env.name}: step after the episode ended")
        if action.tool_calls or action.parse_error:
            return call_tools(self.tools, action, self.limits.max_observation_chars)
        self.answered = True
        return StepResult([], float(self.env.score(self.problem, action.text, self.context)), True, {})


def reference_messages(env: Any, problem: Problem, turns: list[tuple[str, str | None]],
                       limits: EpisodeLimits) -> list[Message]:
    """A gold episode as messages, its observations produced by the environment's own tools: `turns` are
    (assistant text, None) pairs, each answered by the episode as the agent would be."""
    ep = ToolEpisode(env, problem, limits)
    messages = ep.reset()
    for text, _ in turns:
        messages.append({"role": "assistant", "content": text})
        result = ep.step(toolcalls.parse(text))
        messages.extend(result.observations)
        if result.done:
            if result.reward != 1.0:
                raise AssertionError(f"{env.name}: the reference episode of {problem.problem_id} scored {result.reward}")
            break
    return messages
