"""Monte Carlo turn labels for agent episodes: Math-Shepherd's step values, where a step is an assistant turn.

    items = [{"trajectory_id": "t1", "problem": problem, "messages": conversations(turns)["t1"], "correct": False}]
    rows, stats = mc_turn_labels(env, sampler, items, k=4)

An episode's assistant turn i is valued by going on from it k times: the conversation up to the next assistant
turn (turn i's observations included) is resumed with the policy, the environment replayed to where it stood
(`EpisodeRunner.run(..., prefixes=...)`), and each continuation runs to its end under the environment's
limits. The soft label is the share of continuations the environment scores right, the hard label whether any
is. The last assistant turn is labelled by the episode's own verification: nothing is left to go on with
(`labeling.mc_step_labels` does the same for text). Identical prefixes, as when episodes of one problem open
with the same tool call, are rolled out once and share their label. Rows are `step_labels` rows, `step_index`
the assistant turn's place among the episode's assistant turns (its `steps` row).

`mc_first_error_turn_labels` (`score.mc_strategy: first_error`) finds a wrong episode's first dead turn by binary
search over its turns, as `labeling.mc_first_error_labels` does over a text's steps: hard labels only.

An environment that rewards turns itself (`StepResult.reward`, as skyrl-gym's do) needs no rollouts:
`env_turn_rewards` reads them back from the stored turns.
"""

from __future__ import annotations

from typing import Any

from components.envs import toolcalls
from components.envs.base import EpisodeRunner, Message
from components.labeling import bisect_first_dead, mc_rows, mc_value


def _key(problem_id: str, messages: list[Message]) -> tuple:
    return (problem_id, *((m["role"], m["content"]) for m in messages))


def turn_prefixes(messages: list[Message]) -> list[list[Message]]:
    """The conversation after each assistant turn but the last, up to the next one: what going on from it sees.

    >>> chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
    ...         {"role": "tool", "content": "o"}, {"role": "assistant", "content": "b"}]
    >>> [[m["content"] for m in p] for p in turn_prefixes(chat)]
    [['q', 'a', 'o']]
    """
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [messages[:nxt] for nxt in starts[1:]]


def mc_turn_labels(env: Any, generate: Any, items: list[dict[str, Any]], k: int,
                   ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """`mc_soft` and `mc_hard` rows for every assistant turn of every item, and the rollouts' stats.

    `generate` is the agent loop's policy (a `ChatSampler`, or a scripted one); every continuation of every
    prefix steps in one batch per turn. Items are {"trajectory_id", "problem", "messages" (the stored chat,
    sampled ids on the assistant turns), "correct"}; an item whose outcome is unknown (an episode the
    environment failed) or that has no assistant turn gets no labels."""
    items = _labelled(items, k, "mc_turn_labels")
    slots: dict[tuple, tuple[Any, list[Message]]] = {}
    for it in items:
        for prefix in turn_prefixes(it["messages"]):
            slots.setdefault(_key(it["problem"].problem_id, prefix), (it["problem"], prefix))
    stats = _stats(items)
    outcomes = _go_on(env, generate, slots, k, stats)
    rows: list[dict[str, Any]] = []
    for it in items:
        prefixes = turn_prefixes(it["messages"])
        for i, prefix in enumerate(prefixes):
            rows += mc_rows(it["trajectory_id"], i, *mc_value(outcomes[_key(it["problem"].problem_id, prefix)]), k)
        final = float(bool(it["correct"]))
        rows += mc_rows(it["trajectory_id"], len(prefixes), final, final, 0)
    return rows, stats


def mc_first_error_turn_labels(env: Any, generate: Any, items: list[dict[str, Any]], k: int,
                               ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """`mc_hard` rows for every assistant turn, from rollouts at O(log n) turns of the wrong episodes only.

    A right episode is itself a successful continuation of each of its turns: every turn is 1, with no rollout.
    Along a wrong one a turn from which no continuation succeeds stays dead as turns are added, so its first dead
    turn is found by binary search (OmegaPRM): each level goes on k times from the middle turn of every wrong
    episode still open, all of them in one batch per turn. The turns before the first dead one are 1, it and the
    rest 0, the last (the episode's own outcome) known without rollout. As for text, a wrong episode whose
    `root_alive` is False (no episode of its problem was right this round) is not searched: only its last turn
    is labelled, 0. Rows carry k where their turn was rolled out, else 0."""
    items = _labelled(items, k, "mc_first_error_turn_labels")
    prefixes = {it["trajectory_id"]: turn_prefixes(it["messages"]) for it in items}
    dead_root = {it["trajectory_id"] for it in items if not it["correct"] and not it.get("root_alive", True)}
    # bounds: the first dead turn lies in [lo, hi]; a wrong episode's last turn is dead.
    bounds = {it["trajectory_id"]: [0, len(prefixes[it["trajectory_id"]])] for it in items
              if not it["correct"] and it["trajectory_id"] not in dead_root}
    by_id = {it["trajectory_id"]: it for it in items}
    known: dict[tuple, bool] = {}  # a turn prefix, by `_key` -> whether any continuation from it succeeded
    stats = _stats(items) | {"dead_root": len(dead_root)}

    def alive(mids: dict[str, int], level: int) -> dict[str, bool]:
        keys = {tid: _key(by_id[tid]["problem"].problem_id, prefixes[tid][m]) for tid, m in mids.items()}
        slots = {key: (by_id[tid]["problem"], prefixes[tid][mids[tid]]) for tid, key in keys.items()
                 if key not in known}
        known.update({key: any(flags) for key, flags in _go_on(env, generate, slots, k, stats).items()})
        return {tid: known[key] for tid, key in keys.items()}

    firsts, rolled, stats["search_levels"] = bisect_first_dead(bounds, alive)
    rows: list[dict[str, Any]] = []
    for it in items:
        tid, n = it["trajectory_id"], len(prefixes[it["trajectory_id"]]) + 1
        if tid in dead_root:
            rows.append({"trajectory_id": tid, "step_index": n - 1, "source": "mc_hard", "value": 0.0,
                         "num_rollouts": 0})
            continue
        first_dead = firsts.get(tid, n)
        rows += [{"trajectory_id": tid, "step_index": i, "source": "mc_hard", "value": float(i < first_dead),
                  "num_rollouts": k if (tid, i) in rolled else 0} for i in range(n)]
    stats["steps"] = len(rows)
    return rows, stats


def _labelled(items: list[dict[str, Any]], k: int, who: str) -> list[dict[str, Any]]:
    """The items that can be labelled: a known outcome (not an episode the environment failed) and a turn."""
    if k < 1:
        raise ValueError(f"{who}: k must be >= 1, got {k}")
    return [it for it in items if it["correct"] is not None and any(m["role"] == "assistant" for m in it["messages"])]


def _stats(items: list[dict[str, Any]]) -> dict[str, float]:
    return {"trajectories": len(items),
            "steps": sum(sum(m["role"] == "assistant" for m in it["messages"]) for it in items),
            "unique_prefixes": 0, "rollouts": 0, "generated_tokens": 0, "replay_mismatches": 0, "rollout_errors": 0}


def _go_on(env: Any, generate: Any, slots: dict[tuple, tuple[Any, list[Message]]], k: int,
           stats: dict[str, float]) -> dict[tuple, list[bool]]:
    """Each slot's (problem, conversation so far) resumed k times, every continuation in one batch per turn: which
    reached the right answer. Adds the rollouts to `stats`."""
    order = list(slots)
    runs = [slots[key] for key in order for _ in range(k)]
    if not runs:
        return {}
    records = EpisodeRunner(generate, toolcalls.parse, env.limits).run(
        [(problem, env.episode(problem)) for problem, _ in runs], prefixes=[prefix for _, prefix in runs])
    outcomes: dict[tuple, list[bool]] = {key: [] for key in order}
    for (problem, prefix), rec in zip(runs, records, strict=True):
        outcomes[_key(problem.problem_id, prefix)].append(rec.right)
    stats["unique_prefixes"] += len(order)
    stats["rollouts"] += len(runs)
    # a resumed episode's stored turns carry no token count: these are the continuations' own
    stats["generated_tokens"] += sum(t.num_tokens or 0 for rec in records for t in rec.turns if t.role == "assistant")
    stats["replay_mismatches"] += sum(rec.replay_mismatch for rec in records)
    stats["rollout_errors"] += sum(rec.status == "error" for rec in records)
    return outcomes


def env_turn_rewards(turns: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each episode's own turn rewards (`score.reward_model: env`): what the environment gave each assistant turn
    (`StepResult.reward`, stored in `turns.reward` on the turn that earned it), in turn order; a turn given none
    scores 0. An episode that ended `done` has its outcome reward on its last turn.

    >>> rows = [{"trajectory_id": "t", "turn_index": i, "role": r, "reward": v}
    ...         for i, (r, v) in enumerate([("system", None), ("user", None), ("assistant", 0.5), ("user", None),
    ...                                     ("assistant", None), ("assistant", 1.0)])]
    >>> env_turn_rewards(rows)
    {'t': [0.5, 0.0, 1.0]}
    """
    out: dict[str, list[float]] = {}
    for r in sorted(turns, key=lambda r: (r["trajectory_id"], r["turn_index"])):
        if r["role"] == "assistant":
            out.setdefault(r["trajectory_id"], []).append(0.0 if r["reward"] is None else float(r["reward"]))
    return out


def env_score_rows(trajectories: list[dict[str, Any]], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`scores` rows (scorer `env`) of the episodes' own turn rewards: one per assistant turn, then min/last/mean,
    as a PRM's step scores are written, so the filter and grpo's step credit read them the same way."""
    from components.scoring import step_score_rows

    given = env_turn_rewards(turns)
    tids = [t["trajectory_id"] for t in trajectories]
    return step_score_rows(tids, [given.get(t, []) for t in tids], "env", None)
