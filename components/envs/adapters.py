"""Environments written for other frameworks, and today's single-turn domains, under the coevo protocol.

- `DomainEnv(domain)`: any `Domain` (arith, gsm8k, jsonl) as a one-turn environment: the answer is the first
  turn and the reward is the domain's own verifier, so its results do not change.
- `TrlEnv(factory, rows)`: an environment class written for TRL's `GRPOTrainer(environment_factory=...)`:
  `reset(**row)` may return text appended to the prompt, its public methods are the tools (their schemas
  read from type hints and docstrings, as TRL reads them), and `get_reward()` gives the outcome.
- `SkyrlEnv(env_cls, rows)`: a skyrl-gym `BaseTextEnv` subclass: `init(prompt)` then `step(text)`, which
  parses its own actions and returns observations, reward and done.

Rows are dataset rows: a `prompt` (text, or chat messages whose last user message is the question), an
optional `level` (default 1) and whatever else the environment's reset reads. A fixed tenth of them (by
problem id) is held out as the test set.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from components.domains.base import Domain, Problem
from components.envs import toolcalls
from components.envs.base import EpisodeLimits, Message, StepResult, Tool, call_tools
from components.envs.episodes import FileProblems


@dataclass
class DomainEnv:
    """A single-turn domain as an environment: one assistant turn, scored by the domain's verifier."""
    domain: Domain
    limits: EpisodeLimits = EpisodeLimits(max_turns=1)
    tools: tuple[Tool, ...] = ()

    @property
    def name(self) -> str:
        return self.domain.name

    def levels(self) -> list[int]:
        return self.domain.levels()

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        return self.domain.sample_problems(level, n, seed)

    def test_set(self, level: int) -> list[Problem]:
        return self.domain.test_set(level)

    def episode(self, problem: Problem) -> _OneTurn:
        return _OneTurn(self.domain, problem)

    def reference_episode(self, problem: Problem) -> list[Message]:
        return [{"role": "user", "content": problem.prompt},
                {"role": "assistant", "content": self.domain.reference_solution(problem)}]


@dataclass
class _OneTurn:
    domain: Domain
    problem: Problem

    def reset(self) -> list[Message]:
        return [{"role": "user", "content": self.problem.prompt}]

    def step(self, action) -> StepResult:
        verdict = self.domain.verify([action.text], [self.problem.answer])[0]
        return StepResult([], float(verdict or 0.0), True, {"verdict": verdict})


class RowProblems(FileProblems):
    """Problems from dataset rows: levels from `level`, a tenth held out by id."""

    def _rows_to_problems(self, rows: Sequence[dict[str, Any]]) -> None:
        problems = []
        for i, row in enumerate(rows):
            prompt = row.get("prompt")
            if isinstance(prompt, list):  # chat messages: the question is the last user message
                prompt = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), None)
            if not isinstance(prompt, str):
                raise ValueError(f"{self.name}: row {i} needs a `prompt` (text or chat messages with a user message)")
            problems.append(Problem.make(self.name, int(row.get("level", 1)), prompt,
                                         json.dumps(row.get("answer")), {"row": row}))
        if not problems:
            raise ValueError(f"{self.name}: no rows")
        self._hold_out(problems)


def method_tools(instance: Any, skip: Sequence[str] = ("reset", "get_reward")) -> tuple[Tool, ...]:
    """An object's public methods as tools, with the JSON schemas `transformers.utils.get_json_schema` reads from
    their type hints and Google-style docstrings (what TRL's GRPOTrainer reads)."""
    from transformers.utils import get_json_schema

    tools = []
    for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction):
        if name.startswith("_") or name in skip:
            continue
        method = getattr(instance, name)
        fn = get_json_schema(method)["function"]
        tools.append(Tool(name, fn.get("description", ""), fn.get("parameters", {"type": "object", "properties": {}}),
                          lambda _m=method, **kw: _m(**kw)))
    return tuple(tools)


@dataclass
class TrlEnv(RowProblems):
    """`factory()` makes one environment instance per episode, as TRL's `environment_factory` does."""
    factory: Callable[[], Any]
    rows: Sequence[dict[str, Any]]
    name: str = "trl"
    test_size: int | None = None
    limits: EpisodeLimits = EpisodeLimits()
    instructions: str = ""
    tools: tuple[Tool, ...] = field(init=False)

    def __post_init__(self):
        self._rows_to_problems(self.rows)
        probe = self.factory()
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"{self.name}: an environment_factory instance must define a callable `reset`")
        self.tools = method_tools(probe)

    def episode(self, problem: Problem) -> _TrlEpisode:
        return _TrlEpisode(self, problem, self.factory())

    def reference_episode(self, problem: Problem) -> list[Message]:
        raise NotImplementedError(f"{self.name}: a TRL environment has no reference episodes; bootstrap from a "
                                  "dataset (`coevo import`) instead")


@dataclass
class _TrlEpisode:
    env: TrlEnv
    problem: Problem
    instance: Any

    def reset(self) -> list[Message]:
        row = {k: v for k, v in self.problem.meta["row"].items() if k != "environment"}
        extra = self.instance.reset(**row)
        self.tools = {t.name: t for t in method_tools(self.instance)}
        user = self.problem.prompt + (f"\n\n{extra}" if isinstance(extra, str) and extra else "")
        return [{"role": "system", "content": toolcalls.system_prompt(self.env.tools, self.env.instructions)},
                {"role": "user", "content": user}]

    def step(self, action) -> StepResult:
        if action.tool_calls or action.parse_error:
            return call_tools(self.tools, action, self.env.limits.max_observation_chars)
        get_reward = getattr(self.instance, "get_reward", None)
        return StepResult([], float(get_reward()) if callable(get_reward) else 0.0, True, {})


@dataclass
class SkyrlEnv(RowProblems):
    """`env_cls(env_config, extras=row)` per episode, as skyrl-gym makes them; the env parses the raw text."""
    env_cls: type
    rows: Sequence[dict[str, Any]]
    name: str = "skyrl"
    test_size: int | None = None
    env_config: Any = None
    limits: EpisodeLimits = EpisodeLimits()
    tools: tuple[Tool, ...] = ()

    def __post_init__(self):
        self._rows_to_problems(self.rows)

    def episode(self, problem: Problem) -> _SkyrlEpisode:
        return _SkyrlEpisode(self, problem)

    def reference_episode(self, problem: Problem) -> list[Message]:
        raise NotImplementedError(f"{self.name}: a skyrl-gym environment has no reference episodes")


@dataclass
class _SkyrlEpisode:
    env: SkyrlEnv
    problem: Problem

    def reset(self) -> list[Message]:
        row = self.problem.meta["row"]
        self.instance = self.env.env_cls(self.env.env_config, extras=row)
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        messages, _ = self.instance.init(prompt)
        return list(messages)

    def step(self, action) -> StepResult:
        out = self.instance.step(action.text)
        return StepResult(list(out.get("observations") or []), out.get("reward"), bool(out.get("done")),
                          dict(out.get("metadata") or {}))
