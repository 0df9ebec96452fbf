"""Stage `generate`: sample completions for a round's problems and segment them into steps."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from components.domains.base import Domain, Problem
from components.models.backends import GenerationBackend, Sample


def trajectory_id(experiment: str, round: int, purpose: str, problem_id: str, sample_index: int) -> str:
    """Stable id: a rerun of the same stage yields the same ids, so lineage survives reruns."""
    key = f"{experiment}|{round}|{purpose}|{problem_id}|{sample_index}".encode()
    return hashlib.sha256(key).hexdigest()[:24]


def problem_row(p: Problem, split: str) -> dict[str, Any]:
    return {"problem_id": p.problem_id, "domain": p.domain, "level": p.level, "prompt": p.prompt,
            "answer": p.answer, "meta_json": json.dumps(p.meta, sort_keys=True), "split": split}


@dataclass
class GeneratedBatch:
    problems: list[dict[str, Any]]
    trajectories: list[dict[str, Any]]
    steps: list[dict[str, Any]]

    @property
    def num_tokens(self) -> int:
        return sum(t["num_tokens"] for t in self.trajectories)


def generate(
    domain: Domain, backend: GenerationBackend, problems: list[Problem], *, experiment: str, round: int,
    purpose: str, policy_model_id: str, n: int, temperature: float, top_p: float, max_new_tokens: int, seed: int,
    split: str = "train", first_sample_index: int = 0, sample: Callable[..., list[list[Sample]]] | None = None,
) -> GeneratedBatch:
    """`n` samples per problem as trajectory and step rows; `sample` replaces `backend.generate` (same
    arguments), as the PRM-guided step search does."""
    samples = (sample or backend.generate)(
        [p.prompt for p in problems], n=n, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, seed=seed,
    )
    trajs, steps = [], []
    for p, per_prompt in zip(problems, samples, strict=True):
        for i, s in enumerate(per_prompt):
            idx = first_sample_index + i
            tid = trajectory_id(experiment, round, purpose, p.problem_id, idx)
            trajs.append({
                "trajectory_id": tid, "experiment_id": experiment, "round": round, "purpose": purpose,
                "problem_id": p.problem_id, "level": p.level, "policy_model_id": policy_model_id,
                "sample_index": idx, "prompt": p.prompt, "completion": s.text,
                "answer": domain.extract_answer(s.text), "num_tokens": s.num_tokens,
                "finish_reason": s.finish_reason, "temperature": temperature, "top_p": top_p,
                "max_new_tokens": max_new_tokens, "seed": seed,
            })
            steps.extend(
                {"trajectory_id": tid, "step_index": k, "text": text}
                for k, text in enumerate(domain.split_steps(s.text))
            )
    return GeneratedBatch([problem_row(p, split) for p in problems], trajs, steps)
