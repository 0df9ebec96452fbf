"""`train_reward` (recipe coevo, and grpo with train_reward.enabled): the round's PRM on the Monte Carlo labels of
`label_rounds`, and optionally an ORM on outcomes.

With `filter.judge: round` the PRM is the judge of the round's own right answers, so it never trains on them: it
trains on the wrong answers' labels, the demonstrations and the right answers an earlier round's filter kept, then
scores the round's right answers (`scores`, scorer `judge`) for the filter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.config import ExperimentConfig
from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.stages.base import (Planner, Stage, domain_of, log, model_id, model_input, model_row,
                                    prompt_format_of, reward_scores, reward_steps, selected, steps_by_trajectory,
                                    write)


@dataclass
class Inputs:
    policy_uri: str  # the policy that sampled the round: a new PRM's backbone unless train_reward.model names one
    label_rounds: list[int]
    init_prm_uri: str | None = None  # the previous PRM, with train_reward.init=previous
    parent_model_id: str | None = None


def label_rounds(cfg: ExperimentConfig, round: int) -> list[int]:
    """Rounds whose step labels train this round's reward model: all so far, or the last `window_rounds`.

    >>> from components.config import load_config_dict
    >>> label_rounds(load_config_dict({"experiment": "x", "train_reward": {"window_rounds": 2}}), 5)
    [4, 5]
    """
    w = cfg.train_reward.window_rounds
    return list(range(1 if w is None else max(1, round - w + 1), round + 1))


def plan(p: Planner) -> Inputs:
    tr = p.cfg.train_reward
    policy = p.model(p.round - 1)
    prev = p.optional_model(p.round - 1, "prm")
    rounds = label_rounds(p.cfg, p.round)
    for r in rounds:
        for stage in ("generate", "verify", "score"):
            p.read(stage, r)
    if p.cfg.filter.judges_in_round:  # right answers train the judge only once an earlier filter has kept them
        for r in range(1, p.round):
            p.read("filter", r)
    if tr.demos:
        p.read("bootstrap", 0)
    if p.committed("import", 0):
        p.read("import", 0)
    return Inputs(policy_uri=policy["uri"], label_rounds=rounds,
                  init_prm_uri=prev["uri"] if prev and tr.init == "previous" else None,
                  parent_model_id=prev["model_id"] if prev else None)


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.labeling import demo_prm_examples, prm_examples
    from components.rewards.prm import PRMParams, train_prm

    cfg, inp = spec.cfg(), spec.inputs_as(Inputs)
    tr = cfg.train_reward
    if tr.orm:  # the ORM trains with its own batch, after the PRM: one it cannot split fails now, not after the PRM
        from components.rewards.orm import ORMParams
        from components.training.common import process_batch

        process_batch(ORMParams.batch_size, "the ORM's batch (ORMParams.batch_size)", "train_reward")
    domain = domain_of(spec)
    judge = cfg.filter.judges_in_round
    kept_before = {s["trajectory_id"] for r in range(1, spec.round) if judge
                   for s in spec.rows("filter", "selections", round=r) if s["selected"] and s["purpose"] == "policy_sft"}
    examples, decisions, outcome_examples, labelled_round = [], [], [], {}
    held_out: list[dict[str, Any]] = []  # the round's right answers: the judge's to score, not to learn from
    held_steps: dict[str, list[str]] = {}
    for r in inp.label_rounds:
        trajs = spec.rows("generate", "trajectories", round=r)
        steps = reward_steps(spec, "generate", round=r)
        if judge:  # a right answer no filter has kept yet is the judge's to judge, not to learn from
            correct = {v["trajectory_id"]: v["correct"] for v in spec.rows("verify", "verifications", round=r)}
            unjudged = {t["trajectory_id"] for t in trajs if correct.get(t["trajectory_id"]) and
                        t["trajectory_id"] not in kept_before}
            if r == spec.round:
                held_out = sorted((t for t in trajs if t["trajectory_id"] in unjudged), key=lambda t: t["trajectory_id"])
                held_steps = steps
            trajs = [t for t in trajs if t["trajectory_id"] not in unjudged]
        labels: dict[str, dict[int, dict[str, float]]] = {}
        for lab in spec.rows("score", "step_labels", round=r):
            labels.setdefault(lab["trajectory_id"], {}).setdefault(lab["step_index"], {})[lab["source"]] = lab["value"]
        prior: dict[str, list[float]] = {}
        for sc in sorted(spec.rows("score", "scores", round=r), key=lambda x: x["step_index"]):
            if sc["scorer"] == "prm" and sc["aggregate"] == "step":
                prior.setdefault(sc["trajectory_id"], []).append(sc["value"])
        items = [{"trajectory_id": t["trajectory_id"], "prompt": t["prompt"], "steps": steps.get(t["trajectory_id"], [])}
                 for t in sorted(trajs, key=lambda t: t["trajectory_id"])]
        ex, dec = prm_examples(items, labels, source=tr.label_source, soft_threshold=tr.soft_threshold,
                               prior_scores=prior, consensus=tr.consensus_filter)
        examples += ex
        labelled_round |= {e["trajectory_id"]: r for e in ex}
        if r == spec.round:  # each trajectory's decision is made once, in its own round
            dec += [{"trajectory_id": t["trajectory_id"], "selected": False,
                     "reason": "held out: a right answer this PRM judges"} for t in held_out]
            decisions = [d | {"experiment_id": spec.experiment, "round": r, "purpose": "reward_train",
                              "rank": None, "pair_id": None} for d in dec]
        if tr.orm:
            correct = {v["trajectory_id"]: v["correct"] for v in spec.rows("verify", "verifications", round=r)}
            outcome_examples += [{"prompt": t["prompt"], "completion": t["completion"], "label": bool(correct[t["trajectory_id"]]),
                                  "trajectory_id": t["trajectory_id"], "round": r}
                                 for t in trajs if correct.get(t["trajectory_id"]) is not None]
    if spec.has("import", 0):  # imported trajectories: their given step labels, and their verdicts for the ORM
        imported, outcomes = _imported_examples(spec)
        examples += imported
        labelled_round |= {e["trajectory_id"]: 0 for e in imported}
        outcome_examples += outcomes if tr.orm else []
    demos = demo_prm_examples(selected(spec, 0, demos_only=True), _demo_steps(spec), examples) if tr.demos else []
    if not examples and not (judge and demos):  # a judge's first round may have only wrong answers' labels, or none
        raise RuntimeError(f"{spec.stage_run_id}: no {tr.label_source} step labels in rounds {inp.label_rounds}; "
                           + ("did score.tree label any trajectory?" if tr.label_source.startswith("tree_")
                              else "is score.mc_rollouts > 0?"))
    examples += demos
    labelled_round |= {e["trajectory_id"]: 0 for e in demos}
    n_steps = sum(v is not None for e in examples for v in e["labels"])  # None: a step without a label
    n_good = sum(v is True for e in examples for v in e["labels"])
    demo_note = f", {len(demos)} of them round-0 demonstrations" if demos else ""
    # The config decides, not only the plan: a rerun, or benchmarks/judge_settings.py, may change init or model.
    backbone = tr.model or inp.policy_uri
    init_prm = inp.init_prm_uri if tr.init == "previous" else None
    log("train_reward", f"PRM on {len(examples)} trajectories ({n_steps} labelled steps, {n_good / n_steps:.0%} good) "
                        f"from rounds {inp.label_rounds}{demo_note}; {tr.head} head, init "
                        + ("previous PRM" if init_prm else f"train_reward.model {tr.model}" if tr.model
                           else "policy backbone"))
    model_dir = out.artifact_dir("prm")
    prm_metrics = train_prm(backbone, examples, str(model_dir),
                            PRMParams(max_steps=tr.steps, batch_size=tr.batch_size, learning_rate=tr.learning_rate,
                                      seed=spec.seed, head=tr.head, lm_weight=tr.lm_weight,
                                      separator=domain.step_separator, **reward_settings(cfg),
                                      lora=tr.lora.model_dump() if tr.lora else None), init_from_prm=init_prm)
    log("train_reward", f"PRM loss {prm_metrics['first_loss']:.4f} -> {prm_metrics['final_loss']:.4f} "
                        f"in {prm_metrics['runtime_s']:.1f}s")
    models = [model_row(spec, "prm", model_dir, "prm", inp.parent_model_id, len(examples))]
    inputs = [model_input(spec, "prm", e["trajectory_id"], labelled_round[e["trajectory_id"]]) for e in examples]
    metrics: dict[str, Any] = {f"prm_{k}": v for k, v in prm_metrics.items() if isinstance(v, (int, float))}
    metrics |= {"label_good_fraction": n_good / n_steps, "demo_examples": len(demos), "consensus_dropped":
                sum(1 for d in decisions if d["reason"].startswith("consensus"))}
    if tr.orm:
        from components.rewards.orm import ORMParams, train_orm

        orm_dir = out.artifact_dir("orm")
        orm_metrics = train_orm(backbone, outcome_examples, str(orm_dir),
                                ORMParams(max_steps=tr.orm_steps, seed=spec.seed, **reward_settings(cfg)))
        log("train_reward", f"ORM on {orm_metrics['pairs']} pairs: loss {orm_metrics['final_loss']:.4f}")
        models.append(model_row(spec, "orm", orm_dir, "orm", None, len(outcome_examples)))
        inputs += [model_input(spec, "orm", e["trajectory_id"], e["round"]) for e in outcome_examples]
        metrics |= {f"orm_{k}": v for k, v in orm_metrics.items() if isinstance(v, (int, float))}
    tables: dict[str, list[dict[str, Any]]] = {"models": models, "model_inputs": inputs, "selections": decisions}
    if judge:
        rows = reward_scores(spec, "prm", str(model_dir), model_id(spec, "prm"), held_out, held_steps) if held_out else []
        tables["scores"] = [r | {"scorer": "judge"} for r in rows]
        metrics |= {"judge_held_out": len(held_out), "judge_scored": sum(r["aggregate"] == "min" for r in tables["scores"])}
        log("train_reward", f"the PRM judged this round's {metrics['judge_scored']} right answers, none of which it "
                            f"trained on ({len(held_out)} held out of its labels)")
    write(out, **tables)
    return {k: float(v) for k, v in metrics.items()}


def _demo_steps(spec: StageSpec):
    """`steps_of(trajectory_id, row)` for round 0's demonstrations: the domain's split of the completion, or for
    an environment each reference episode's turns, as the PRM reads an episode (`reward_steps`)."""
    from components.envs.rollout import is_agent

    domain = domain_of(spec)
    if not is_agent(domain):
        return lambda tid, t: domain.split_steps(t["completion"])
    episodes = reward_steps(spec, "bootstrap", round=0)
    return lambda tid, t: episodes.get(tid, [])


def _imported_examples(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """PRM examples from the imports' given step labels, and ORM outcome examples from their verdicts."""
    from components.labeling import prm_examples

    trajs = [t for t in spec.rows("import", "trajectories", round=0) if t["purpose"] == "train"]
    steps = steps_by_trajectory(spec.rows("import", "steps", round=0))
    labels: dict[str, dict[int, dict[str, float]]] = {}
    for lab in spec.rows("import", "step_labels", round=0):
        labels.setdefault(lab["trajectory_id"], {}).setdefault(lab["step_index"], {})[lab["source"]] = lab["value"]
    items = [{"trajectory_id": t["trajectory_id"], "prompt": t["prompt"], "steps": steps.get(t["trajectory_id"], [])}
             for t in sorted(trajs, key=lambda t: t["trajectory_id"])]
    examples, _ = prm_examples(items, labels, source="given")
    correct = {v["trajectory_id"]: v["correct"] for v in spec.rows("import", "verifications", round=0)}
    outcomes = [{"prompt": t["prompt"], "completion": t["completion"], "label": bool(correct[t["trajectory_id"]]),
                 "trajectory_id": t["trajectory_id"], "round": 0}
                for t in trajs if correct.get(t["trajectory_id"]) is not None]
    return examples, outcomes


def reward_settings(cfg) -> dict:
    """What PRMParams and ORMParams share with the policy: its prompt rendering, dtype and length rules."""
    return {"prompt_format": prompt_format_of(cfg), "dtype": cfg.policy.dtype, "max_length": cfg.train_reward.max_length,
            "max_truncated_fraction": cfg.policy.max_truncated_fraction, "setting": "train_reward"}


STAGE = Stage(name="train_reward", section="train_reward", gpu=True,
              reads=("generate", "verify", "score", "filter", "bootstrap", "import"),
              writes=("models", "model_inputs", "selections", "scores"), inputs=Inputs, plan=plan, run=run)

