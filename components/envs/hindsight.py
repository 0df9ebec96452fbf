"""Hindsight relabeling of episodes: a wrong answer is right for the task it did solve.

A coding agent that writes the asked loop with another constant (`% 6` for "modulo 13") has solved a task the
environment can name: the same template with the constants it wrote. `relabel_episodes` asks the environment for
that task (`env.hindsight(problem, final_turn) -> Problem | None`), replays the episode's assistant turns on it
(the tools run again, so each observation is what that task's environment says), and keeps the replay where the
environment scores it right. A held-out task is never a relabel's goal. What the policy then trains on is its own
turns, under a prompt that asks for what they do: the constants of the prompt and of the program agree, on values
no demonstration carried (Andrychowicz et al. 2017, "Hindsight Experience Replay"; for instructions, Zhang et al.
2023, "The Wisdom of Hindsight Makes Language Models Better Instruction Followers").

A right answer can be posed again the same way (filter.variants): `env.variants(problem, turns, n, rng)` draws the
task's constants anew and writes the answer's program with them in its turns, and the replay keeps each variant the
environment scores right. Its prompt's numbers and its program's agree on values the policy did not pick.

    batch, sources = relabel_episodes(env, wrong, problems, chats, experiment="e", round=1)
    batch, sources = vary_episodes(env, right, problems, chats, 4, seed, experiment="e", round=1)
    batch.tables      # problems, trajectories (purpose 'hindsight', 'variant'), steps, turns, verifications
    sources           # relabeled or variant trajectory id -> the episode it came from
"""

from __future__ import annotations

import random
from typing import Any, Callable

from components.envs import toolcalls
from components.envs.base import EpisodeRecord, EpisodeRunner, Message
from components.envs.rollout import EpisodeBatch, conversations
from components.generation import problem_from_row

PURPOSE = "hindsight"
VARIANT = "variant"  # filter.variants: a right episode posed again with other constants


def replay(env: Any, problem: Any, messages: list[Message]) -> EpisodeRecord:
    """`messages`' assistant turns, in order, as the policy of a fresh episode of `problem`: the environment answers
    each as it answers that problem. An episode the turns do not finish ends as `truncated_context`."""
    turns = iter([m for m in messages if m["role"] == "assistant"])

    def scripted(conversations: list[list[Message]]) -> list[tuple[Any, ...]]:
        m = next(turns, None)
        if m is None:
            return [("", 0, "context")]
        ids = m.get("token_ids")
        return [(m["content"], len(ids) if ids else 0, "stop", ids)] if ids else [(m["content"], 0, "stop")]

    [rec] = EpisodeRunner(scripted, toolcalls.parse, env.limits).run([(problem, env.episode(problem))])
    return rec


def relabel_episodes(env: Any, trajectories: list[dict[str, Any]], problems: list[dict[str, Any]],
                     chats: dict[str, list[Message]], *, experiment: str, round: int,
                     ) -> tuple[EpisodeBatch, dict[str, str]]:
    """The episodes of `trajectories` (wrong, answered) that are right for the task their answer solved, relabeled
    and replayed: their rows (purpose 'hindsight', verified by the replay's outcome), and each one's source
    trajectory. A relabeled task of the held-out set, or a replay the environment does not score right, is left out;
    two sources that relabel to one task keep both, as samples 0, 1, ..."""
    def goals(t: dict[str, Any], problem: Any, messages: list[Message]) -> list[tuple[Any, list[Message]]]:
        goal = env.hindsight(problem, messages[-1]["content"])
        return [] if goal is None else [(goal, messages)]

    return _replayed(env, trajectories, problems, chats, goals, purpose=PURPOSE, experiment=experiment, round=round)


def vary_episodes(env: Any, trajectories: list[dict[str, Any]], problems: list[dict[str, Any]],
                  chats: dict[str, list[Message]], n: int, seed: int, *, experiment: str, round: int,
                  ) -> tuple[EpisodeBatch, dict[str, str]]:
    """Up to `n` variants of each of `trajectories` (right, answered): the environment poses its task again with
    other constants and writes its assistant turns with them (`env.variants`), and they are replayed on that task,
    the tools run again, and kept where the environment scores the replay right (purpose 'variant'). The prompt's
    numbers and the program's then agree on values the policy did not pick, which a relabel's cannot: its goal
    holds the constants the policy wrote. Seeded by `seed` and each source's id, so a rerun draws the same."""
    def goals(t: dict[str, Any], problem: Any, messages: list[Message]) -> list[tuple[Any, list[Message]]]:
        rng = random.Random(f"{seed}|{t['trajectory_id']}")
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        return [(goal, [{"role": "assistant", "content": text} for text in texts])
                for goal, texts in env.variants(problem, turns, n, rng)]

    return _replayed(env, trajectories, problems, chats, goals, purpose=VARIANT, experiment=experiment, round=round)


def longer_than(tables: dict[str, list[dict[str, Any]]], encoder: Any, limit: int) -> set[str]:
    """The episodes of `tables` (their stored turns) that take more than `limit` tokens as `encoder`, the policy's
    `ChatEncoder`, encodes them for SFT. A replay's observations are its new task's, and can outgrow its source's,
    which the sampler kept within the model's context."""
    return {tid for tid, messages in conversations(tables.get("turns", [])).items()
            if len(encoder.encode(messages, add_generation_prompt=False)[0]) > limit}


def _replayed(env: Any, trajectories: list[dict[str, Any]], problems: list[dict[str, Any]],
              chats: dict[str, list[Message]],
              goals: Callable[[dict[str, Any], Any, list[Message]], list[tuple[Any, list[Message]]]], *,
              purpose: str, experiment: str, round: int) -> tuple[EpisodeBatch, dict[str, str]]:
    """For each of `trajectories` with a finished chat, the (task, assistant turns) pairs `goals` names, replayed:
    the rows of each replay the environment scores right on a task outside the held-out set, and its source."""
    by_id = {p["problem_id"]: problem_from_row(p) for p in problems}
    held_out: dict[int, set[str]] = {}
    batch, sources, count = EpisodeBatch(), {}, {}
    for t in sorted(trajectories, key=lambda t: t["trajectory_id"]):
        messages = chats.get(t["trajectory_id"])
        if not messages or messages[-1]["role"] != "assistant":
            continue
        for goal, turns in goals(t, by_id[t["problem_id"]], messages):
            if goal.level not in held_out:
                held_out[goal.level] = {p.problem_id for p in env.test_set(goal.level)}
            if goal.problem_id in held_out[goal.level]:
                continue
            rec = replay(env, goal, turns)
            if not rec.right:
                continue
            k = count.get(goal.problem_id, 0)
            count[goal.problem_id] = k + 1
            tid = batch.add_episode(env, rec, k, experiment=experiment, round=round, purpose=purpose,
                                    policy_model_id=t["policy_model_id"], temperature=t["temperature"],
                                    top_p=t["top_p"], max_new_tokens=t["max_new_tokens"], seed=t["seed"])
            sources[tid] = t["trajectory_id"]
    return batch, sources
