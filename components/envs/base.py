"""The environment protocol: problems in levels, and episodes in which an agent acts over several turns.

An environment is a `Domain` (problems, levels, a held-out set per level) that also makes episodes:

    env = get_env("calculator")
    problem = env.sample_problems(level=2, n=1, seed=0)[0]
    episode = env.episode(problem)
    messages = episode.reset()                 # the first observation: system and user messages
    result = episode.step(action)              # an assistant turn -> observations, reward, done, info

An `Action` is one assistant turn as the model wrote it, with its tool calls parsed by the chat format
(`components.envs.toolcalls`). A tool call the format cannot parse, or one naming an unknown tool or wrong
arguments, is answered with an error observation the agent sees; it never raises. The outcome reward comes
with `done`; a turn may carry a reward of its own (`StepResult.reward`, None where it has none).

`EpisodeLimits` caps turns and wall time: `run_episode` and the batched loop end an episode that reaches
either, as `truncated`, with the outcome reward the environment gives an unfinished episode (0).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from components.domains.base import Problem

Message = dict[str, Any]  # {"role": system|user|assistant|tool, "content": str, "name"?: tool name}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Action:
    """One assistant turn: the text as generated, the tool calls parsed from it, and what made a call malformed."""
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str | None = None  # a call the format could not read (bad JSON, no name): the agent is told


@dataclass
class StepResult:
    observations: list[Message]  # tool results (role tool) or feedback (role user); empty when done
    reward: float | None  # this turn's own reward; at `done`, the episode's outcome reward
    done: bool
    info: dict[str, Any] = field(default_factory=dict)  # per tool call: name, ok, error, latency_s, truncated


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # assistant turns
    # The episode's own time: its environment's, and its share of each batched generation. Not the time since it
    # started, which grows with every episode batched beside it and with the machine's load: a busy machine would cut
    # other episodes than an idle one from the same seed.
    max_wall_s: float = 60.0
    max_observation_chars: int = 2000  # a longer observation is cut, and the cut counted

    def __post_init__(self):
        if self.max_turns < 1 or self.max_wall_s <= 0 or self.max_observation_chars < 1:
            raise ValueError(f"episode limits must be positive: {self}")


@dataclass(frozen=True)
class Tool:
    """A tool the agent may call: its JSON schema (OpenAI function format) and the function that runs it."""
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    run: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


class Episode(Protocol):
    def reset(self) -> list[Message]:
        ...

    def step(self, action: Action) -> StepResult:
        ...


@runtime_checkable
class Environment(Protocol):
    """A `Domain` whose problems are solved by acting: `episode(problem)` makes a fresh episode, and
    `reference_episode(problem)` the gold one that round 0 bootstraps from (tool calls and observations included)."""
    name: str
    tools: tuple[Tool, ...]

    def levels(self) -> list[int]:
        ...

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        ...

    def test_set(self, level: int) -> list[Problem]:
        ...

    def episode(self, problem: Problem) -> Episode:
        ...

    def reference_episode(self, problem: Problem) -> list[Message]:
        ...


def call_tools(tools: Mapping[str, Tool], action: Action, max_chars: int) -> StepResult:
    """Run an action's tool calls: the turn's result, not done, with one observation per call (an error
    observation for a malformed or failing call) and one info record each (`info["tool_calls"]`)."""
    observations, infos = [], []
    if action.parse_error is not None:
        observations.append({"role": "tool", "name": "invalid", "content": f"error: {action.parse_error}"})
        infos.append({"tool": "invalid", "ok": False, "error": action.parse_error, "latency_s": 0.0,
                      "truncated": False, "arguments": None})
    for call in action.tool_calls:
        t0 = time.perf_counter()
        tool = tools.get(call.name)
        error = None
        if tool is None:
            error = f"unknown tool {call.name!r}; the tools are {sorted(tools)}"
        else:
            error = check_arguments(tool, call.arguments)
        if error is None:
            try:
                out = tool.run(**call.arguments)
            except Exception as e:  # a tool's own failure is the agent's observation, not the stage's
                error = f"{type(e).__name__}: {e}"
        content = f"error: {error}" if error is not None else str(out)
        content, cut = truncate(content, max_chars)
        observations.append({"role": "tool", "name": call.name, "content": content})
        infos.append({"tool": call.name, "ok": error is None, "error": error, "truncated": cut,
                      "latency_s": time.perf_counter() - t0, "arguments": json.dumps(call.arguments, sort_keys=True)})
    return StepResult(observations, None, False, {"tool_calls": infos})


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with `arguments` for `tool` (missing, unknown or mistyped), or None."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    unknown = [k for k in arguments if k not in props]
    if missing or unknown:
        return (f"{tool.name} takes {sorted(props)}" + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else ""))
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    for k, v in arguments.items():
        want = props[k].get("type")
        if want in types and not isinstance(v, types[want]):
            return f"{tool.name}: argument {k!r} must be a {want}, got {type(v).__name__}"
    return None


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"\n[cut: {len(text) - max_chars} more characters]", True


@dataclass
class Turn:
    """One row of the `turns` table, before it has its trajectory id."""
    turn_index: int
    role: str  # assistant | tool | user | system
    content: str
    tool_name: str | None = None
    tool_arguments: str | None = None  # JSON
    ok: bool | None = None  # a tool call's outcome
    error: str | None = None
    reward: float | None = None
    num_tokens: int | None = None
    finish_reason: str | None = None
    latency_s: float | None = None
    truncated: bool = False
    token_ids: list[int] | None = None  # an assistant turn's ids as sampled (turn end included)


@dataclass
class EpisodeRecord:
    """A finished episode: its messages, turns, outcome reward and how it ended."""
    problem: Problem
    messages: list[Message]
    turns: list[Turn]
    reward: float
    status: str  # done | truncated_turns | truncated_time | truncated_context | error | open (max_new_turns)
    error: str | None = None  # the traceback, where the environment raised
    env_s: float = 0.0  # wall time inside the environment
    gen_s: float = 0.0  # wall time generating
    replay_mismatch: bool = False  # resumed from a stored prefix that the environment answered otherwise
    replay_done: bool = False  # ... and that the environment ended while it was replayed

    @property
    def right(self) -> bool:
        """It answered, and the environment scored the answer right."""
        return self.status == "done" and self.reward >= 1.0


class EpisodeRunner:
    """Drives many episodes at once: every live episode's next assistant turn is generated in one batch.

    `generate(conversations) -> [(text, num_tokens, finish_reason[, token_ids])]` is the policy: a scripted one,
    or `components.envs.agent.ChatSampler` on hf, vLLM or openai, which also returns the sampled ids (kept on the
    assistant message, so the next turn's prompt extends them). A finish_reason of "context" means the
    conversation no longer fits the model: the episode ends as `truncated_context`. `parse(text) -> Action` is
    the chat format's tool-call parser. An environment that raises ends that episode alone, as `error`, with its
    traceback.

    An episode may resume from a stored conversation (`prefixes`, one per episode or None): after `reset`, its
    assistant turns are replayed into the episode, so the environment stands where it stood, and the loop goes
    on from there. Its turns count against `max_turns`; its wall time starts again. Where the environment
    answers the replay with other observations than the stored ones (an environment that is not
    deterministic), the conversation keeps the stored ones and `replay_mismatch` says so.

    `max_new_turns` stops every episode after that many assistant turns of its own, as status `open`: one turn of
    a tree search's expansion (components/search/episodes.py). The environment's limits still end it first."""

    def __init__(self, generate: Callable[[list[list[Message]]], list[tuple[str, int, str]]],
                 parse: Callable[[str], Action], limits: EpisodeLimits):
        self.generate, self.parse, self.limits = generate, parse, limits

    def run(self, episodes: list[tuple[Problem, Episode]],
            prefixes: list[list[Message] | None] | None = None,
            max_new_turns: int | None = None) -> list[EpisodeRecord]:
        records: list[EpisodeRecord] = []
        live: list[tuple[EpisodeRecord, Episode]] = []
        new_turns: dict[int, int] = {}  # id(record) -> assistant turns generated in this run
        for k, (problem, ep) in enumerate(episodes):
            rec = EpisodeRecord(problem, [], [], 0.0, "done")
            t0 = time.perf_counter()
            try:
                rec.messages = list(ep.reset())
                prefix = prefixes[k] if prefixes is not None else None
                if prefix is not None:
                    self._replay(rec, ep, prefix)
                rec.turns = [Turn(i, m["role"], m["content"]) for i, m in enumerate(rec.messages)]
            except Exception:
                rec.status, rec.error = "error", traceback.format_exc()
            rec.env_s += time.perf_counter() - t0
            records.append(rec)
            if rec.status == "done" and _assistant_turns(rec) >= self.limits.max_turns:
                rec.status = "truncated_turns"
            if rec.status == "done" and not rec.replay_done:
                live.append((rec, ep))
        while live:
            t0 = time.perf_counter()
            outs = self.generate([rec.messages for rec, _ in live])
            gen = (time.perf_counter() - t0) / len(live)
            still = []
            for (rec, ep), (text, ntok, finish, *ids) in zip(live, outs, strict=True):
                rec.gen_s += gen
                if finish == "context":
                    rec.status = "truncated_context"
                    continue
                msg: Message = {"role": "assistant", "content": text}
                if ids:
                    msg["token_ids"] = list(ids[0])
                rec.messages.append(msg)
                new_turns[id(rec)] = new_turns.get(id(rec), 0) + 1
                rec.turns.append(Turn(len(rec.turns), "assistant", text, num_tokens=ntok, finish_reason=finish,
                                      latency_s=gen, token_ids=msg.get("token_ids")))
                t1 = time.perf_counter()
                try:
                    result = ep.step(self.parse(text))
                except Exception:
                    rec.status, rec.error = "error", traceback.format_exc()
                    rec.turns[-1].error = rec.error  # the traceback stays with the turn the environment failed on
                    rec.env_s += time.perf_counter() - t1
                    continue
                rec.env_s += time.perf_counter() - t1
                calls = result.info.get("tool_calls", [])
                for i, obs in enumerate(result.observations):
                    info = calls[i] if i < len(calls) else {}
                    rec.messages.append(obs)
                    rec.turns.append(Turn(len(rec.turns), obs["role"], obs["content"], obs.get("name"),
                                          info.get("arguments"), info.get("ok"), info.get("error"),
                                          latency_s=info.get("latency_s"), truncated=bool(info.get("truncated"))))
                if result.reward is not None:
                    rec.turns[-1 - len(result.observations)].reward = result.reward
                if result.done:
                    rec.reward, rec.status = float(result.reward or 0.0), "done"
                elif _assistant_turns(rec) >= self.limits.max_turns:
                    rec.status = "truncated_turns"
                elif rec.env_s + rec.gen_s > self.limits.max_wall_s:
                    rec.status = "truncated_time"
                elif max_new_turns is not None and new_turns[id(rec)] >= max_new_turns:
                    rec.status = "open"
                else:
                    still.append((rec, ep))
            live = still
        return records

    def _replay(self, rec: EpisodeRecord, ep: Episode, prefix: list[Message]) -> None:
        """Step `ep` through `prefix`'s assistant turns; `rec.messages` becomes the prefix, as stored."""
        start = rec.messages
        if [(m["role"], m["content"]) for m in prefix[:len(start)]] != [(m["role"], m["content"]) for m in start]:
            rec.replay_mismatch = True
        for k, m in enumerate(prefix):
            if m["role"] != "assistant":
                continue
            result = ep.step(self.parse(m["content"]))
            stored = []
            for later in prefix[k + 1:]:
                if later["role"] == "assistant":
                    break
                stored.append((later["role"], later["content"]))
            if [(o["role"], o["content"]) for o in result.observations] != stored:
                rec.replay_mismatch = True
            if result.done:  # the stored conversation went on, this replay cannot
                rec.reward, rec.replay_done, rec.replay_mismatch = float(result.reward or 0.0), True, True
                break
        rec.messages = [dict(m) for m in prefix]


def _assistant_turns(rec: EpisodeRecord) -> int:
    return sum(m["role"] == "assistant" for m in rec.messages)
