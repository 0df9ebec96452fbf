"""`score`: outcome scores, Monte Carlo step labels (the labeller), oracle step labels for evaluation, and the
previous round's reward model's scores."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from components.envs.rollout import episode_steps, is_agent
from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.rewards import REWARD_MODELS, TRAINED
from components.seeding import derive_seed
from components.stages.base import (Planner, Stage, agent_sampler, backend_metrics, backend_of, confidence_judge,
                                    domain_of, log, merged_counts, problems_by_id, reward_model_of, reward_scores,
                                    reward_steps, write)


@dataclass
class Inputs:
    policy_uri: str  # the policy that sampled the round: it rolls out the Monte Carlo labels
    policy_model_id: str
    reward_model: str | None = None  # config name or dotted path; None: no reward model scores this round
    reward_model_uri: str | None = None
    reward_model_id: str | None = None
    reference_uri: str | None = None  # the implicit PRM's reference
    tree_values: str | None = None  # score.tree: what valued the MCTS tree's open nodes, rollouts or prm
    tree_prm_uri: str | None = None  # score.tree.search with value=prm: the previous round's PRM, where one exists


def plan(p: Planner) -> Inputs:
    p.read("generate")
    p.read("verify")
    cfg = p.cfg
    policy = p.model(p.round - 1)
    inputs = Inputs(policy_uri=policy["uri"], policy_model_id=policy["model_id"])
    rm = cfg.score.reward_model
    if rm == "implicit":
        if p.round > 1:  # round 1's policy is the reference itself: a log-ratio of 0 everywhere
            inputs = Inputs(policy["uri"], policy["model_id"], rm, policy["uri"], policy["model_id"],
                            p.model(0)["uri"])
    elif rm == "confidence":  # the sampler (or score.confidence_model) scores the steps, round 1 too
        inputs = Inputs(policy["uri"], policy["model_id"], rm, *confidence_judge(cfg, policy))
    elif rm in TRAINED:
        trained = p.optional_model(p.round - 1, rm)
        if trained:  # round 1 has no earlier reward model: it is scored by Monte Carlo labels and outcome only
            inputs = Inputs(policy["uri"], policy["model_id"], rm, trained["uri"], trained["model_id"])
    elif rm not in ("none", "env") and rm not in REWARD_MODELS:  # a user's, by dotted path: nothing to train
        inputs = Inputs(policy["uri"], policy["model_id"], rm, None, rm)
    if cfg.score.tree is not None:  # as generate plans it: the previous PRM where value=prm and one exists
        search = cfg.score.tree.search or cfg.generate.mcts
        prm = search.value == "prm" and p.optional_model(p.round - 1, "prm")
        inputs.tree_values = "prm" if prm else "rollouts"
        if prm and cfg.score.tree.search is not None:
            inputs.tree_prm_uri = prm["uri"]
    return inputs


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.labeling import mc_first_error_labels, mc_step_labels, oracle_labels
    from components.scoring import choose_for_mc, outcome_scores, plan_first_error

    cfg, domain, inp = spec.cfg(), domain_of(spec), spec.inputs_as(Inputs)
    sc = cfg.score
    trajs = spec.rows("generate", "trajectories")
    vers = spec.rows("verify", "verifications")
    # An environment's turns, read once: its steps, its Monte Carlo labels and its reward models all need them.
    turns = spec.rows("generate", "turns") if is_agent(domain) else None
    steps = episode_steps(turns) if turns is not None else reward_steps(spec, "generate")
    problems = problems_by_id(spec.rows("generate", "problems"))
    # Which trajectories get Monte Carlo labels is planned over the whole round, with the stage's seed (a
    # shard's own seed drives only its rollouts), so the shards share one plan and one budget.
    plan_seed = derive_seed(cfg.seed, spec.round, spec.stage)
    if spec.shards > 1:
        mine = spec.share(t["problem_id"] for t in trajs)
    rows: list[dict[str, Any]] = []
    labels: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []  # step-level preference pairs, from the first_error search
    items = [{"trajectory_id": t["trajectory_id"], "problem_id": t["problem_id"], "prompt": t["prompt"],
              "steps": steps.get(t["trajectory_id"], []), "answer_ref": problems[t["problem_id"]].answer,
              "problem": problems[t["problem_id"]]} for t in trajs]
    if sc.mc_rollouts:
        correct = {v["trajectory_id"]: v["correct"] for v in vers}
        if sc.mc_strategy == "first_error":
            chosen, alive = plan_first_error(trajs, correct, sc.mc_max_trajectories, plan_seed, sc.mc_search_unsolved)
            for it in items:
                it["root_alive"] = it["problem_id"] in alive
        else:
            chosen = set(choose_for_mc(trajs, correct, sc.mc_max_trajectories, plan_seed))
    if spec.shards > 1:
        trajs = [t for t in trajs if t["problem_id"] in mine]
        items = [it for it in items if it["problem_id"] in mine]
        vers = [v for v in vers if v["trajectory_id"] in {t["trajectory_id"] for t in trajs}]
    rows += outcome_scores(vers)
    metrics: dict[str, float] = {"scored": len(trajs)}
    if sc.mc_rollouts:
        todo = [it for it in items if it["trajectory_id"] in chosen]
        log("score", f"Monte Carlo labels ({sc.mc_strategy}): {len(todo)} trajectories, k={sc.mc_rollouts} rollouts "
                     "per step prefix")
        t0 = time.perf_counter()
        backend = backend_of(spec, inp.policy_uri)
        kw = dict(k=sc.mc_rollouts, temperature=sc.mc_temperature,
                  max_new_tokens=sc.mc_max_new_tokens or cfg.generate.max_new_tokens, seed=spec.seed)
        if turns is not None:
            mc, stats = _turn_labels(spec, domain, backend, inp, todo, correct, turns)
        elif sc.mc_strategy == "first_error":
            mc, stats, pairs = mc_first_error_labels(domain, backend, todo, **kw)
            stats["step_pairs"] = len(pairs)
        else:
            mc, stats = mc_step_labels(domain, backend, todo, **kw)
        labels += mc
        metrics |= {f"mc_{k}": float(v) for k, v in stats.items()} | {"mc_seconds": time.perf_counter() - t0}
        metrics |= backend_metrics(backend)
        log("score", f"{stats['rollouts']} rollouts from {stats['unique_prefixes']} distinct prefixes, "
                     f"{stats['generated_tokens']} tokens"
                     + (f"; {stats['replay_mismatches']} resumed episodes whose environment answered the stored "
                        "turns otherwise (WARNING: not deterministic)" if stats.get("replay_mismatches") else ""))
    nodes: list[dict[str, Any]] = []  # the trees score grows (score.tree.search)
    if sc.tree is not None:
        correct = {v["trajectory_id"]: v["correct"] for v in vers}
        placed = None
        if sc.tree.search is not None:
            nodes, placed = _grow_trees(spec, inp, trajs, steps, correct, problems, metrics, turns)
            tree = nodes
        else:
            mine = {x["problem_id"] for x in trajs}  # this shard's
            tree = [n for n in spec.rows("generate", "nodes") if n["problem_id"] in mine]
            if not tree:
                raise RuntimeError(f"{spec.stage_run_id}: score.tree labels from generate.mcts's trees, but generate "
                                   "wrote no `nodes` this round")
        tree_pairs = _tree_data(spec, tree, placed, trajs, steps, correct, labels, metrics,
                                rollouts_valued=inp.tree_values == "rollouts")
        searched = {p["trajectory_id"] for p in pairs}  # a wrong answer keeps the Monte Carlo search's pair
        pairs += [p for p in tree_pairs if p["trajectory_id"] not in searched]
        metrics["step_pairs"] = len(pairs)
    if sc.oracle_labels:
        oracle = oracle_labels(domain, problems, [it for it in items if it["steps"]])
        labels += oracle  # for evaluation only: train_reward reads its label_source alone
        metrics["oracle_labelled_steps"] = len(oracle)
    if sc.reward_model == "env":  # the environment's own turn rewards, stored with the turns: nothing to load
        from components.envs.labels import env_score_rows

        rows += env_score_rows(trajs, turns)
        log("score", f"the environment's turn rewards scored {len(trajs)} episodes")
    if inp.reward_model is not None:
        rows += reward_scores(spec, inp.reward_model, inp.reward_model_uri, inp.reward_model_id, trajs, steps,
                              reference_uri=inp.reference_uri, turns=turns)
        log("score", f"{inp.reward_model} {inp.reward_model_id} scored {len(trajs)} trajectories")
    write(out, scores=rows, step_labels=labels, step_pairs=pairs, nodes=nodes)
    return metrics | mean_scores(rows, len(trajs), inp.reward_model is not None or sc.reward_model == "env")


def _turn_labels(spec: StageSpec, env: Any, backend: Any, inp: Inputs, items: list[dict[str, Any]],
                 correct: dict[str, bool | None], turns: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An environment's Monte Carlo labels: each assistant turn valued by going on from it, with its observations,
    k times, at every turn or (`mc_strategy: first_error`) at the turns a bisection of the wrong episodes visits
    (`components.envs.labels`)."""
    from components.envs.labels import mc_first_error_turn_labels, mc_turn_labels
    from components.envs.rollout import conversations

    cfg = spec.cfg()
    sc = cfg.score
    chats = conversations(turns)
    missing = [it["trajectory_id"] for it in items if it["trajectory_id"] not in chats]
    if missing:
        raise RuntimeError(f"{spec.stage_run_id}: {len(missing)} episodes to label have no stored turns "
                           f"(first: {missing[0]})")
    todo = [{"trajectory_id": it["trajectory_id"], "problem": it["problem"], "messages": chats[it["trajectory_id"]],
             "correct": correct.get(it["trajectory_id"]), "root_alive": it.get("root_alive", True)} for it in items]
    sampler = agent_sampler(backend, inp.policy_uri, temperature=sc.mc_temperature, top_p=1.0,
                            max_new_tokens=sc.mc_max_new_tokens or cfg.generate.max_new_tokens, seed=spec.seed)
    labels = mc_first_error_turn_labels if sc.mc_strategy == "first_error" else mc_turn_labels
    return labels(env, sampler, todo, k=sc.mc_rollouts)


def _grow_trees(spec: StageSpec, inp: Inputs, trajs: list[dict[str, Any]], steps: dict[str, list[str]],
                correct: dict[str, bool | None], problems: dict[str, Any], metrics: dict[str, float],
                turns: list[dict[str, Any]] | None = None,
                ) -> tuple[list[dict[str, Any]], dict[str, tuple[str, int]]]:
    """score.tree.search: a tree per problem, grown from the round's solutions (an environment's: its episodes, a
    node a turn, given their `turns`) with the policy that sampled them."""
    from components.search.policy import prm_value
    from components.search.training import grow_label_trees

    cfg, domain = spec.cfg(), domain_of(spec)
    m = cfg.score.tree.search
    score_steps = reward_model_of(spec, "prm", inp.tree_prm_uri).score_steps if inp.tree_prm_uri else None
    value = prm_value(domain, score_steps) if score_steps and turns is None else None
    source = "the previous PRM" if score_steps else f"{m.rollouts} rollouts per prefix"
    budget = f", {m.token_budget} tokens per problem" if m.token_budget else ""
    log("score", f"MCTS from the round's solutions: {m.simulations} simulations, {m.expansions} draws per "
                 f"expansion, c_puct {m.c_puct}, values from {source}{budget}")
    t0 = time.perf_counter()
    backend = backend_of(spec, inp.policy_uri)
    if hasattr(backend, "progress"):
        backend.progress = False  # its per-call counts would interleave with the simulations', which say more
    seed, report = (derive_seed(spec.seed, spec.round, "score.tree"),
                    lambda sim, spent: log("score", f"simulation {sim}/{m.simulations}: {spent} tokens"))
    max_new_tokens = cfg.score.mc_max_new_tokens or cfg.generate.max_new_tokens
    if turns is not None:
        from components.search.episodes import grow_episode_trees
        from components.search.training import label_tree_rows

        sampler = agent_sampler(backend, inp.policy_uri, temperature=cfg.generate.temperature,
                                top_p=cfg.generate.top_p, max_new_tokens=max_new_tokens, seed=seed)
        owners, trees, leaf_of, counts = grow_episode_trees(domain, sampler, problems, trajs, turns, correct, m,
                                                            score_steps=score_steps, progress=report)
        nodes, placed = label_tree_rows(owners, trees, leaf_of, experiment=spec.experiment, round=spec.round)
    else:
        nodes, placed, counts = grow_label_trees(
            domain, backend, problems, trajs, steps, correct, m, experiment=spec.experiment, round=spec.round,
            seed=seed, temperature=cfg.generate.temperature, top_p=cfg.generate.top_p, max_new_tokens=max_new_tokens,
            value=value, progress=report)
    metrics |= {f"tree_search_{k}": float(v) for k, v in counts.items()}
    metrics["tree_search_seconds"] = time.perf_counter() - t0
    log("score", f"{counts['trees']} trees from {len(placed)} solutions ({counts['seeded']} seeded nodes), grown to "
                 f"{counts['nodes']} nodes with {counts['generated_tokens']} tokens in "
                 f"{metrics['tree_search_seconds']:.1f}s")
    return nodes, placed


def _tree_data(spec: StageSpec, nodes: list[dict[str, Any]], placed: dict[str, tuple[str, int]] | None,
               trajs: list[dict[str, Any]], steps: dict[str, list[str]], correct: dict[str, bool | None],
               labels: list[dict[str, Any]], metrics: dict[str, float], *, rollouts_valued: bool,
               ) -> list[dict[str, Any]]:
    """score.tree: labels from the round's MCTS trees (added to `labels`) and the step pairs they give."""
    from components.search.training import tree_step_labels, tree_step_pairs

    t = spec.cfg().score.tree
    tree_labels, stats = tree_step_labels(nodes, trajs, steps, correct, rollouts_valued=rollouts_valued,
                                          placed=placed, label_unsolved=t.label_unsolved)
    labels += tree_labels
    pairs = tree_step_pairs(nodes, trajs, correct, margin=t.pair_margin, min_visits=t.min_visits, placed=placed)
    metrics |= {f"tree_{k}": float(v) for k, v in stats.items()} | {"tree_pairs": float(len(pairs))}
    log("score", f"tree labels ({'rollouts' if rollouts_valued else 'PRM'} values): {stats['tree_steps']} steps from "
                 f"nodes and {stats['rollout_steps']} from rollouts, on {stats['labelled_trajectories']} of "
                 f"{len(trajs)} trajectories ({stats['misaligned']} misaligned, {stats['unsolved']} in trees with no "
                 f"right solution: their final step only); {len(pairs)} sibling pairs at Q "
                 f"margin {t.pair_margin}")
    return pairs


def mean_scores(rows: list[dict[str, Any]], scored: int, reward_model: bool) -> dict[str, float]:
    """`mean_outcome`, and the reward model's mean trajectory score (`rm_mean_score`) where one scored."""
    out = {"mean_outcome": sum(r["value"] for r in rows if r["scorer"] == "outcome") / max(scored, 1)}
    if reward_model:
        mins = [r["value"] for r in rows if r["scorer"] != "outcome" and r["aggregate"] in ("min", "outcome")
                and r["step_index"] == -1]
        out["rm_mean_score"] = sum(mins) / max(len(mins), 1)
    return out


def merge(spec: StageSpec, shard_metrics: list[dict[str, float]], read) -> tuple[dict[str, float], dict]:
    """Counts add up, the shards' Monte Carlo and tree-search seconds and search depth take the largest, and the
    mean scores are over every shard's rows."""
    metrics = merged_counts(shard_metrics, maxed=("mc_seconds", "mc_search_levels", "tree_search_seconds"))
    return metrics | mean_scores(read("scores"), int(metrics["scored"]), "rm_mean_score" in metrics), {}


STAGE = Stage(name="score", section="score", gpu=True, reads=("generate", "verify"),
              writes=("scores", "step_labels", "step_pairs", "nodes"),
              inputs=Inputs, plan=plan, run=run, samples=True, merge=merge)
