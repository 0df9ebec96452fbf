"""`generate`: sample the previous round's policy on the round's curriculum problems (optionally until
right, optionally step by step under the previous PRM)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.seeding import derive_seed
from components.domains.base import unique_problems
from components.envs.rollout import is_agent
from components.stages.base import (Planner, PlanningError, Stage, agent_sampler, backend_metrics, backend_of,
                                   domain_of, log, merged_counts, reward_model_of, write)


@dataclass
class Inputs:
    levels: list[int]
    policy_uri: str
    policy_model_id: str
    problem_seeds: dict[str, int]  # one per level (the shard), so adding a level does not reshuffle the others
    search_prm_uri: str | None = None  # the previous round's PRM, where generate.search (or mcts.value=prm) is on
    search_prm_id: str | None = None


def plan(p: Planner) -> Inputs:
    cfg, exp = p.cfg, p.cfg.experiment
    levels = p.store.round_plan(exp, p.round)
    if levels is None:
        raise PlanningError(f"{exp} round {p.round}: no curriculum plan")
    policy = p.model(p.round - 1)
    inputs = Inputs(levels=levels, policy_uri=policy["uri"], policy_model_id=policy["model_id"],
                    problem_seeds={str(lv): derive_seed(cfg.seed, p.round, "problems", lv) for lv in levels})
    g = cfg.generate
    guided = g.search is not None or (g.mcts is not None and g.mcts.value == "prm")
    prm = p.optional_model(p.round - 1, "prm") if guided else None
    if prm:  # round 1 has no PRM yet: it samples plainly
        inputs.search_prm_uri, inputs.search_prm_id = prm["uri"], prm["model_id"]
    return inputs


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.generation import generate

    cfg, domain, inp = spec.cfg(), domain_of(spec), spec.inputs_as(Inputs)
    g = cfg.generate
    problems = []
    for level in inp.levels:
        problems += domain.sample_problems(level, g.problems_per_level, seed=inp.problem_seeds[str(level)])
    problems = unique_problems(problems)
    if spec.shards > 1:
        mine = spec.share(p.problem_id for p in problems)
        problems = [p for p in problems if p.problem_id in mine]
    per = (f"up to {g.samples_per_problem} samples each, {g.wave_size} per wave until {g.until_correct} right"
           if g.until_correct else f"one MCTS tree each, up to {g.samples_per_problem} solutions from it"
           if g.mcts else f"{g.samples_per_problem} samples each")
    log("generate", f"{len(problems)} problems at levels {inp.levels}, {per}"
                    + (f" (shard {spec.shard} of {spec.shards})" if spec.shards > 1 else ""))
    t0 = time.perf_counter()
    backend = backend_of(spec, inp.policy_uri)
    if is_agent(domain):
        if g.mcts is not None:
            return _episode_mcts(spec, out, domain, backend, inp, problems, t0)
        return _episodes(spec, out, domain, backend, inp, problems, t0)
    if g.mcts is not None:
        return _mcts(spec, out, domain, backend, inp, problems, t0)
    search_stats: dict[str, float] = {}
    search = _step_search(spec, domain, backend, inp, search_stats) if inp.search_prm_uri else None
    wave_stats: dict[str, float] = {}
    kw = dict(experiment=spec.experiment, round=spec.round, purpose="train", policy_model_id=inp.policy_model_id,
              temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens, sample=search)
    if g.until_correct is None:
        batch = generate(domain, backend, problems, n=g.samples_per_problem, seed=spec.seed, **kw)
    else:
        from components.generation import generate_until_correct
        from components.verification import resolve_verifier

        # The verify stage's own function, so "right" here is what it will store.
        _, verifier = resolve_verifier(domain, cfg.verify.verifier)
        batch, wave_stats = generate_until_correct(
            domain, backend, problems, verifier=verifier, want=g.until_correct, wave_size=g.wave_size,
            n=g.samples_per_problem, seed=spec.seed, progress=lambda msg: log("generate", msg), **kw)
    dt = time.perf_counter() - t0
    write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps)
    log("generate", f"{len(batch.trajectories)} trajectories, {batch.num_tokens} tokens in {dt:.1f}s")
    metrics = {"trajectories": len(batch.trajectories), "problems": len(problems), "tokens": batch.num_tokens,
               "tokens_per_s": batch.num_tokens / max(dt, 1e-9)}
    metrics |= backend_metrics(backend)
    metrics |= {f"adaptive_{k}": float(v) for k, v in wave_stats.items()}
    if search_stats:
        # Discarded step draws are generation too: v_round_summary counts them in the round's budget.
        metrics |= {f"search_{k}": float(v) for k, v in search_stats.items()}
        log("generate", f"search: {search_stats['redraws']} redrawn steps, {search_stats['discarded_tokens']} "
                        f"discarded tokens, {search_stats['accepted_below_threshold']} steps kept below threshold")
    return metrics


def _episodes(spec: StageSpec, out: StageOutputWriter, env, backend, inp: Inputs, problems: list, t0: float,
              ) -> dict[str, float]:
    """An environment's round: `samples_per_problem` episodes per problem, every live one stepped in one batch,
    plainly or (generate.search, once a PRM exists) each turn drawn until the previous round's PRM accepts it
    (`prm_turn_search`); with generate.until_correct, in waves until enough are right."""
    from components.envs.rollout import (EpisodeBatch, episode_batch, episode_stats, episodes_until_right,
                                         run_episodes)
    from components.search.episodes import prm_turn_search

    g = spec.cfg().generate
    samplers = []

    def sampler(seed: int, temperature: float = g.temperature):
        samplers.append(agent_sampler(backend, inp.policy_uri, temperature=temperature, top_p=g.top_p,
                                      max_new_tokens=g.max_new_tokens, seed=seed))
        return samplers[-1]

    meta = dict(experiment=spec.experiment, round=spec.round, purpose="train", policy_model_id=inp.policy_model_id,
                temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens)
    prm = reward_model_of(spec, "prm", inp.search_prm_uri) if inp.search_prm_uri else None
    s, searched = g.search, {}
    if prm is not None:
        if hasattr(backend, "progress"):
            backend.progress = False  # its per-call counts, a call per try, would drown the search's
        log("generate", f"PRM-guided turns ({inp.search_prm_id}): up to {s.max_tries} draws per turn, keep at P(good) "
                        f">= {s.threshold}" + (f", redraw at temperature {s.redraw_temperature}"
                                               if s.redraw_temperature is not None else ""))

    def run_wave(pending: list, k: int, seed: int, first: int) -> EpisodeBatch:
        if prm is None:
            return run_episodes(env, sampler(seed), pending, n=k, seed=seed, first_sample_index=first, **meta)[0]
        redraw = None if s.redraw_temperature is None else sampler(
            derive_seed(seed, spec.round, "generate.redraw"), s.redraw_temperature)
        records, got = prm_turn_search(env, sampler(seed), pending, prm.score_steps, n=k, max_tries=s.max_tries,
                                       threshold=s.threshold, max_steps=s.max_steps, redraw=redraw)
        for key, v in got.items():  # summed over waves
            searched[key] = searched.get(key, 0) + v
        return episode_batch(env, records, k, first, seed=seed, **meta)

    waves: dict[str, float] = {}
    if g.until_correct is None:
        batch = run_wave(problems, g.samples_per_problem, spec.seed, 0)
        stats = episode_stats(batch.records)
    else:
        batch, stats, waves = episodes_until_right(run_wave, problems, want=g.until_correct, wave_size=g.wave_size,
                                                   n=g.samples_per_problem, seed=spec.seed,
                                                   progress=lambda msg: log("generate", msg))
    dt = time.perf_counter() - t0
    write(out, **batch.tables)
    tokens = sum(t["num_tokens"] for t in batch.trajectories)
    log("generate", f"{len(batch.trajectories)} episodes, {int(stats['assistant_turns'])} assistant turns, "
                    f"{int(stats['tool_calls'])} tool calls ({int(stats['tool_errors'])} failed), {tokens} tokens in "
                    f"{dt:.1f}s; {stats['env_share']:.0%} of the loop's time in the environment")
    if searched:
        log("generate", f"search: {searched['steps']} guided turns from {searched['draws']} draws "
                        f"({searched['redraws']} redrawn, {searched['accepted_below_threshold']} kept below "
                        f"threshold), {searched['discarded_tokens']} tokens discarded")
    return ({"trajectories": len(batch.trajectories), "problems": len(problems), "tokens": tokens,
             "tokens_per_s": searched.get("generated_tokens", tokens) / max(dt, 1e-9),
             "prompt_tokens": sum(x.prompt_tokens for x in samplers),
             "context_full": sum(x.context_full for x in samplers)}
            | {f"agent_{k}": float(v) for k, v in stats.items()} | {f"adaptive_{k}": float(v) for k, v in waves.items()}
            | {f"search_{k}": float(v) for k, v in searched.items()} | backend_metrics(backend))


def _episode_mcts(spec: StageSpec, out: StageOutputWriter, env, backend, inp: Inputs, problems: list, t0: float,
                  ) -> dict[str, float]:
    """An environment's round by MCTS over turns: a tree per problem, a node an assistant turn with what the
    environment answered; its best finished episodes (then its rollouts') are the trajectories."""
    from components.envs.rollout import env_share, episode_stats, search_episodes

    g = spec.cfg().generate
    m = g.mcts
    prm = reward_model_of(spec, "prm", inp.search_prm_uri) if inp.search_prm_uri else None
    source = f"the PRM {inp.search_prm_id}" if prm else f"{m.rollouts} rollouts per episode so far"
    budget = f", {m.token_budget} tokens per problem" if m.token_budget else ""
    log("generate", f"MCTS over turns: {m.simulations} simulations, {m.expansions} draws per expansion, c_puct "
                    f"{m.c_puct}, values from {source}{budget}")
    if hasattr(backend, "progress"):
        backend.progress = False  # its per-call counts would interleave with the simulations', which say more
    sampler = agent_sampler(backend, inp.policy_uri, temperature=g.temperature, top_p=g.top_p,
                            max_new_tokens=g.max_new_tokens, seed=spec.seed)
    batch, nodes, stats = search_episodes(
        env, sampler, problems, m, n=g.samples_per_problem, experiment=spec.experiment, round=spec.round,
        purpose="train", policy_model_id=inp.policy_model_id, seed=spec.seed, temperature=g.temperature,
        top_p=g.top_p, max_new_tokens=g.max_new_tokens, progress=lambda msg: log("generate", msg),
        score_steps=prm.score_steps if prm else None)
    dt = time.perf_counter() - t0
    write(out, **batch.tables, nodes=nodes)
    tokens = sum(t["num_tokens"] for t in batch.trajectories)
    # The episodes kept, as the loop counts them; the time is the whole search's, every expansion and rollout.
    agent = episode_stats(batch.records) | {"env_seconds": stats["env_seconds"], "gen_seconds": stats["gen_seconds"],
                                            "env_share": env_share(stats["env_seconds"], stats["gen_seconds"])}
    log("generate", f"{len(batch.trajectories)} episodes from {len(problems)} trees of {stats['nodes']} turns; "
                    f"{stats['generated_tokens']} tokens generated in {dt:.1f}s, {stats['right_leaves']} right leaves")
    return ({"trajectories": len(batch.trajectories), "problems": len(problems), "tokens": tokens,
             "tokens_per_s": stats["generated_tokens"] / max(dt, 1e-9), "prompt_tokens": sampler.prompt_tokens,
             "context_full": sampler.context_full}
            | {f"agent_{k}": float(v) for k, v in agent.items()}
            | {f"search_{k}": float(v) for k, v in stats.items()} | backend_metrics(backend))


def _mcts(spec: StageSpec, out: StageOutputWriter, domain, backend, inp: Inputs, problems: list, t0: float,
          ) -> dict[str, float]:
    """A tree per problem; its best terminal leaves (then nodes its rollouts completed) are the trajectories, and
    every node goes to `nodes`."""
    from components.generation import generate_mcts
    from components.search.policy import prm_value

    g = spec.cfg().generate
    m = g.mcts
    value = None
    if inp.search_prm_uri:
        value = prm_value(domain, reward_model_of(spec, "prm", inp.search_prm_uri).score_steps)
    source = (f"the PRM {inp.search_prm_id}" if value else f"{m.rollouts} rollouts per prefix")
    budget = f", {m.token_budget} tokens per problem" if m.token_budget else ""
    log("generate", f"MCTS: {m.simulations} simulations, {m.expansions} draws per expansion, c_puct {m.c_puct}, "
                    f"values from {source}{budget}")
    if hasattr(backend, "progress"):
        backend.progress = False  # its per-call counts would interleave with the simulations', which say more
    batch, nodes, stats = generate_mcts(
        domain, backend, problems, m, experiment=spec.experiment, round=spec.round, purpose="train",
        policy_model_id=inp.policy_model_id, n=g.samples_per_problem, temperature=g.temperature, top_p=g.top_p,
        max_new_tokens=g.max_new_tokens, seed=spec.seed, value=value, progress=lambda msg: log("generate", msg))
    dt = time.perf_counter() - t0
    write(out, problems=batch.problems, trajectories=batch.trajectories, steps=batch.steps, nodes=nodes)
    log("generate", f"{len(batch.trajectories)} trajectories from {len(problems)} trees of {stats['nodes']} nodes; "
                    f"{stats['generated_tokens']} tokens generated in {dt:.1f}s, {stats['right_leaves']} right leaves")
    # The round's budget (v_round_summary) is the trajectories' tokens plus search_discarded_tokens: the whole
    # search's. The difference is negative where returned leaves share steps, which each trajectory counts.
    return ({"trajectories": len(batch.trajectories), "problems": len(problems), "tokens": batch.num_tokens,
             "tokens_per_s": stats["generated_tokens"] / max(dt, 1e-9)}
            | {f"search_{k}": float(v) for k, v in stats.items()} | backend_metrics(backend))


def _step_search(spec: StageSpec, domain, backend, inp: Inputs, stats: dict[str, float]):
    """A `sample` function for `generate`: each step drawn until the previous round's PRM accepts it."""
    from components.search import prm_step_search

    s = spec.cfg().generate.search
    scorer = reward_model_of(spec, "prm", inp.search_prm_uri)  # no max_length: each new step is scored
    log("generate", f"PRM-guided steps ({inp.search_prm_id}): up to {s.max_tries} draws "
                    f"per step, keep at P(good) >= {s.threshold}"
                    + (f", redraw at temperature {s.redraw_temperature}" if s.redraw_temperature is not None else ""))

    def search(prompts, n, temperature, top_p, max_new_tokens, seed, stop=None):
        out, got = prm_step_search(domain, backend, scorer.score_steps, prompts, n=n, max_tries=s.max_tries,
                                   threshold=s.threshold, temperature=temperature, top_p=top_p,
                                   max_new_tokens=max_new_tokens, seed=seed, max_steps=s.max_steps,
                                   redraw_temperature=s.redraw_temperature, progress=lambda msg: log("generate", msg))
        for k, v in got.items():  # summed over waves (generate.until_correct)
            stats[k] = stats.get(k, 0) + v
        return out
    return search


def merge(spec: StageSpec, shard_metrics: list[dict[str, float]], read) -> tuple[dict[str, float], dict]:
    """The shards sampled side by side: their counts add up, and so do their throughputs."""
    return merged_counts(shard_metrics, maxed=("adaptive_waves",)), {}


STAGE = Stage(name="generate", section="generate", gpu=True, reads=(),
              writes=("problems", "trajectories", "steps", "turns", "nodes"),
              inputs=Inputs, plan=plan, run=run, samples=True, merge=merge)
