"""`bootstrap` (round 0): the gold demonstrations, and the first policy trained on them by SFT, from
`policy.model` or from a from-scratch tiny Llama; with `bootstrap.steps: 0`, `policy.model` as it is."""

from __future__ import annotations

from dataclasses import dataclass

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.stages.base import (Planner, Stage, count_progress, domain_of, given_model_row, log, model_id,
                                    model_row, train_progress, trainer_settings, write)


@dataclass
class Inputs:
    init_uri: str | None  # policy.model; None builds a tiny Llama from scratch


def plan(p: Planner) -> Inputs:
    return Inputs(init_uri=p.cfg.policy.model)


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.envs.rollout import conversations, demonstration_episodes, is_agent
    from components.models.tiny import TinyLlamaConfig, create_tiny_llama
    from components.training.data import demonstrations
    from components.training.sft import SFTParams, train_sft

    cfg, inp = spec.cfg(), spec.inputs_as(Inputs)
    b = cfg.bootstrap
    domain = domain_of(spec)
    problems, trajs, sels = demonstrations(domain, b, spec.seed, spec.experiment, solve=not is_agent(domain))
    turns: list[dict] = []
    if is_agent(domain):  # the environment's reference episodes, tool calls and observations included
        trajs, turns = demonstration_episodes(domain, problems, trajs,
                                              progress=count_progress("bootstrap", "demonstration episodes"))
    episodes = {"turns": turns} if turns else {}  # a text domain's bootstrap writes what it always wrote
    inputs = [{"model_id": model_id(spec), "trajectory_id": t["trajectory_id"], "source_round": 0, "use": "new"}
              for t in trajs]
    if b.steps == 0:
        # A pretrained start: round 0's policy is the given model, registered where it is (not re-saved, so
        # its dtype and files are the user's); the demonstrations are stored for replay, not trained on.
        row = given_model_row(spec, inp.init_uri)
        log("bootstrap", f"round 0's policy is {row['uri']} as it is; {len(trajs)} demonstrations stored for replay")
        write(out, models=[row], problems=problems, trajectories=trajs, selections=sels, model_inputs=[], **episodes)
        return {"examples": 0.0, "dpo_pairs": 0.0}
    if not trajs:
        raise RuntimeError(f"{spec.stage_run_id}: the bootstrap has no demonstrations; nothing to train on")
    init_uri = inp.init_uri
    if init_uri is None:
        init_dir = out.artifact_dir("init_model")  # kept: the random init is part of the lineage
        init_uri = str(create_tiny_llama(TinyLlamaConfig(**cfg.policy.tiny.model_dump()), init_dir, seed=spec.seed))
        log("bootstrap", f"created a from-scratch tiny Llama at {init_uri}")
    chats = conversations(turns)
    examples = [{"messages": chats[t["trajectory_id"]]} if turns else {"prompt": t["prompt"], "completion": t["completion"]}
                for t in trajs]
    model_dir = out.artifact_dir("model")
    log("bootstrap", f"SFT on {len(examples)} examples, {b.steps} steps of batch {b.batch_size}, from {init_uri}")
    metrics = train_sft(init_uri, examples, str(model_dir),
                        SFTParams(max_steps=b.steps, batch_size=b.batch_size, learning_rate=b.learning_rate,
                                  seed=spec.seed, **trainer_settings(cfg, "bootstrap", b.max_length,
                                                                     b.gradient_accumulation_steps)),
                        progress_callback=train_progress("bootstrap"))
    write(out, models=[model_row(spec, "policy", model_dir, "model", None, len(inputs))], problems=problems,
          trajectories=trajs, selections=sels, model_inputs=inputs, **episodes)
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))} | {"examples": len(examples),
                                                                                      "dpo_pairs": 0}


# Its seed is round 0's `train_policy` seed, as before it was a stage of its own: stored experiments reproduce.
STAGE = Stage(name="bootstrap", section="bootstrap", gpu=True, reads=(),
              writes=("problems", "trajectories", "selections", "models", "model_inputs", "turns"),
              inputs=Inputs, plan=plan, run=run, seed_name="train_policy")
