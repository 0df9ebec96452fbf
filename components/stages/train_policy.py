"""`train_policy` (rounds 1+): the trainer. SFT on the round's selections mixed with replayed earlier ones,
and/or DPO on the filter's pairs, or (recipe grpo) a clipped policy gradient on the round's groups; a round
that kept nothing carries its policy over unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.stages.base import (Planner, Stage, copy_model, domain_of, log, model_id, model_row, prompt_format_of,
                                    reward_scores, reward_steps, selected, sft_examples, steps_by_trajectory,
                                    train_progress, trainer_settings, write)


@dataclass
class Inputs:
    init_uri: str  # the previous round's policy (train_policy.init=previous) or round 0's
    parent_model_id: str
    replay_ratio: float
    dpo_reference_uri: str | None = None  # where train_policy.method trains on pairs
    dpo_reference_model_id: str | None = None
    judge_uri: str | None = None  # filter.judge=round: this round's PRM, which re-judges the replay pool
    judge_model_id: str | None = None


def plan(p: Planner) -> Inputs:
    tp = p.cfg.train_policy
    parent = p.model(p.round - 1 if tp.init == "previous" else 0)
    inputs = Inputs(init_uri=parent["uri"], parent_model_id=parent["model_id"], replay_ratio=tp.replay_ratio)
    if tp.method == "grpo":  # the round's own groups, no replay: on-policy
        if tp.grpo.beta > 0:
            ref = p.model(p.round - 1 if tp.grpo.reference == "previous" else 0)
            inputs.dpo_reference_uri, inputs.dpo_reference_model_id = ref["uri"], ref["model_id"]
        p.read("generate")
        p.read("filter")
        if tp.grpo.ptx_weight > 0:  # PPO-ptx: the round-0 demonstrations beside the rollouts
            p.read("bootstrap", 0)
        for r in _imitated_rounds(tp.grpo, p.round):  # and the round's own right answers, or every round's
            p.read("verify", r)
            if r < p.round:
                p.read("generate", r)
                p.read("filter", r)
        return inputs
    if tp.method != "sft":
        ref = p.model(p.round - 1 if tp.dpo.reference == "previous" else 0)
        inputs.dpo_reference_uri, inputs.dpo_reference_model_id = ref["uri"], ref["model_id"]
    if p.cfg.filter.judges_in_round and tp.replay_ratio > 0:
        judge = p.model(p.round, "prm")
        inputs.judge_uri, inputs.judge_model_id = judge["uri"], judge["model_id"]
    # This round's selections are new data; earlier rounds' (demos included) are the replay pool.
    p.read("bootstrap", 0)
    if p.committed("import", 0):
        p.read("import", 0)
    for r in range(1, p.round + 1):
        p.read("generate", r)
        p.read("filter", r)
    if tp.method != "sft" and p.cfg.filter.step_dpo_pairs:
        p.read("score")  # the step-level pairs' texts
    return inputs


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.training.data import replay_mix, sft_steps
    from components.training.sft import SFTParams, train_sft

    cfg, inp = spec.cfg(), spec.inputs_as(Inputs)
    tp = cfg.train_policy
    model_dir = out.artifact_dir("model")
    if tp.method == "grpo":
        return run_grpo(spec, out, inp, model_dir)
    new = selected(spec, spec.round)
    pool = {tid: t for r in range(spec.round) for tid, t in selected(spec, r).items() if tid not in new}
    judged_out = rejudge(spec, inp, pool) if inp.judge_uri else set()
    pool = {tid: t for tid, t in pool.items() if tid not in judged_out}
    chosen = replay_mix(new, pool, inp.replay_ratio, spec.seed)
    examples = sft_examples(spec, [t for _, t, _ in chosen])
    sft_inputs = [{"model_id": model_id(spec), "trajectory_id": tid, "source_round": t["round"], "use": use}
                  for tid, t, use in chosen]
    log("train_policy", f"{len(new)} new selections + {len(chosen) - len(new)} replayed from {len(pool)} earlier ones")
    steps = sft_steps(tp.steps, tp.epochs, len(examples), tp.batch_size)
    if not examples:
        log("train_policy", "WARNING: no trajectory was selected this round; the policy carries over unchanged")
    pairs, pair_inputs = round_pairs(spec) if tp.method != "sft" else ([], [])
    metrics: dict[str, Any] = {}
    dpo_from = inp.init_uri
    if tp.method != "dpo":
        # SFT first; with pairs to follow, its model is kept as an artifact of its own (lineage).
        sft_dir = model_dir if tp.method == "sft" or not pairs else out.artifact_dir("sft_model")
        log("train_policy", f"SFT on {len(examples)} examples, {steps} steps of batch {tp.batch_size}, "
                            f"from {inp.init_uri}")
        if steps > 0:
            metrics = train_sft(inp.init_uri, examples, str(sft_dir),
                                SFTParams(max_steps=steps, batch_size=tp.batch_size, learning_rate=tp.learning_rate,
                                          seed=spec.seed, **trainer_settings(cfg, "train_policy", tp.max_length,
                                                                             tp.gradient_accumulation_steps)),
                                progress_callback=train_progress("train_policy"))
        else:
            copy_model(inp.init_uri, sft_dir)
            metrics = {"train_loss": float("nan"), "steps": 0}
        dpo_from = str(sft_dir)
    model_inputs = sft_inputs
    if tp.method != "sft":
        # Under 'dpo' the SFT selections trained nothing; under 'sft+dpo' a chosen side is often an SFT example too.
        kept = sft_inputs if tp.method == "sft+dpo" else []
        known = {m["trajectory_id"] for m in kept}
        model_inputs = kept + [m for m in pair_inputs if m["trajectory_id"] not in known]
        if pairs:
            from components.training.dpo import DPOParams, train_dpo

            d = tp.dpo
            log("train_policy", f"DPO on {len(pairs)} pairs, {d.steps} steps, beta {d.beta}, from {dpo_from}, "
                                f"reference {inp.dpo_reference_model_id}")
            dpo = train_dpo(dpo_from, inp.dpo_reference_uri, pairs, str(model_dir),
                            DPOParams(max_steps=d.steps, batch_size=d.batch_size, learning_rate=d.learning_rate,
                                      beta=d.beta, sft_weight=d.sft_weight, seed=spec.seed,
                                      **trainer_settings(cfg, "train_policy.dpo", d.max_length)),
                            progress_callback=train_progress("train_policy"))
            metrics |= {f"dpo_{k}": v for k, v in dpo.items()}
        elif tp.method == "dpo":
            log("train_policy", "WARNING: no DPO pair this round; the policy carries over unchanged")
            copy_model(inp.init_uri, model_dir)
    write(out, models=[model_row(spec, "policy", model_dir, "model", inp.parent_model_id, len(model_inputs))],
          model_inputs=model_inputs)
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))} | {
        "examples": len(examples), "dpo_pairs": len(pairs)} | ({"replay_judged_out": len(judged_out)}
                                                                if inp.judge_uri else {})


def rejudge(spec: StageSpec, inp: Inputs, pool: dict[str, dict[str, Any]]) -> set[str]:
    """filter.judge=round: the replay pool's earlier right answers (not the demonstrations, round 0), judged again
    by this round's PRM; those whose weakest step it scores below filter.min_step_score (calibrated on the pool, with
    filter.judge_max_drop) leave the pool."""
    from components.filtering import judge_threshold

    earlier = [t for t in pool.values() if t["round"] > 0]
    if not earlier:
        return set()
    steps: dict[str, list[str]] = {}
    for r in sorted({t["round"] for t in earlier}):
        steps |= reward_steps(spec, "generate", round=r)
    f = spec.cfg().filter
    rows = [r for r in reward_scores(spec, "prm", inp.judge_uri, inp.judge_model_id, earlier, steps)
            if r["aggregate"] == "min"]
    threshold = judge_threshold([r["value"] for r in rows], f.min_step_score, f.judge_max_drop)
    out = {r["trajectory_id"] for r in rows if r["value"] < threshold}
    log("train_policy", f"replay re-judged by {inp.judge_model_id}: {len(out)} of {len(earlier)} earlier right "
                        f"answers score a step below {threshold:g} and leave the pool")
    return out


def run_grpo(spec: StageSpec, out: StageOutputWriter, inp: Inputs, model_dir) -> dict[str, float]:
    """TRL's GRPO loss on the groups the filter kept, with the advantages it stored (components/training/grpo.py)."""
    from components.envs.rollout import is_agent
    from components.models.backends import PromptEncoder
    from components.training.grpo import episode_rollout, step_token_advantages, text_ptx_examples

    cfg = spec.cfg()
    gen = cfg.generate
    rows = [a for a in spec.rows("filter", "advantages") if a["kept"]]
    adv = {a["trajectory_id"]: a for a in rows if a["turn_index"] == -1}
    trajs = [t for t in spec.rows("generate", "trajectories") if t["trajectory_id"] in adv]
    if not trajs:
        log("train_policy", "WARNING: no group has rewards that differ, so no rollout has a learning signal; the "
                            "policy carries over unchanged")
        copy_model(inp.init_uri, model_dir)
        write(out, models=[model_row(spec, "policy", model_dir, "model", inp.parent_model_id, 0)], model_inputs=[],
              rollout_logprobs=[])
        return {"steps": 0, "rollouts": 0}
    encoder = PromptEncoder.from_pretrained(inp.init_uri, None, prompt_format_of(cfg), gen.max_prompt_length,
                                            cfg.policy.max_truncated_fraction, "generate")
    trajs.sort(key=lambda t: (t["problem_id"], t["sample_index"]))
    if is_agent(domain_of(spec)):  # episodes: the conversation as sampled, observations masked out
        from components.envs.agent import ChatEncoder
        from components.envs.rollout import conversations

        chats = conversations(spec.rows("generate", "turns"))
        turn_adv: dict[str, dict[int, float]] = {}
        for a in rows:
            if a["turn_index"] >= 0:
                turn_adv.setdefault(a["trajectory_id"], {})[a["turn_index"]] = a["advantage"]
        chat = ChatEncoder(encoder.tok, inp.init_uri)
        rollouts = [episode_rollout(chat, t["trajectory_id"], t["problem_id"], chats[t["trajectory_id"]],
                                    adv[t["trajectory_id"]]["reward"],
                                    [v for _, v in sorted(turn_adv.get(t["trajectory_id"], {}).items())])
                    for t in trajs]
        per_turn = sum(isinstance(r["advantage"], list) for r in rollouts)
        if per_turn:
            log("train_policy", f"turn credit: {per_turn} of {len(rollouts)} episodes train each turn on its own "
                                "advantage")
        pools = [(tids, [_masked(*chat.encode(m["messages"], add_generation_prompt=False)) for m in rows])
                 for tids, rows in _ptx_pools(spec)]
        return _train_grpo(spec, out, inp, model_dir, rollouts, retokenized=0, ptx=pools) | {
            "turn_credit_rollouts": per_turn}
    prompts = sorted({t["prompt"] for t in trajs})
    prompt_ids = dict(zip(prompts, encoder.encode(prompts), strict=True))
    # credit=step: each step's advantage (filter), spread over the tokens that spell the step
    step_adv: dict[str, dict[int, float]] = {}
    for a in rows:
        if a["turn_index"] >= 0:
            step_adv.setdefault(a["trajectory_id"], {})[a["turn_index"]] = a["advantage"]
    steps = steps_by_trajectory(spec.rows("generate", "steps")) if step_adv else {}

    def decode(ids: list[int]) -> str:
        return encoder.tok.decode(ids, skip_special_tokens=True)

    retokenized = 0
    rollouts = []
    for t in trajs:
        tid, ids = t["trajectory_id"], t["token_ids"]
        if ids is None:  # a server that returns no ids: the text as the tokenizer reads it, and its EOS
            retokenized += 1
            ids = encoder.tok(t["completion"], add_special_tokens=False)["input_ids"] + encoder.eos_ids[:1]
        a = adv[tid]
        advantage: float | list[float] = a["advantage"]
        if tid in step_adv:
            by_step = step_adv[tid]
            advantage = step_token_advantages(decode, list(ids), steps.get(tid, []),
                                              [by_step[k] for k in sorted(by_step)], where=f"rollout {tid}")
        rollouts.append({"trajectory_id": tid, "group_id": t["problem_id"], "prompt_ids": prompt_ids[t["prompt"]],
                         "completion_ids": list(ids), "reward": a["reward"], "advantage": advantage})
    if step_adv:
        log("train_policy", f"step credit: {len(step_adv)} of {len(rollouts)} rollouts train on per-token advantages")
    pools = [(tids, text_ptx_examples(encoder, rows) if rows else []) for tids, rows in _ptx_pools(spec)]
    return _train_grpo(spec, out, inp, model_dir, rollouts, retokenized, ptx=pools) | (
        {"step_credit_rollouts": len(step_adv)} if step_adv else {})


PtxPool = tuple[list[Any], list[dict[str, Any]]]  # ids (the right answers': (id, round)) and what SFT reads of each


def _ptx_pools(spec: StageSpec) -> tuple[PtxPool, PtxPool]:
    """What PPO-ptx trains on, as SFT reads it ({"prompt", "completion"}, or an episode's {"messages"}), in a
    fixed order: the round-0 demonstrations (ptx_weight > 0), then the round's own right answers (ptx_pool
    right_answers), or every round's (all_right_answers): every group's, one of each distinct completion of a
    problem, without those whose steps failed the filter's checker or that its judge left out (ptx selections)."""
    g = spec.cfg().train_policy.grpo
    if g.ptx_weight <= 0:
        return ([], []), ([], [])
    demos = selected(spec, 0, demos_only=True)
    tids = sorted(demos)
    pool = (tids, sft_examples(spec, [demos[t] for t in tids]))
    rounds = _imitated_rounds(g, spec.round)
    if not rounds:
        return pool, ([], [])
    own: dict[tuple[str, str], dict[str, Any]] = {}
    right: set[str] = set()
    for r in rounds:
        ok = {v["trajectory_id"] for v in spec.rows("verify", "verifications", round=r) if v["correct"]}
        ok -= {a["trajectory_id"] for a in spec.rows("filter", "advantages", round=r)
               if a["turn_index"] == -1 and a["steps_checked"] is False}
        ok -= {s["trajectory_id"] for s in spec.rows("filter", "selections", round=r)  # filter.min_step_score's judge
               if s["purpose"] == "ptx" and not s["selected"]}
        right |= ok
        for t in sorted(spec.rows("generate", "trajectories", round=r),
                        key=lambda t: (t["problem_id"], t["sample_index"])):
            if t["trajectory_id"] in ok:
                own.setdefault((t["problem_id"], t["completion"]), t)
    log("train_policy", f"self-imitation: {len(own)} distinct right answers of {len(right)}"
                        + (f" from rounds 1-{spec.round}" if g.ptx_pool == "all_right_answers" else "")
                        + f" beside {len(tids)} demonstrations in each ptx batch")
    return pool, ([(t["trajectory_id"], t["round"]) for t in own.values()], sft_examples(spec, list(own.values())))


def _imitated_rounds(g: Any, round: int) -> range:
    """The rounds whose right answers train_policy.grpo.ptx_pool imitates in `round`: none (demonstrations), this
    one (right_answers), or 1 to this one (all_right_answers)."""
    if g.ptx_pool == "demonstrations":
        return range(0)
    return range(1 if g.ptx_pool == "all_right_answers" else round, round + 1)


def _masked(ids: list[int], mask: list[int]) -> dict[str, list[int]]:
    """An episode as a PPO-ptx example: its ids, the loss on the assistant's tokens alone."""
    return {"input_ids": list(ids), "labels": [i if m else -100 for i, m in zip(ids, mask, strict=True)]}


def _train_grpo(spec: StageSpec, out: StageOutputWriter, inp: Inputs, model_dir, rollouts: list[dict[str, Any]],
                retokenized: int, ptx: list[tuple[list[Any], list[dict[str, list[int]]]]]) -> dict[str, float]:
    """TRL's GRPO on `rollouts`; `ptx`: the demonstrations (ids, examples), then the right answers ((id, round),
    examples)."""
    from components.training.grpo import GRPOParams, train_grpo

    cfg = spec.cfg()
    g, gen = cfg.train_policy.grpo, cfg.generate
    settings = trainer_settings(cfg, "train_policy.grpo", cfg.train_policy.max_length)
    params = GRPOParams(num_generations=gen.samples_per_problem, groups_per_step=g.groups_per_step,
                        num_iterations=g.num_iterations, learning_rate=g.learning_rate,
                        lr_scheduler=g.lr_scheduler, loss_type=g.loss_type,
                        beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
                        ptx_weight=g.ptx_weight, ptx_batch_size=g.ptx_batch_size,
                        temperature=gen.temperature or 1.0, seed=spec.seed,
                        **{k: settings[k] for k in ("prompt_format", "dtype", "lora", "gradient_checkpointing",
                                                    "setting")})
    log("train_policy", f"GRPO ({g.loss_type}) on {len(rollouts)} rollouts in {len(rollouts) // params.num_generations} "
                        f"groups, {g.groups_per_step} groups per step, {g.num_iterations} pass(es), from {inp.init_uri}"
                        + (f", beta {g.beta} to {inp.dpo_reference_model_id}" if g.beta > 0 else "")
                        + (f", ptx {g.ptx_weight:g} on {len(ptx[0][1])} demonstrations" if g.ptx_weight > 0 else "")
                        + (f" and {len(ptx[1][1])} right answers" if ptx[1][1] else ""))
    metrics, logprobs = train_grpo(inp.init_uri, inp.dpo_reference_uri, rollouts, str(model_dir), params,
                                   progress_callback=train_progress("train_policy"), ptx_examples=ptx[0][1],
                                   ptx_own=ptx[1][1])
    mid = model_id(spec)
    uses = {r["trajectory_id"]: (spec.round, "grpo") for r in rollouts}
    for t, r in ptx[1][0]:  # a right answer both in a learning group and imitated: 'grpo+ptx'
        uses[t] = (r, "grpo+ptx" if t in uses else "ptx")
    uses |= {t: (0, "ptx") for t in ptx[0][0]}
    write(out, models=[model_row(spec, "policy", model_dir, "model", inp.parent_model_id, len(rollouts))],
          model_inputs=[{"model_id": mid, "trajectory_id": t, "source_round": r, "use": u}
                        for t, (r, u) in uses.items()],
          rollout_logprobs=[{"model_id": mid} | r for r in logprobs])
    return {k: float(v) for k, v in metrics.items()} | {"retokenized": retokenized}


def round_pairs(spec: StageSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """This round's DPO pairs ({"prompt", "chosen", "rejected"}; for an environment, the two episodes' chats),
    trajectory-level then step-level, and their `model_inputs` rows (a trajectory once, at its first use)."""
    from components.envs.rollout import conversations, is_agent

    trajs = {t["trajectory_id"]: t for t in spec.rows("generate", "trajectories")}
    sides: dict[str, dict[str, str]] = {}
    step_ids: list[str] = []
    for s in spec.rows("filter", "selections"):
        if s["selected"] and s["purpose"] in ("dpo_chosen", "dpo_rejected"):
            sides.setdefault(s["pair_id"], {})[s["purpose"]] = s["trajectory_id"]
        elif s["selected"] and s["purpose"] == "step_dpo":
            step_ids.append(s["trajectory_id"])
    pairs, uses = [], []
    chats = conversations(spec.rows("generate", "turns")) if (sides or step_ids) and is_agent(domain_of(spec)) \
        else None
    for pid in sorted(sides):
        c, r = trajs[sides[pid]["dpo_chosen"]], trajs[sides[pid]["dpo_rejected"]]
        if chats is not None:  # two episodes of one problem, as sampled: DPO masks their observations out
            pairs.append({"chosen": chats[c["trajectory_id"]], "rejected": chats[r["trajectory_id"]]})
        else:
            pairs.append({"prompt": c["prompt"], "chosen": c["completion"], "rejected": r["completion"]})
        uses += [(c["trajectory_id"], "dpo_chosen"), (r["trajectory_id"], "dpo_rejected")]
    if step_ids:
        # Both sides share the live prefix, so its log-ratios cancel in the DPO margin: the preference falls on
        # the dead step and what follows it.
        step = {p["trajectory_id"]: p for p in spec.rows("score", "step_pairs")}
        for tid in sorted(step_ids):
            sp = step[tid]
            if chats is not None:  # two episodes of one turn tree, the same turns up to where they part
                pairs.append(_turn_pair(chats, sp))
            else:
                pairs.append({"prompt": trajs[tid]["prompt"], "chosen": sp["prefix"] + sp["chosen"],
                              "rejected": sp["prefix"] + sp["rejected"]})
            uses += [(tid, "step_dpo_rejected")] + ([] if sp["chosen_from"] == "rollout"
                                                    else [(sp["chosen_from"], "step_dpo_chosen")])
    inputs, seen = [], set()
    for tid, use in uses:
        if tid not in seen:
            seen.add(tid)
            inputs.append({"model_id": model_id(spec), "trajectory_id": tid, "source_round": spec.round, "use": use})
    return pairs, inputs


def _turn_pair(chats: dict[str, list[dict[str, Any]]], sp: dict[str, Any]) -> dict[str, Any]:
    """A step pair of an environment (from a turn tree): the right episode's chat against the wrong one's. Their
    first `step_index` assistant turns, with what the environment answered, are the same nodes, so the same
    messages, and cancel in the DPO margin as a text pair's shared prefix does. (Each side keeps its own sampled
    ids: two episodes seeded into one node by score.tree.search wrote the same text, not always with the same
    tokens.)"""
    right, wrong = sp["chosen_from"], sp["trajectory_id"]
    if right not in chats or wrong not in chats:
        raise RuntimeError(f"step pair of {wrong}: {right if right not in chats else wrong} has no stored turns "
                           "(an environment's step pairs come from its turn tree, both sides stored episodes)")
    c, r = chats[right], chats[wrong]
    starts = [i for i, m in enumerate(r) if m["role"] == "assistant"]
    cut = starts[sp["step_index"]] if sp["step_index"] < len(starts) else len(r)
    if [(m["role"], m["content"].strip()) for m in c[:cut]] != [(m["role"], m["content"].strip()) for m in r[:cut]]:
        raise RuntimeError(f"step pair of {wrong}: its first {sp['step_index']} turns differ from {right}'s, "
                           "though the tree says they share them")
    return {"chosen": c, "rejected": r}


STAGE = Stage(name="train_policy", section="train_policy", gpu=True,
              reads=("bootstrap", "import", "generate", "verify", "filter", "score"),
              writes=("models", "model_inputs", "rollout_logprobs"), inputs=Inputs, plan=plan, run=run)
