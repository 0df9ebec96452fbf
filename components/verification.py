"""Stage `verify`: run the outcome verifier over trajectories.

A verifier is a pure function `(completions, references) -> list[float | None]`. A verifier that
raises, or returns the wrong number of results, fails the stage loudly: it is a bug, not a
transient fault, and must never be retried into silence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from components.instantiate import locate

Verifier = Callable[[list[str], list[str]], list[float | None]]


class VerifierError(RuntimeError):
    pass


def resolve_verifier(domain, dotted_path: str | None) -> tuple[str, Verifier]:
    if dotted_path:
        return dotted_path, locate(dotted_path)
    return f"{domain.name}.verify", domain.verify


def verify(
    trajectories: list[dict[str, Any]], answers: dict[str, str], verifier: Verifier, *, name: str, version: str,
) -> list[dict[str, Any]]:
    """One verification row per trajectory; `answers` maps problem_id to its reference answer."""
    completions = [t["completion"] for t in trajectories]
    refs = [answers[t["problem_id"]] for t in trajectories]
    rewards = verifier(completions, refs)
    if len(rewards) != len(completions):
        raise VerifierError(f"verifier {name} returned {len(rewards)} results for {len(completions)} completions")
    rows = []
    for t, r in zip(trajectories, rewards):
        if r is not None and not 0.0 <= float(r) <= 1.0:
            raise VerifierError(f"verifier {name} returned {r!r} for trajectory {t['trajectory_id']}: expected 0..1 or None")
        rows.append({
            "trajectory_id": t["trajectory_id"], "verifier": name, "verifier_version": version,
            "correct": None if r is None else bool(r >= 0.5), "reward": None if r is None else float(r),
            "detail": "not applicable" if r is None else f"extracted={t['answer']!r} reference={answers[t['problem_id']]!r}",
        })
    return rows
