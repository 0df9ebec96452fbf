"""Episodes of a round, as the stages run them: sampled by the policy through the batched loop, stored as rows,
and verified by the environment.

    sampler = ChatSampler(backend, ChatEncoder(backend.tok, uri), temperature=1.0, top_p=1.0, max_new_tokens=96, seed=0)
    batch, stats = run_episodes(env, sampler, problems, n=4, experiment="e", round=1, purpose="train",
                                policy_model_id="e/policy/r0/a1", seed=0)
    batch.tables   # problems, trajectories, steps (the assistant turns), turns

The verification of an episode is the environment's `score` on its last assistant turn, for an episode that
ended by answering (`done`); an episode cut at its turn, time or context limit, or whose environment raised, is
wrong. `verify_episodes` computes it from stored rows, as the `verify` stage does; the loop's own reward is the
same function on the same text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.domains.base import Problem
from components.envs import toolcalls
from components.envs.base import EpisodeRecord, EpisodeRunner
from components.envs.records import episode_rows, observed
from components.generation import problem_from_row


def is_agent(domain: Any) -> bool:
    """An environment whose problems are solved in episodes (calculator, sql, code, a user's), not a text domain."""
    return callable(getattr(domain, "episode", None)) and callable(getattr(domain, "score", None))


@dataclass
class EpisodeBatch:
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {
        "problems": [], "trajectories": [], "steps": [], "turns": []})
    rewards: dict[str, float] = field(default_factory=dict)  # trajectory id -> the loop's outcome reward
    records: list[EpisodeRecord] = field(default_factory=list)

    @property
    def trajectories(self) -> list[dict[str, Any]]:
        return self.tables["trajectories"]

    def add(self, tables: dict[str, list[dict[str, Any]]]) -> None:
        """Rows of these tables, each problem once."""
        seen = {p["problem_id"] for p in self.tables["problems"]}
        for name in self.tables:
            self.tables[name] += [r for r in tables.get(name, []) if name != "problems" or r["problem_id"] not in seen]
            seen |= {r["problem_id"] for r in tables.get(name, []) if name == "problems"}

    def add_episode(self, env: Any, record: EpisodeRecord, sample_index: int, **meta: Any) -> str:
        """The episode's rows (`episode_rows`, verified by the environment's `score`), its reward and record; its
        trajectory id. `meta`: experiment, round, purpose, policy_model_id, temperature, top_p, max_new_tokens, seed."""
        rows = episode_rows(record, sample_index=sample_index, verifier=f"{env.name}.score", verifier_version="1",
                            answer=env.extract_answer, **meta)
        self.add(rows)
        tid = rows["trajectories"][0]["trajectory_id"]
        self.rewards[tid] = record.reward
        self.records.append(record)
        return tid

    def extend(self, other: EpisodeBatch) -> None:
        self.add(other.tables)
        self.rewards |= other.rewards
        self.records += other.records


def run_episodes(env: Any, generate: Any, problems: list[Problem], *, n: int, experiment: str, round: int,
                 purpose: str, policy_model_id: str | None, seed: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 0, first_sample_index: int = 0) -> tuple[EpisodeBatch, dict[str, float]]:
    """`n` episodes per problem, every live one stepped in one batch per turn; the rows and the loop's stats
    (episodes, turns, tool calls and their errors, observations cut, how episodes ended, wall time in the
    environment and in generation)."""
    episodes = [(p, env.episode(p)) for p in problems for _ in range(n)]
    records = EpisodeRunner(generate, toolcalls.parse, env.limits).run(episodes)
    batch = episode_batch(env, records, n, first_sample_index, experiment=experiment, round=round, purpose=purpose,
                          policy_model_id=policy_model_id, temperature=temperature, top_p=top_p,
                          max_new_tokens=max_new_tokens, seed=seed)
    return batch, episode_stats(records)


def episode_batch(env: Any, records: list[EpisodeRecord], n: int, first_sample_index: int = 0,
                  **meta: Any) -> EpisodeBatch:
    """Records of `n` episodes per problem, problem by problem, as a batch: sample indices from
    `first_sample_index`. `meta` as `EpisodeBatch.add_episode` takes it."""
    batch = EpisodeBatch()
    for k, rec in enumerate(records):
        batch.add_episode(env, rec, first_sample_index + k % n, **meta)
    return batch


def episodes_until_right(run_wave: Callable[[list[Problem], int, int, int], EpisodeBatch], problems: list[Problem],
                         *, want: int, wave_size: int, n: int, seed: int,
                         progress: Callable[[str], None] | None = None,
                         ) -> tuple[EpisodeBatch, dict[str, float], dict[str, float]]:
    """`generate.until_correct` on an environment: `generation.waves_until_right`, where each wave runs episodes,
    judged by the environment's verdict (which verify stores). `run_wave(problems, k, seed, first_sample_index)` runs
    a wave, k episodes a problem: plainly (`run_episodes`) or turn by turn under a PRM.

    Returns the batch, the loop's stats over every episode (`episode_stats`) and the waves'."""
    from components.generation import waves_until_right

    def draw(pending: list[Problem], k: int, wave_seed: int, first: int):
        got = run_wave(pending, k, wave_seed, first)
        return (got, [(rec.problem.problem_id, rec.right) for rec in got.records],
                sum(t["num_tokens"] for t in got.trajectories))

    waves, stats = waves_until_right(problems, draw, want=want, wave_size=wave_size, n=n, seed=seed, progress=progress)
    batch = EpisodeBatch()
    for got in waves:
        batch.extend(got)
    return batch, episode_stats(batch.records), stats


def search_episodes(env: Any, generate: Any, problems: list[Problem], search: Any, *, n: int, experiment: str,
                    round: int, purpose: str, policy_model_id: str | None, seed: int, temperature: float = 1.0,
                    top_p: float = 1.0, max_new_tokens: int = 0, progress: Callable[[str], None] | None = None,
                    score_steps: Callable[[list[str], list[list[str]]], list[list[float]]] | None = None,
                    ) -> tuple[EpisodeBatch, list[dict[str, Any]], dict[str, float]]:
    """`generate.mcts` on an environment: one tree over turns per problem (components/search/episodes.py), and up
    to `n` episodes from each, stored as any episode; the trees as `nodes` rows, a node naming the trajectory it
    became; the search's statistics. `discarded_tokens` is what the search generated beyond the episodes kept.
    `score_steps`, a PRM's, values the nodes in place of rollouts."""
    from components.generation import search_tree_id
    from components.search.episodes import episode_mcts
    from components.search.mcts import MCTSConfig, node_rows

    cfg = MCTSConfig.of(search, len(problems))

    def report(sim: int, spent: int) -> None:
        if progress:
            progress(f"simulation {sim}/{cfg.simulations}: {spent} tokens")

    trees, picked, stats = episode_mcts(env, generate, problems, cfg, rollouts=search.rollouts, n=n, progress=report,
                                        score_steps=score_steps)
    batch, nodes = EpisodeBatch(), []
    meta = dict(experiment=experiment, round=round, purpose=purpose, policy_model_id=policy_model_id,
                temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    for p, tree, episodes in zip(problems, trees, picked, strict=True):
        became = {node_id: batch.add_episode(env, rec, idx, **meta) for idx, (node_id, rec) in enumerate(episodes)}
        nodes += [{"tree_id": search_tree_id(experiment, round, purpose, p.problem_id), "experiment_id": experiment,
                   "round": round, "purpose": purpose, "problem_id": p.problem_id} | row
                  | {"trajectory_id": became.get(row["node_id"])} for row in node_rows(tree)]
    kept = sum(t["num_tokens"] for t in batch.trajectories)
    return batch, nodes, stats | {"discarded_tokens": stats["generated_tokens"] - kept}


def episode_stats(records: list[EpisodeRecord]) -> dict[str, float]:
    turns = [t for r in records for t in r.turns]
    tools = [t for t in turns if t.role == "tool"]
    ended = Counter(r.status for r in records)
    env_s, gen_s = sum(r.env_s for r in records), sum(r.gen_s for r in records)
    out = {"episodes": len(records), "assistant_turns": sum(t.role == "assistant" for t in turns),
           "tool_calls": len(tools), "tool_errors": sum(t.ok is False for t in tools),
           "observations_cut": sum(t.truncated for t in tools), "env_seconds": env_s, "gen_seconds": gen_s,
           "env_share": env_share(env_s, gen_s)}
    return out | {f"ended_{status}": float(c) for status, c in sorted(ended.items())}


def env_share(env_s: float, gen_s: float) -> float:
    """The share of the loop's wall time spent in the environment rather than generating."""
    return env_s / max(env_s + gen_s, 1e-9)


def final_turns(turns: list[dict[str, Any]]) -> dict[str, str]:
    """Each trajectory's last assistant turn, from `turns` rows."""
    last: dict[str, tuple[int, str]] = {}
    for t in turns:
        if t["role"] == "assistant" and t["turn_index"] >= last.get(t["trajectory_id"], (-1, ""))[0]:
            last[t["trajectory_id"]] = (t["turn_index"], t["content"])
    return {tid: text for tid, (_, text) in last.items()}


def verify_episodes(env: Any, trajectories: list[dict[str, Any]], problems: list[dict[str, Any]],
                    turns: list[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    """`verifications` rows: the environment's score of each answered episode's last turn; 0 for the others."""
    by_id = {p["problem_id"]: problem_from_row(p) for p in problems}
    final = final_turns(turns)
    return [_verification(env, t, version, None if t["trajectory_id"] not in final else
                          lambda t=t: float(env.score(by_id[t["problem_id"]], final[t["trajectory_id"]])))
            for t in trajectories]


def _verification(env: Any, t: dict[str, Any], version: str, reward: Callable[[], float] | None) -> dict[str, Any]:
    """An episode's `verifications` row: `reward()` where it ended by answering, else wrong with reward 0."""
    answered = t["finish_reason"] == "done" and reward is not None
    r = reward() if answered else 0.0
    return {"trajectory_id": t["trajectory_id"], "verifier": f"{env.name}.score", "verifier_version": version,
            "correct": r >= 1.0, "reward": r,
            "detail": f"answer={t['answer']!r}" if answered else f"episode ended {t['finish_reason']}"}


def demonstration_episodes(env: Any, problems: list[dict[str, Any]], trajectories: list[dict[str, Any]],
                           progress: Callable[[int, int], None] | None = None,
                           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Round 0's demonstrations (`training.data.demonstrations` rows) as the environment's reference episodes:
    each trajectory's completion becomes the episode's transcript, and its turns (tool calls and observations
    included) become `turns` rows. `progress(done, total)` follows each episode: their tools really run (the
    code environment's in its sandbox), which takes minutes for thousands."""
    from components.envs.base import Turn

    by_id = {p["problem_id"]: p for p in problems}
    trajs, turns = [], []
    for done, t in enumerate(trajectories, 1):
        p = problem_from_row(by_id[t["problem_id"]])
        messages = env.reference_episode(p)
        tool = [m["role"] == "tool" for m in messages]  # the environment's own tools answered them
        rec = EpisodeRecord(p, messages, [Turn(i, m["role"], m["content"], m.get("name") if tool[i] else None,
                                               ok=not m["content"].startswith("error:") if tool[i] else None)
                                          for i, m in enumerate(messages)], 1.0, "done")
        rows = episode_rows(rec, experiment=t["experiment_id"], round=t["round"], purpose=t["purpose"],
                            policy_model_id=None, sample_index=t["sample_index"], temperature=None, top_p=None,
                            max_new_tokens=None, seed=None, verifier="", verifier_version="",
                            answer=env.extract_answer)
        [traj] = rows["trajectories"]
        if traj["trajectory_id"] != t["trajectory_id"]:
            raise AssertionError(f"demonstration {t['trajectory_id']}: its episode got id {traj['trajectory_id']}")
        trajs.append(traj | {"finish_reason": t["finish_reason"], "num_tokens": t["num_tokens"]})
        turns += rows["turns"]
        if progress is not None:
            progress(done, len(trajectories))
    return trajs, turns


def conversations(turns: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """`turns` rows as each trajectory's chat messages, the sampled ids kept on the assistant's (what SFT on an
    episode trains on, token for token)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for t in sorted(turns, key=lambda t: (t["trajectory_id"], t["turn_index"])):
        m: dict[str, Any] = {"role": t["role"], "content": t["content"]}
        if t["role"] == "tool" and t["tool_name"]:
            m["name"] = t["tool_name"]
        if t["role"] == "assistant" and t.get("token_ids"):
            m["token_ids"] = list(t["token_ids"])
        out.setdefault(t["trajectory_id"], []).append(m)
    return out


def episode_steps(turns: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each episode's steps as a reward model reads them, from `turns` rows: each assistant turn followed by the
    observations it got, marked as the transcript marks them. Joined by newlines they are the transcript
    (`trajectories.completion`), and step i is what Monte Carlo turn label i values: the conversation up to the
    next assistant turn.

    >>> rows = [{"trajectory_id": "e", "turn_index": i, "role": r, "content": c, "tool_name": n}
    ...         for i, (r, c, n) in enumerate([("system", "s", None), ("user", "q", None), ("assistant", "call", None),
    ...                                        ("tool", "4", "calculate"), ("assistant", "#### 4", None)])]
    >>> episode_steps(rows)
    {'e': ['call\\n[tool:calculate] 4', '#### 4']}
    """
    out: dict[str, list[str]] = {}
    for t in sorted(turns, key=lambda t: (t["trajectory_id"], t["turn_index"])):
        steps = out.setdefault(t["trajectory_id"], [])
        if t["role"] == "assistant":
            steps.append(t["content"])
        elif steps:  # an observation after an assistant turn; the system and first user messages come before any
            steps[-1] += "\n" + observed(t["role"], t["tool_name"], t["content"])
    return {tid: steps for tid, steps in out.items() if steps}


def verification_rows(env: Any, batch: EpisodeBatch, version: str) -> list[dict[str, Any]]:
    """`verifications` rows from the loop's own outcome rewards (the evaluate stage: it holds the records)."""
    return [_verification(env, t, version, lambda t=t: batch.rewards[t["trajectory_id"]]) for t in batch.trajectories]
