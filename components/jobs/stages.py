"""Stage job bodies: read committed inputs, call the stage function, hand rows to the writer.

This module and `__main__` are the only places that read and write Parquet and manifests; the stage
functions themselves (`components.generation`, `components.filtering`, ...) return data.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.domains import get_domain
from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter, sha256_dir
from components.seeding import derive_seed
from components.tables import to_table


def log(stage: str, msg: str) -> None:
    print(f"[{stage}] {msg}", flush=True)


def _domain(spec: StageSpec):
    cfg = spec.cfg()
    return get_domain(cfg.domain.name, **cfg.domain.options)


def _backend(spec: StageSpec, model_uri: str):
    from components.models.backends import get_backend

    g = spec.cfg().generate
    return get_backend(g.backend, model_uri, batch_size=g.batch_size, **g.backend_options)


def _unique(problems: list) -> list:
    """Drop repeats (a small level can have fewer distinct problems than asked for), keeping order."""
    seen: set[str] = set()
    return [p for p in problems if not (p.problem_id in seen or seen.add(p.problem_id))]


def _write(out: StageOutputWriter, **tables: list[dict[str, Any]]) -> None:
    for name, rows in tables.items():
        out.write_table(name, to_table(name, rows))


# -- stages ------------------------------------------------------------------------------

def run_generate(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.generation import generate

    cfg, domain = spec.cfg(), _domain(spec)
    levels: list[int] = spec.params["levels"]
    problems = []
    for level in levels:
        # One seed per level (the shard), so adding a level does not reshuffle the others.
        problems += domain.sample_problems(level, cfg.generate.problems_per_level,
                                           seed=spec.params["problem_seeds"][str(level)])
    problems = _unique(problems)
    log("generate", f"{len(problems)} problems at levels {levels}, {cfg.generate.samples_per_problem} samples each")
    t0 = time.perf_counter()
    batch = generate(
        domain, _backend(spec, spec.params["policy_uri"]), problems, experiment=spec.experiment, round=spec.round,
        purpose="train", policy_model_id=spec.params["policy_model_id"], n=cfg.generate.samples_per_problem,
        temperature=cfg.generate.temperature, top_p=cfg.generate.top_p,
        max_new_tokens=cfg.generate.max_new_tokens, seed=spec.seed,
    )
    dt = time.perf_counter() - t0
    _write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps)
    log("generate", f"{len(batch.trajectories)} trajectories, {batch.num_tokens} tokens in {dt:.1f}s")
    return {"trajectories": len(batch.trajectories), "problems": len(problems), "tokens": batch.num_tokens,
            "tokens_per_s": batch.num_tokens / max(dt, 1e-9)}


def run_verify(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.verification import resolve_verifier, verify

    cfg, domain = spec.cfg(), _domain(spec)
    trajs = spec.rows("generate", "trajectories")
    answers = {p["problem_id"]: p["answer"] for p in spec.rows("generate", "problems")}
    name, fn = resolve_verifier(domain, cfg.verify.verifier)
    rows = verify(trajs, answers, fn, name=name, version=spec.code_version or "dev")
    _write(out, verifications=rows)
    n_ok = sum(1 for r in rows if r["correct"])
    metrics: dict[str, float] = {"verified": len(rows), "pass_rate": n_ok / max(len(rows), 1)}
    level_of = {t["trajectory_id"]: t["level"] for t in trajs}
    for level in sorted(set(level_of.values())):
        sub = [r for r in rows if level_of[r["trajectory_id"]] == level]
        metrics[f"pass_rate_L{level}"] = sum(1 for r in sub if r["correct"]) / len(sub)
    log("verify", f"{n_ok}/{len(rows)} correct")
    return metrics


def run_score(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.scoring import outcome_scores

    rows = outcome_scores(spec.rows("verify", "verifications"))
    _write(out, scores=rows)
    return {"scored": len(rows), "mean_score": sum(r["value"] for r in rows) / max(len(rows), 1)}


def run_filter(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.filtering import rft_filter

    cfg = spec.cfg()
    trajs = spec.rows("generate", "trajectories")
    correct = {v["trajectory_id"]: v["correct"] for v in spec.rows("verify", "verifications")}
    scores = {s["trajectory_id"]: s["value"] for s in spec.rows("score", "scores") if s["step_index"] == -1}
    steps_ok = None
    if cfg.filter.check_steps:
        domain = _domain(spec)
        steps_ok = {t["trajectory_id"]: domain.check_steps(t["prompt"], t["completion"]) for t in trajs}
    rows = rft_filter(trajs, correct, scores, experiment=spec.experiment, round=spec.round,
                      dedup=cfg.filter.dedup, max_per_problem=cfg.filter.max_per_problem, steps_ok=steps_ok)
    _write(out, selections=rows)
    n_sel = sum(r["selected"] for r in rows)
    log("filter", f"selected {n_sel} of {len(rows)} trajectories for policy_sft")
    return {"selected": n_sel, "considered": len(rows), "selected_fraction": n_sel / max(len(rows), 1)}


def _bootstrap_examples(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Gold demonstrations for round 0, stored as trajectories (purpose='demo') for lineage."""
    from components.generation import problem_row, trajectory_id

    cfg, domain = spec.cfg(), _domain(spec)
    b = cfg.bootstrap
    problems = []
    for level in b.levels:
        problems += domain.sample_problems(level, b.problems_per_level, seed=derive_seed(spec.seed, 0, "demo", level))
    n_seed_total = round(len(problems) * b.seed_fraction / max(1.0 - b.seed_fraction, 1e-9))
    per_seed_level = n_seed_total // max(len(b.seed_levels), 1)
    for level in b.seed_levels:
        problems += domain.sample_problems(level, per_seed_level, seed=derive_seed(spec.seed, 0, "seed_demo", level))
    trajs, sels = [], []
    for p in _unique(problems):
        tid = trajectory_id(spec.experiment, spec.round, "demo", p.problem_id, 0)
        completion = domain.reference_solution(p)
        trajs.append({
            "trajectory_id": tid, "experiment_id": spec.experiment, "round": spec.round, "purpose": "demo",
            "problem_id": p.problem_id, "level": p.level, "policy_model_id": None, "sample_index": 0,
            "prompt": p.prompt, "completion": completion, "answer": p.answer, "num_tokens": 0,
            "finish_reason": "reference", "temperature": None, "top_p": None, "max_new_tokens": None, "seed": None,
        })
        sels.append({"trajectory_id": tid, "experiment_id": spec.experiment, "round": spec.round,
                     "purpose": "policy_sft", "selected": True, "rank": 0, "reason": "gold demonstration",
                     "pair_id": None})
    return [problem_row(p, "train") for p in _unique(problems)], trajs, sels


def run_train_policy(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.models.tiny import TinyLlamaConfig, create_tiny_llama
    from components.training.sft import SFTParams, train_sft

    cfg = spec.cfg()
    model_dir = out.artifact_dir("model")
    init_uri: str | None = spec.params.get("init_uri")
    extra: dict[str, list[dict[str, Any]]] = {}
    if spec.round == 0:
        problems, trajs, sels = _bootstrap_examples(spec)
        extra = {"problems": problems, "trajectories": trajs, "selections": sels,
                 "model_inputs": [{"model_id": _model_id(spec), "trajectory_id": t["trajectory_id"],
                                   "source_round": 0, "use": "new"} for t in trajs]}
        examples = [{"prompt": t["prompt"], "completion": t["completion"]} for t in trajs]
        steps, batch, lr = cfg.bootstrap.steps, cfg.bootstrap.batch_size, cfg.bootstrap.learning_rate
        if init_uri is None:
            init_dir = out.artifact_dir("init_model")  # kept: the random init is part of the lineage
            tiny = TinyLlamaConfig(**cfg.policy.tiny.model_dump())
            init_uri = str(create_tiny_llama(tiny, init_dir, seed=spec.seed))
            log("train_policy", f"created a from-scratch tiny Llama at {init_uri}")
    else:
        new = _selected(spec, spec.round)
        pool = {tid: t for r in range(spec.round) for tid, t in _selected(spec, r).items() if tid not in new}
        n_replay = min(len(pool), round(spec.params["replay_ratio"] * len(new)))
        replay = random.Random(spec.seed).sample(sorted(pool), n_replay)
        chosen = [(tid, new[tid], "new") for tid in sorted(new)] + [(tid, pool[tid], "replay") for tid in replay]
        examples = [{"prompt": t["prompt"], "completion": t["completion"]} for _, t, _ in chosen]
        extra["model_inputs"] = [{"model_id": _model_id(spec), "trajectory_id": tid, "source_round": t["round"],
                                  "use": use} for tid, t, use in chosen]
        log("train_policy", f"{len(new)} new selections + {n_replay} replayed from {len(pool)} earlier ones")
        tp = cfg.train_policy
        steps, batch, lr = tp.steps, tp.batch_size, tp.learning_rate
        if tp.epochs is not None:
            steps = min(steps, math.ceil(tp.epochs * len(examples) / batch))
    if not examples and spec.round == 0:
        raise RuntimeError(f"{spec.stage_run_id}: the bootstrap has no demonstrations; nothing to train on")
    if not examples:
        # A round that kept nothing (no sample was right) carries its policy forward unchanged,
        # as ReST does, instead of failing the experiment; the next round samples again.
        log("train_policy", "WARNING: no trajectory was selected this round; the policy carries over unchanged")
        steps = 0
    log("train_policy", f"SFT on {len(examples)} examples, {steps} steps of batch {batch}, from {init_uri}")
    if steps > 0:
        metrics = train_sft(init_uri, examples, str(model_dir),
                            SFTParams(max_steps=steps, batch_size=batch, learning_rate=lr, seed=spec.seed),
                            progress_callback=_train_progress)
    else:
        _copy_model(init_uri, model_dir)
        metrics = {"train_loss": float("nan"), "steps": 0}
    final_uri = str(Path(spec.out_dir) / "model")
    model_id = _model_id(spec)
    models = [{
        "model_id": model_id, "experiment_id": spec.experiment, "role": "policy", "round": spec.round,
        "uri": final_uri, "sha256": sha256_dir(model_dir), "parent_model_id": spec.params.get("parent_model_id"),
        "train_examples": len(examples), "mlflow_run_id": None, "registered_name": None, "registered_version": None,
    }]
    _write(out, models=models, **extra)
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))} | {"examples": len(examples)}


def _model_id(spec: StageSpec, role: str = "policy") -> str:
    return f"{spec.experiment}/{role}/r{spec.round}"


def _selected(spec: StageSpec, round: int) -> dict[str, dict[str, Any]]:
    """Trajectories selected for policy SFT in `round` (round 0: the demos train_policy stored)."""
    src_t, src_s = ("train_policy", "train_policy") if round == 0 else ("generate", "filter")
    trajs = {t["trajectory_id"]: t for t in spec.rows(src_t, "trajectories", round=round)}
    return {s["trajectory_id"]: trajs[s["trajectory_id"]] for s in spec.rows(src_s, "selections", round=round)
            if s["selected"] and s["purpose"] == "policy_sft"}


def _train_progress(step: int, total: int, loss: float | None) -> None:
    loss_s = f", loss {loss:.4f}" if loss is not None else ""
    log("train_policy", f"step {step}/{total}{loss_s}")


def _copy_model(uri: str, dest: Path) -> None:
    from components.models.tiny import load_policy

    model, tok = load_policy(uri)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)


def run_evaluate(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.evaluation import evaluate

    cfg, domain = spec.cfg(), _domain(spec)
    e = cfg.evaluate
    levels = e.levels or domain.levels()
    problems = [p for level in levels for p in domain.test_set(level)[: e.problems_per_level]]
    log("evaluate", f"{len(problems)} held-out problems at levels {levels}: greedy + maj@{e.maj_k}")
    batch, vers, rows = evaluate(
        domain, _backend(spec, spec.params["policy_uri"]), problems, experiment=spec.experiment, round=spec.round,
        model_id=spec.params["policy_model_id"], maj_k=e.maj_k, temperature=e.temperature,
        max_new_tokens=e.max_new_tokens, seed=spec.seed,
    )
    _write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps,
           verifications=vers, evaluations=rows)
    metrics = {}
    for r in rows:
        key = r["metric"] if r["level"] == -1 else f"{r['metric']}_L{r['level']}"
        metrics[key] = r["value"]
    log("evaluate", " ".join(f"L{r['level']}={r['value']:.2f}" for r in rows
                             if r["metric"] == "greedy_acc" and r["level"] >= 0))
    return metrics


STAGE_JOBS: dict[str, Callable[[StageSpec, StageOutputWriter], dict[str, float]]] = {
    "generate": run_generate,
    "verify": run_verify,
    "score": run_score,
    "filter": run_filter,
    "train_policy": run_train_policy,
    "evaluate": run_evaluate,
}
