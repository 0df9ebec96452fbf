"""Stage `score`: give each trajectory its scores.

With no reward model, the score is the verifier outcome (`scorer='outcome'`). Reward models add
per-step rows and min/last/mean aggregates with the same shape, so the contract does not change.
"""

from __future__ import annotations

from typing import Any


def outcome_scores(verifications: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"trajectory_id": v["trajectory_id"], "scorer": "outcome", "model_id": None, "step_index": -1,
         "aggregate": "outcome", "value": 0.0 if v["reward"] is None else float(v["reward"])}
        for v in verifications
    ]
