"""MCTS over an agent's turns: the tree search of `mcts`, where a node is one assistant turn with the observations
the environment gave back, and a path from the root is an episode so far.

    trees, records, stats = episode_mcts(env, sampler, problems, MCTSConfig(simulations=8, expansions=4),
                                         rollouts=2, n=4)

`mcts.mcts_search` runs the search unchanged; this module gives it the three callbacks over episodes:

- **expand**: a leaf's episode is resumed K times (`EpisodeRunner.run(..., prefixes=..., max_new_turns=1)`: the
  environment replayed to where the leaf stood), each continuation takes one assistant turn, and the environment
  answers it. Identical turns (the same call and the same observations) are one child whose prior is how many of
  the K drew it. A child is terminal where its episode ended: answered, or cut at a turn, time or context limit.
- **value**: a non-terminal child's episode is resumed `rollouts` times and run to its end; its value is the share
  the environment scores right. Each child keeps its best rollout (a right one first) as a whole episode the
  search has paid for. Or, given a PRM's `score_steps`, its value is the PRM's score of its turn.
- **reward**: a terminal child's outcome, as the environment gave it (0 for an episode cut at a limit).

A node's text is its step as a reward model reads an episode (`rollout.episode_steps`: the assistant turn, then
each observation marked with its role and tool) plus a newline, so a node's prefix is the episode's transcript so
far and the store's `nodes.step_text` shows the turn. The K draws of every leaf of a simulation step in one batch,
every tree's, as the agent loop batches its episodes.

The episodes `episode_mcts` hands back are each tree's best terminal leaves, then, where fewer ended, the
rollouts of its open nodes: each an `EpisodeRecord` whose assistant turns carry the ids they were sampled with and
their own token counts, so the store, the verifier and the trainers read them as any episode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from components.domains.base import Problem
from components.envs import toolcalls
from components.envs.base import EpisodeRecord, EpisodeRunner, Message, Turn
from components.envs.records import observed
from components.search.mcts import Candidate, MCTSConfig, Tree, mcts_search

Key = tuple[str, str]  # (the tree's prompt, the prefix: its nodes' texts joined)


@dataclass
class _State:
    """Where a node's episode stands: its messages (the sampled ids on the assistant's), the turns this node added
    (an assistant turn and its observations, with their counts), and how it ended, where it did."""
    messages: list[Message]
    turns: list[Turn]
    steps: list[str]  # the episode's steps so far, as a reward model reads them (the nodes' texts)
    status: str
    reward: float
    error: str | None = None


def turn_text(turns: list[Turn]) -> str:
    """A node's text: its assistant turn and the observations after it, as `rollout.episode_steps` marks them.

    >>> turn_text([Turn(2, "assistant", "call"), Turn(3, "tool", "4", tool_name="calculate")])
    'call\\n[tool:calculate] 4\\n'
    """
    parts = [t.content if t.role == "assistant" else observed(t.role, t.tool_name, t.content) for t in turns]
    return "\n".join(parts) + "\n"


class EpisodeSearch:
    """The callbacks `mcts_search` calls, over episodes of `env` sampled by `generate` (the agent loop's policy),
    and what they learn: every node's episode state, each problem's opening turns, and each open node's best
    rollout."""

    def __init__(self, env: Any, generate: Callable[[list[list[Message]]], list[tuple]], problems: list[Problem],
                 rollouts: int, score_steps: Callable[[list[str], list[list[str]]], list[list[float]]] | None = None):
        self.env, self.rollouts, self.score_steps = env, rollouts, score_steps
        self.runner = EpisodeRunner(generate, toolcalls.parse, env.limits)
        self.problems = {p.prompt: p for p in problems}
        if len(self.problems) != len(problems):
            raise ValueError("episode_mcts: two problems share a prompt; search each prompt once")
        self.states: dict[Key, _State] = {}
        self.opening: dict[str, list[Turn]] = {}  # prompt -> the turns reset gave (system, user)
        self.completions: dict[Key, EpisodeRecord] = {}  # an open node's best rollout
        self.replay_mismatches = 0
        self.env_s = self.gen_s = 0.0  # wall time in the environment and generating, over every expansion and rollout

    def _run(self, keys: list[Key], repeat: int, max_new_turns: int | None) -> list[EpisodeRecord]:
        runs = [key for key in keys for _ in range(repeat)]
        records = self.runner.run(
            [(self.problems[prompt], self.env.episode(self.problems[prompt])) for prompt, _ in runs],
            prefixes=[self.states[key].messages if key in self.states else None for key in runs],
            max_new_turns=max_new_turns)
        self.replay_mismatches += sum(r.replay_mismatch for r in records)
        self.env_s += sum(r.env_s for r in records)
        self.gen_s += sum(r.gen_s for r in records)
        return records

    def expand(self, pairs: list[Key], k: int) -> list[list[Candidate]]:
        records = self._run(pairs, k, max_new_turns=1)
        out = []
        for i, key in enumerate(pairs):
            drawn: dict[str, list[list[Turn]]] = {}  # a child's text -> the new turns of each draw that gave it
            for rec in records[i * k:(i + 1) * k]:
                # the root's episode starts fresh: the turns before its first assistant turn are the problem's opening
                start = len(self.states[key].messages) if key in self.states else _first_new(rec)
                new = rec.turns[start:]
                if not new:  # the context was full, or the environment failed on reset or replay: nothing drawn
                    if key in self.states:
                        self.states[key].status, self.states[key].error = rec.status, rec.error
                    continue
                if key not in self.states:
                    self.opening.setdefault(key[0], rec.turns[:start])
                text = turn_text(new)
                if text not in drawn:
                    steps = (self.states[key].steps if key in self.states else []) + [text.removesuffix("\n")]
                    self.states[(key[0], key[1] + text)] = _State(
                        rec.messages, new, steps, rec.status, rec.reward if rec.status == "done" else 0.0, rec.error)
                drawn.setdefault(text, []).append(new)
            cands = [Candidate(text, 0.0, sum(t.num_tokens or 0 for new in draws for t in new if t.role == "assistant"),
                               self.states[(key[0], key[1] + text)].status != "open", weight=float(len(draws)))
                     for text, draws in drawn.items()]
            out.append(cands)
        return out

    def value(self, pairs: list[Key]) -> tuple[list[float], int]:
        if self.score_steps is not None:  # a PRM's P(good) of the node's turn, after the turns before it
            users = {p: next(t.content for t in self.opening[p] if t.role == "user") for p, _ in pairs}
            scores = self.score_steps([users[p] for p, _ in pairs], [self.states[key].steps for key in pairs])
            return [min(max(float(sc[-1]), 0.0), 1.0) for sc in scores], 0
        records = self._run(pairs, self.rollouts, max_new_turns=None)
        values, tokens = [], 0
        for i, key in enumerate(pairs):
            done = records[i * self.rollouts:(i + 1) * self.rollouts]
            right = [r.right for r in done]
            values.append(sum(right) / len(done))
            base = len(self.states[key].messages)
            tokens += sum(t.num_tokens or 0 for r in done for t in r.turns[base:] if t.role == "assistant")
            self.completions[key] = done[right.index(True) if any(right) else 0]
        return values, tokens

    def reward(self, pairs: list[Key]) -> list[float]:
        # A root whose episode could not start has no state: nothing was answered.
        return [self.states[key].reward if key in self.states else 0.0 for key in pairs]

    def record(self, tree: Tree, node_id: int, rollout: EpisodeRecord | None = None) -> EpisodeRecord:
        """The episode that ends at `node_id` (or, with `rollout`, that the node's rollout completed): the opening
        turns, then each node's turns along the path, then the rollout's own, reindexed in order."""
        path = tree.path(node_id)[1:]
        keys = [(tree.prompt, tree.prefix(n.node_id)) for n in path]
        turns = list(self.opening[tree.prompt])
        for key in keys:
            turns += self.states[key].turns
        end = self.states[keys[-1]]  # the root is never an episode: a node at depth >= 1
        if rollout is not None:
            turns += rollout.turns[len(end.messages):]  # the rollout's own, after the node's replayed conversation
            messages, status, reward, error = rollout.messages, rollout.status, rollout.reward, rollout.error
        else:
            messages, status, reward, error = end.messages, end.status, end.reward, end.error
        turns = [replace(t, turn_index=i) for i, t in enumerate(turns)]
        return EpisodeRecord(self.problems[tree.prompt], list(messages), turns, reward, status, error)


def _first_new(rec: EpisodeRecord) -> int:
    """Where a fresh episode's own turns start: at its first assistant turn (after the system and user messages)."""
    return next((i for i, t in enumerate(rec.turns) if t.role == "assistant"), len(rec.turns))


def episode_mcts(env: Any, generate: Callable[[list[list[Message]]], list[tuple]], problems: list[Problem],
                 cfg: MCTSConfig, *, rollouts: int, n: int, progress: Callable[[int, int], None] | None = None,
                 score_steps: Callable[[list[str], list[list[str]]], list[list[float]]] | None = None,
                 ) -> tuple[list[Tree], list[list[tuple[int, EpisodeRecord]]], dict[str, float]]:
    """One tree per problem, searched over turns; for each, up to `n` episodes as (node id, record): its best
    terminal leaves (`Tree.returned`), then, where fewer ended, the best rollouts of its open nodes (right ones
    first, then higher Q, then deeper), each completing its node's episode. Returns the trees, the episodes and
    the search's statistics (tokens generated, nodes, solved trees, right leaves, episodes from rollouts, and the
    whole search's wall time in the environment and in generation). With `score_steps` (a PRM's), a node's value
    is the PRM's score of its turn after the turns before it, with the episode's user message as the prompt, as the
    score stage reads an episode: no rollouts."""
    search = EpisodeSearch(env, generate, problems, rollouts, score_steps)
    trees, spent = mcts_search([p.prompt for p in problems], search.expand, search.value, search.reward, cfg,
                               progress)
    picked_all, from_rollouts = [], 0
    for tree in trees:
        # the root is terminal only where no episode could start: it is no episode
        picked = [(x.node_id, search.record(tree, x.node_id)) for x in tree.returned(n) if x.node_id != 0]
        seen = {turn_text(r.turns[len(search.opening[tree.prompt]):]) for _, r in picked}
        open_ = [(x, search.completions.get((tree.prompt, tree.prefix(x.node_id)))) for x in tree.nodes[1:]
                 if not x.terminal]
        rolled = sorted(((x, r) for x, r in open_ if r is not None),
                        key=lambda xr: (-xr[1].right, -(xr[0].q or 0.0),
                                        -xr[0].depth, xr[0].node_id))
        for x, r in rolled:
            if len(picked) >= n:
                break
            rec = search.record(tree, x.node_id, r)
            text = turn_text(rec.turns[len(search.opening[tree.prompt]):])
            if text not in seen:
                seen.add(text)
                picked.append((x.node_id, rec))
                from_rollouts += 1
        picked_all.append(picked)
    stats = {"generated_tokens": spent, "nodes": sum(len(t.nodes) for t in trees),
             "solved": sum(int(t.best_leaf().terminal and t.best_leaf().reward == 1.0) for t in trees),
             "right_leaves": sum(int(x.terminal and x.reward == 1.0) for t in trees for x in t.nodes),
             "from_rollouts": from_rollouts, "replay_mismatches": search.replay_mismatches,
             "env_seconds": search.env_s, "gen_seconds": search.gen_s}
    return trees, picked_all, stats
