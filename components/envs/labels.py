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

An environment that rewards turns itself (`StepResult.reward`, as skyrl-gym's do) needs no rollouts:
`env_turn_rewards` reads them back from the stored turns.
"""

from __future__ import annotations

from typing import Any

from components.envs import toolcalls
from components.envs.base import EpisodeRunner, Message
from components.labeling import mc_rows, mc_value


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
    if k < 1:
        raise ValueError(f"mc_turn_labels: k must be >= 1, got {k}")
    items = [it for it in items if it["correct"] is not None and any(m["role"] == "assistant" for m in it["messages"])]
    slots: dict[tuple, tuple[Any, list[Message]]] = {}
    for it in items:
        for prefix in turn_prefixes(it["messages"]):
            slots.setdefault(_key(it["problem"].problem_id, prefix), (it["problem"], prefix))
    order = list(slots)
    runs = [(slots[key], j) for key in order for j in range(k)]
    records = EpisodeRunner(generate, toolcalls.parse, env.limits).run(
        [(problem, env.episode(problem)) for (problem, _), _ in runs], prefixes=[prefix for (_, prefix), _ in runs])
    outcomes: dict[tuple, list[bool]] = {key: [] for key in order}
    for ((problem, prefix), _), rec in zip(runs, records, strict=True):
        outcomes[_key(problem.problem_id, prefix)].append(rec.status == "done" and rec.reward >= 1.0)
    rows: list[dict[str, Any]] = []
    for it in items:
        prefixes = turn_prefixes(it["messages"])
        for i, prefix in enumerate(prefixes):
            rows += mc_rows(it["trajectory_id"], i, *mc_value(outcomes[_key(it["problem"].problem_id, prefix)]), k)
        final = float(bool(it["correct"]))
        rows += mc_rows(it["trajectory_id"], len(prefixes), final, final, 0)
    stats = {"trajectories": len(items), "steps": len(rows) // 2,  # a soft and a hard row per turn
             "unique_prefixes": len(order), "rollouts": len(runs),
             # a resumed episode's stored turns carry no token count: these are the continuations' own
             "generated_tokens": sum(t.num_tokens or 0 for rec in records for t in rec.turns if t.role == "assistant"),
             "replay_mismatches": sum(rec.replay_mismatch for rec in records),
             "rollout_errors": sum(rec.status == "error" for rec in records)}
    return rows, stats


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
