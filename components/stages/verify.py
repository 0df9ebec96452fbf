"""`verify`: the domain's outcome verifier (or `verify.verifier`) on every trajectory of the round; for an
environment, its `score` of each episode's answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.stages.base import Planner, Stage, domain_of, log, write


@dataclass
class Inputs:
    pass  # everything it reads is this round's committed `generate` output


def plan(p: Planner) -> Inputs:
    p.read("generate")
    return Inputs()


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.envs.rollout import is_agent, verify_episodes
    from components.verification import resolve_verifier, verify

    cfg, domain = spec.cfg(), domain_of(spec)
    trajs = spec.rows("generate", "trajectories")
    if spec.shards > 1:
        mine = spec.share(t["problem_id"] for t in trajs)
        trajs = [t for t in trajs if t["problem_id"] in mine]
    problems = spec.rows("generate", "problems")
    if is_agent(domain) and cfg.verify.verifier is None:  # the environment runs each episode's answer
        rows = verify_episodes(domain, trajs, problems, spec.rows("generate", "turns"), spec.code_version or "dev")
    else:
        name, fn = resolve_verifier(domain, cfg.verify.verifier)
        rows = verify(trajs, {p["problem_id"]: p["answer"] for p in problems}, fn, name=name,
                      version=spec.code_version or "dev")
    write(out, verifications=rows)
    log("verify", f"{sum(1 for r in rows if r['correct'])}/{len(rows)} correct")
    return pass_rates(rows, trajs)


def pass_rates(rows: list[dict[str, Any]], trajs: list[dict[str, Any]]) -> dict[str, float]:
    n_ok = sum(1 for r in rows if r["correct"])
    metrics: dict[str, float] = {"verified": len(rows), "pass_rate": n_ok / max(len(rows), 1)}
    level_of = {t["trajectory_id"]: t["level"] for t in trajs}
    for level in sorted({level_of[r["trajectory_id"]] for r in rows}):
        sub = [r for r in rows if level_of[r["trajectory_id"]] == level]
        metrics[f"pass_rate_L{level}"] = sum(1 for r in sub if r["correct"]) / len(sub)
    return metrics


def merge(spec: StageSpec, shard_metrics: list[dict[str, float]], read) -> tuple[dict[str, float], dict]:
    """Pass rates over all the shards' verifications."""
    return pass_rates(read("verifications"), spec.rows("generate", "trajectories")), {}


STAGE = Stage(name="verify", section="verify", gpu=False, reads=("generate",), writes=("verifications",),
              inputs=Inputs, plan=plan, run=run, merge=merge)
