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
    episode's last turn (`verify_episodes`), not a text verifier; there is no oracle. Its step checker reads the
    stored turns (`check_episode`), not the transcript (`check_steps`)."""

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
        return None  # an episode is checked on its turns: check_episode

    def check_episode(self, prompt: str, turns: list[dict[str, Any]]) -> bool | None:
        """filter.check_steps on an episode (its `turns` rows): do its worked turns check out, executed against
        the problem and compared with no gold answer? Every tool call must have run: a malformed call, an unknown
        tool, wrong arguments or a tool's own error is a step that did not check out, though the episode may
        have gone on to answer right. Then the episode must have answered, and `check_answer` reads the answer
        against what the calls returned. None where the environment offers no tool (nothing was worked).

        >>> from components.envs.calculator import CalculatorEnv
        >>> env = CalculatorEnv()
        >>> p = env.sample_problems(level=3, n=1, seed=0)[0]
        >>> turns = turn_rows(env.reference_episode(p))
        >>> env.check_episode(p.prompt, turns), env.check_episode(p.prompt, turns[:-1])  # no answer turn
        (True, False)
        """
        if not self.tools:
            return None
        calls, answer = episode_calls(turns)
        return answer is not None and all(c.ok for c in calls) and self.check_answer(prompt, calls, answer)

    def check_answer(self, prompt: str, calls: list[Called], answer: str) -> bool:
        """Does the answer turn follow from what the episode's calls returned? Every call ran (`check_episode`);
        an environment says what its answer must repeat. By default anything."""
        return True

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


@dataclass(frozen=True)
class Called:
    """A tool call an episode made, with what came back: `arguments` None where the call could not be read."""
    name: str
    arguments: dict[str, Any] | None
    observation: str
    ok: bool


def episode_calls(turns: list[dict[str, Any]]) -> tuple[list[Called], str | None]:
    """An episode's tool calls in order, each with its observation, read from its `turns` rows (the calls from
    the assistant turns, as the environment parsed them); and its answer, the last assistant turn where it holds
    no call (None: the episode never answered). A call that did not run is `ok=False`: where a row does not
    say (`tool_ok` null), an observation that starts with "error:" did not.

    >>> calls, answer = episode_calls(turn_rows([
    ...     {"role": "user", "content": "What is 2*3?"},
    ...     {"role": "assistant", "content": '<tool_call>{"name": "calculate"</tool_call>'},
    ...     {"role": "tool", "name": "invalid", "content": "error: tool call 1 is not valid JSON"},
    ...     {"role": "assistant", "content": '<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}'
    ...                                      '</tool_call>'},
    ...     {"role": "tool", "name": "calculate", "content": "6"},
    ...     {"role": "assistant", "content": "#### 6"}]))
    >>> [(c.name, c.arguments, c.observation, c.ok) for c in calls], answer
    ([('invalid', None, 'error: tool call 1 is not valid JSON', False), ('calculate', {'expression': '2*3'}, '6', True)], '#### 6')
    """
    calls: list[Called] = []
    pending: list[tuple[str, dict[str, Any] | None]] = []
    answer = None
    for t in sorted(turns, key=lambda t: t["turn_index"]):
        if t["role"] == "assistant":
            action = toolcalls.parse(t["content"])
            # The environment answers a turn's unreadable calls first, with one error observation (`call_tools`).
            pending = [("invalid", None)] * bool(action.parse_error) + [(c.name, c.arguments) for c in action.tool_calls]
            answer = None if pending else t["content"]
        elif t["role"] == "tool":
            name, arguments = pending.pop(0) if pending else (t.get("tool_name") or "invalid", None)
            ok = t.get("tool_ok")
            calls.append(Called(name, arguments, t["content"],
                                not t["content"].startswith("error:") if ok is None else bool(ok)))
    return calls, answer


def turn_rows(messages: list[Message]) -> list[dict[str, Any]]:
    """Chat messages (a reference episode's) as the `turns` rows the store holds of them, for `check_episode`."""
    return [{"turn_index": i, "role": m["role"], "content": m["content"],
             "tool_name": m.get("name") if m["role"] == "tool" else None, "tool_ok": None}
            for i, m in enumerate(messages)]


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
