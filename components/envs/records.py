"""A finished episode as store rows: its trajectory, its steps (the assistant turns) and its turns.

The trajectory's `prompt` is the episode's first user message, its `completion` the turns after it as a
reader would follow them (each observation marked with its role and tool), its `answer` what the environment
reads out of the last assistant turn, `num_tokens` the assistant tokens, and `finish_reason` how the episode
ended (done, truncated_turns, truncated_time, truncated_context, error). Steps are the assistant turns, one
each, so Monte Carlo labels, the PRM, the filter and `v_lineage` treat an episode like any trajectory. The
verification is the environment's outcome reward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from components.envs.base import EpisodeRecord
from components.generation import problem_row, trajectory_id


def transcript(record: EpisodeRecord) -> str:
    """The turns after the first user message, as one text: what `trajectories.completion` holds."""
    first_user = next(i for i, t in enumerate(record.turns) if t.role == "user")
    parts = []
    for t in record.turns[first_user + 1:]:
        if t.role == "assistant":
            parts.append(t.content)
        else:
            parts.append(observed(t.role, t.tool_name, t.content))
    return "\n".join(parts)


def observed(role: str, tool_name: str | None, content: str) -> str:
    """An observation as a transcript shows it, marked with its role and tool.

    >>> observed("tool", "run_sql", "3 rows")
    '[tool:run_sql] 3 rows'
    """
    return f"[{role}{':' + tool_name if tool_name else ''}] {content}"


def episode_rows(record: EpisodeRecord, *, experiment: str, round: int, purpose: str, policy_model_id: str | None,
                 sample_index: int, temperature: float, top_p: float, max_new_tokens: int, seed: int,
                 verifier: str, verifier_version: str,
                 answer: Callable[[str], str | None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The episode's rows; `answer` reads the answer out of the last assistant turn (default: the turn itself)."""
    p = record.problem
    tid = trajectory_id(experiment, round, purpose, p.problem_id, sample_index)
    assistant = [t for t in record.turns if t.role == "assistant"]
    user = next((t.content for t in record.turns if t.role == "user"), p.prompt)
    traj = {"trajectory_id": tid, "experiment_id": experiment, "round": round, "purpose": purpose,
            "problem_id": p.problem_id, "level": p.level, "policy_model_id": policy_model_id,
            "sample_index": sample_index, "prompt": user, "completion": transcript(record),
            "answer": (answer or (lambda text: text))(assistant[-1].content) if assistant else None,
            "num_tokens": sum(t.num_tokens or 0 for t in assistant), "finish_reason": record.status,
            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed,
            "token_ids": None}
    steps = [{"trajectory_id": tid, "step_index": i, "text": t.content} for i, t in enumerate(assistant)]
    turns = [{"trajectory_id": tid, "turn_index": t.turn_index, "role": t.role, "content": t.content,
              "tool_name": t.tool_name, "tool_arguments": t.tool_arguments, "tool_ok": t.ok, "error": t.error,
              "reward": t.reward, "num_tokens": t.num_tokens, "finish_reason": t.finish_reason,
              "latency_s": t.latency_s, "truncated": t.truncated, "token_ids": t.token_ids} for t in record.turns]
    correct = None if record.status == "error" else record.reward >= 1.0
    verification = {"trajectory_id": tid, "verifier": verifier, "verifier_version": verifier_version,
                    "correct": correct, "reward": record.reward,
                    "detail": record.error.strip().splitlines()[-1] if record.error else record.status}
    split = "test" if purpose == "eval" else "train"
    return {"problems": [problem_row(p, split)], "trajectories": [traj], "steps": steps, "turns": turns,
            "verifications": [verification]}
