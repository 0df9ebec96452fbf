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

    right = EpisodeRecord.right  # it answered, and the environment scored the answer right


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
        return self.episode(tree.prompt, [(tree.prompt, tree.prefix(n.node_id)) for n in path], rollout)

    def path(self, key: Key) -> list[Key]:
        """The keys from the root's first turn down to `key`, whose state knows its steps."""
        steps, prefix, out = self.states[key].steps, "", []
        for step in steps:
            prefix += step + "\n"
            out.append((key[0], prefix))
        if out[-1] != key:
            raise ValueError(f"EpisodeSearch.path: {key[1]!r} is not its own steps' transcript")
        return out

    def episode(self, prompt: str, keys: list[Key], rollout: EpisodeRecord | None = None) -> EpisodeRecord:
        """The episode along `keys` (a path of turns from the root, as `path` gives), completed by `rollout` where
        one went on from its last."""
        turns = list(self.opening[prompt])
        for key in keys:
            turns += self.states[key].turns
        end = self.states[keys[-1]]  # the root is never an episode: a node at depth >= 1
        if rollout is not None:
            turns += rollout.turns[len(end.messages):]  # the rollout's own, after the node's replayed conversation
            messages, status, reward, error = rollout.messages, rollout.status, rollout.reward, rollout.error
        else:
            messages, status, reward, error = end.messages, end.status, end.reward, end.error
        turns = [replace(t, turn_index=i) for i, t in enumerate(turns)]
        return EpisodeRecord(self.problems[prompt], list(messages), turns, reward, status, error)


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


class EpisodeSearches:
    """`curves.compute_curve`'s searches over an environment's turns, fresh per budget (`at(k)`): a node is a turn
    (`EpisodeSearch.expand`, `evaluate.search.expansions` draws), valued by the round's PRM as the score stage
    reads an episode, never by the environment's verdict. `finish` runs each best episode that did not end on to
    its end greedily, then takes the environment's verdict, as verify would.

    `sampler(temperature, seed)` makes the agent loop's policy (`stages.base.agent_sampler`): at `temperature` for
    the draws, with each budget's own seed, and greedy to finish."""

    def __init__(self, env: Any, sampler: Callable[[float, int], Callable[[list[list[Message]]], list[tuple]]],
                 problems: list[Problem], score_steps: Callable[[list[str], list[list[str]]], list[list[float]]], *,
                 temperature: float, seed: int):
        self.env, self.sampler, self.problems, self.score_steps = env, sampler, problems, score_steps
        self.temperature, self.seed = temperature, seed

    def at(self, k: int) -> EpisodeSearches:
        from components.seeding import seed_stream

        self._seed = seed_stream(self.seed, 1000 + k)
        self.search = EpisodeSearch(self.env, self.sampler(self.temperature, self._seed), self.problems, 1,
                                    self.score_steps)
        self.expand, self.value = self.search.expand, self.search.value
        return self

    def finish(self, keys: list[Key], ended: list[bool]) -> tuple[list[bool], int]:
        """Whether each (prompt, prefix)'s episode answered right, run on greedily where it had not ended; and the
        tokens that took."""
        states, todo = self.search.states, [i for i, e in enumerate(ended) if not e]
        right = [e and key in states and states[key].right for key, e in zip(keys, ended)]
        if not todo:
            return right, 0
        runner = EpisodeRunner(self.sampler(0.0, self._seed + 1), toolcalls.parse, self.env.limits)
        problems = [self.search.problems[keys[i][0]] for i in todo]
        bases = [states[keys[i]].messages if keys[i] in states else None for i in todo]
        records = runner.run([(p, self.env.episode(p)) for p in problems], prefixes=bases)
        spent = 0
        for i, base, rec in zip(todo, bases, records, strict=True):
            right[i] = rec.right
            new = rec.turns[len(base):] if base is not None else rec.turns
            spent += sum(t.num_tokens or 0 for t in new if t.role == "assistant")
        return right, spent


@dataclass
class _Slot:
    """One episode of `prm_turn_search`: where it stands (its key, None before its first turn) and whether it ended."""
    prompt: str
    key: Key | None = None
    done: bool = False


def prm_turn_search(env: Any, generate: Callable[[list[list[Message]]], list[tuple]], problems: list[Problem],
                    score_steps: Callable[[list[str], list[list[str]]], list[list[float]]], *, n: int, max_tries: int,
                    threshold: float, max_steps: int = 32,
                    redraw: Callable[[list[list[Message]]], list[tuple]] | None = None,
                    ) -> tuple[list[EpisodeRecord], dict[str, float]]:
    """`generate.search` on an environment: `n` episodes per problem, each turn drawn until the PRM accepts it, as
    `step_search.prm_step_search` draws a text's steps. A turn is an assistant turn with what the environment
    answered (`EpisodeSearch.expand`, one draw); the PRM scores it after the turns before it, with the user message
    as the prompt, as the score stage reads an episode. A turn it scores below `threshold` is drawn again (by
    `redraw`, a hotter sampler, where given), up to `max_tries`, and the best-scored draw is kept
    (`accepted_below_threshold` where none reached it). An episode still open after `max_steps` turns runs on to its
    end unguided. Every draw of every live episode steps in one batch per try.

    Returns the episodes, problem by problem, and the search's counts: turns, draws, redraws, turns kept below the
    threshold, and tokens generated and discarded (the rejected draws')."""
    if max_tries < 1:
        raise ValueError(f"prm_turn_search: max_tries must be >= 1, got {max_tries}")
    search = EpisodeSearch(env, generate, problems, 1, score_steps)
    first = search.runner
    again = EpisodeRunner(redraw, toolcalls.parse, env.limits) if redraw is not None else first
    slots = [_Slot(p.prompt) for p in problems for _ in range(n)]
    stats = {"steps": 0, "draws": 0, "redraws": 0, "accepted_below_threshold": 0, "generated_tokens": 0,
             "discarded_tokens": 0}
    for _ in range(max_steps):
        pending = [s for s in slots if not s.done]
        if not pending:
            break
        best: dict[int, tuple[float, Candidate, Key]] = {}  # id(slot) -> its best draw so far
        for attempt in range(max_tries):
            search.runner = first if attempt == 0 else again
            drawn = search.expand([s.key or (s.prompt, "") for s in pending], 1)
            got = [(s, c[0], (s.prompt, (s.key or (s.prompt, ""))[1] + c[0].text)) for s, c in zip(pending, drawn)
                   if c]
            for s, c in zip(pending, drawn):
                if not c:  # the context was full, or the environment failed: the episode ends where it stood
                    s.done = True
            values = search.value([key for _, _, key in got])[0] if got else []
            stats["draws"] += len(got)
            stats["redraws"] += len(got) if attempt else 0
            for (s, c, key), v in zip(got, values):
                stats["generated_tokens"] += c.tokens
                held = best.get(id(s))
                if held is None or v > held[0]:
                    stats["discarded_tokens"] += held[1].tokens if held else 0
                    best[id(s)] = (v, c, key)
                else:
                    stats["discarded_tokens"] += c.tokens
            pending = [s for s, _, _ in got if best[id(s)][0] < threshold]
            if not pending:
                break
        stats["accepted_below_threshold"] += len(pending)
        for s in slots:
            if id(s) in best:
                _, c, s.key = best[id(s)]
                s.done = c.terminal
                stats["steps"] += 1
    search.runner = first
    # An episode still open runs on unguided; one that never drew a turn (its context was full, or the environment
    # failed to start) runs as a fresh episode, and ends as the loop ends it.
    open_ = [s for s in slots if s.key is None or search.states[s.key].status == "open"]
    runs = search._run([s.key or (s.prompt, "") for s in open_], 1, None) if open_ else []
    finished = dict(zip(map(id, open_), runs))
    records = []
    for s in slots:
        rollout = finished.get(id(s))
        base = len(search.states[s.key].messages) if s.key is not None else 0
        if rollout is not None:
            stats["generated_tokens"] += sum(t.num_tokens or 0 for t in rollout.turns[base:] if t.role == "assistant")
        records.append(rollout if s.key is None else search.episode(s.prompt, search.path(s.key), rollout))
    return records, stats


def _turn(row: dict[str, Any]) -> Turn:
    """A `turns` row as the loop's Turn."""
    ids = row.get("token_ids")
    return Turn(row["turn_index"], row["role"], row["content"], row.get("tool_name"), row.get("tool_arguments"),
                row.get("tool_ok"), row.get("error"), row.get("reward"), row.get("num_tokens"),
                row.get("finish_reason"), row.get("latency_s"), bool(row.get("truncated")),
                list(ids) if ids else None)


def grow_episode_trees(env: Any, generate: Callable[[list[list[Message]]], list[tuple]], problems: dict[str, Problem],
                       trajectories: list[dict[str, Any]], turns: list[dict[str, Any]],
                       correct: dict[str, bool | None], section: Any, *,
                       score_steps: Callable[[list[str], list[list[str]]], list[list[float]]] | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       ) -> tuple[list[Problem], list[Tree], dict[str, tuple[Problem, int]], dict[str, float]]:
    """`score.tree.search` on an environment: one tree over turns per prompt, seeded with the round's episodes of it
    in trajectory id order, each a path of its turns (a node: an assistant turn with what the environment
    answered, as `episode_mcts` makes them) ending at a terminal leaf with the environment's verdict backed up
    once, then searched with `generate` for the `section`'s simulations and budget (score.tree.search; its token
    budget is per tree). A seeded node resumes from the stored conversation, its sampled ids kept, the environment
    replayed to it. Values come from the section's `rollouts` episodes run to their end, or from `score_steps` (a
    PRM's). `problems` maps problem id to Problem.

    Returns the trees' problems (a prompt's lowest problem id), the trees, where each episode ended (trajectory id
    -> its problem and the node id of its leaf), and the counts: trees, seeded nodes, tokens generated, nodes."""
    from components.envs.rollout import conversations

    lowest = sorted(problems.values(), key=lambda p: p.problem_id, reverse=True)  # a prompt's lowest id last: kept
    search = EpisodeSearch(env, generate, list({p.prompt: p for p in lowest}.values()), section.rollouts,
                           score_steps)
    chats = conversations(turns)
    by_tid: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(turns, key=lambda r: (r["trajectory_id"], r["turn_index"])):
        by_tid.setdefault(row["trajectory_id"], []).append(row)
    owner: dict[str, Problem] = {}  # prompt -> the problem its tree is filed under: the lowest id of that prompt
    trees: dict[str, Tree] = {}
    leaf_of: dict[str, tuple[str, int]] = {}
    for t in sorted(trajectories, key=lambda t: t["trajectory_id"]):
        rows = by_tid.get(t["trajectory_id"], [])
        starts = [i for i, r in enumerate(rows) if r["role"] == "assistant"]
        if not starts:
            continue
        p = problems[t["problem_id"]]
        if p.prompt not in owner or p.problem_id < owner[p.prompt].problem_id:
            owner[p.prompt] = p
        search.opening.setdefault(p.prompt, [_turn(r) for r in rows[:starts[0]]])
        reward = 1.0 if correct.get(t["trajectory_id"]) is True else 0.0
        prefix, steps, texts = "", [], []
        for j, a in enumerate(starts):
            end = starts[j + 1] if j + 1 < len(starts) else len(rows)
            group = [_turn(r) for r in rows[a:end]]
            text = turn_text(group)
            prefix, last = prefix + text, j == len(starts) - 1
            steps.append(text.removesuffix("\n"))
            texts.append(text)
            search.states.setdefault((p.prompt, prefix), _State(
                chats[t["trajectory_id"]][:end], group, list(steps), "done" if last else "open",
                reward if last else 0.0))
        tree = trees.setdefault(p.prompt, Tree(p.prompt))
        leaf_of[t["trajectory_id"]] = (p.prompt, tree.seed(texts, reward).node_id)
    prompts = sorted(trees)
    if not prompts:
        return [], [], {}, {"trees": 0, "seeded": 0, "generated_tokens": 0, "nodes": 0}
    seeded = sum(len(trees[q].nodes) - 1 for q in prompts)
    grown, spent = mcts_search(prompts, search.expand, search.value, search.reward,
                               MCTSConfig.of(section, len(prompts)), progress, [trees[q] for q in prompts])
    counts = {"trees": len(grown), "seeded": seeded, "generated_tokens": spent,
              "nodes": sum(len(t.nodes) for t in grown), "replay_mismatches": search.replay_mismatches}
    return ([owner[q] for q in prompts], grown, {tid: (owner[q], nid) for tid, (q, nid) in leaf_of.items()},
            counts)
