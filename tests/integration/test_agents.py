"""An agent environment through the whole pipeline, on a micro config: configs/calculator.yaml on a tiny stand-in
(`coevo build-model --domain calculator`), one round. Round 0 trains on the environment's reference episodes;
round 1 samples episodes through the batched loop, verifies them by the environment, keeps the right ones and
trains on them; each evaluation runs held-out episodes. What is asserted is the mechanics, in the store: every
turn kept, the sampled ids kept, verification by execution, training inputs traced to their episodes. The
learning run is configs/calculator.yaml itself (docs/envs.md).

    .venv/bin/python -m pytest tests/integration/test_agents.py -q
"""

from __future__ import annotations

import json
import os
import random

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, assert_ptx_replays_the_demonstrations, run_coevo, untied_copy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agent_run(prefect_server, tmp_path_factory):
    from flows.evolution import self_evolution

    w = tmp_path_factory.mktemp("agents")
    model = w / "standin-calculator"
    run_coevo("build-model", str(model), "--domain", "calculator", "--size", "tiny", "--per-level", "100", check=True)
    config = REPO / "configs" / "calculator.yaml"
    # Round 0 learns level 1 (0.83 greedy, measured), so round 1 has right episodes to keep and train on.
    overrides = [f"workdir={w}", "experiment=calc-micro", "rounds=1", f"policy.model={model}",
                 "bootstrap.levels=[1]", "bootstrap.seed_levels=[]", "bootstrap.problems_per_level=60",
                 "bootstrap.steps=300", "generate.problems_per_level=8", "generate.samples_per_problem=3",
                 "train_policy.steps=5", "evaluate.problems_per_level=6", "evaluate.maj_k=2",
                 "filter.dpo_pairs=true", "train_policy.method=sft+dpo", "train_policy.dpo.steps=3",
                 "train_policy.dpo.batch_size=4", "train_policy.dpo.max_length=512",
                 "score.reward_model=implicit", "evaluate.best_of_n=[2]",
                 "score.mc_rollouts=2", "score.mc_strategy=first_error"]
    before = os.environ.get("MLFLOW_TRACKING_URI")
    self_evolution(config_path=str(config), overrides=overrides)
    assert os.environ.get("MLFLOW_TRACKING_URI") == before  # logging traces left the process's MLflow URI alone
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def from_round_zero(agent_run, experiment: str, rounds: int, recipe: str, settings: list[str]):
    """Another experiment on the calculator, from agent_run's round-0 policy (no bootstrap training), on level 1;
    its config and store once its rounds are done."""
    from flows.evolution import self_evolution

    cfg, store = agent_run
    model = store.committed_model(cfg.experiment, 0, "policy")["uri"]
    config = REPO / "configs" / "calculator.yaml"
    overrides = [f"workdir={cfg.workdir}", f"experiment={experiment}", f"rounds={rounds}", f"recipe={recipe}",
                 f"policy.model={model}", "bootstrap.steps=0", "bootstrap.levels=[1]", "bootstrap.seed_levels=[]",
                 "bootstrap.problems_per_level=60", *settings]
    self_evolution(config_path=str(config), overrides=overrides)
    got = load_config(config, overrides)
    return got, Store.for_config(got)


@pytest.fixture(scope="module")
def agent_grpo(agent_run):
    """recipe grpo on the same environment, from agent_run's round-0 policy: two rounds of groups of episodes, with
    turn credit from Monte Carlo turn labels (round 1) and from the PRM that round 1 trained on them (round 2);
    each round also trains an ORM, and its evaluation ranks two sampled episodes per held-out problem by that
    round's PRM and by its ORM (best-of-2). The reference episodes train beside them (PPO-ptx, weight 0.5)."""
    return from_round_zero(agent_run, "calc-grpo", 2, "grpo", [
        "train_policy.grpo.ptx_weight=0.5",
        "generate.problems_per_level=6", "generate.samples_per_problem=4",
        "generate.temperature=1.0", "train_policy.method=grpo", "train_policy.grpo.groups_per_step=2",
        "train_policy.grpo.learning_rate=1e-4", "evaluate.problems_per_level=4", "evaluate.maj_k=1",
        "score.mc_rollouts=2", "train_policy.grpo.credit=step", "train_policy.grpo.shaping_weight=0.5",
        "train_reward.enabled=true", "train_reward.steps=20", "train_reward.demos=true",
        "score.reward_model=prm", "evaluate.best_of_n=[2]", "train_reward.orm=true", "train_reward.orm_steps=10"])


@pytest.fixture(scope="module")
def agent_mcts(agent_run):
    """generate.mcts on the same environment, from agent_run's round-0 policy, recipe coevo: two rounds of level 1
    (which that policy answers) whose episodes are the trees' best finished episodes, a node one assistant turn with
    what the calculator answered. Round 1 values nodes by rollouts and trains a PRM on the labels its tree gives each
    turn (score.tree, tree_hard); round 2 values them by that PRM. Each round's policy trains by DPO on the tree's
    step pairs (filter.step_dpo_pairs) after its SFT."""
    return from_round_zero(agent_run, "calc-mcts", 2, "coevo", [
        "generate.problems_per_level=4", "generate.samples_per_problem=2",
        "domain.options={test_size: 40, max_level: 1}",
        "generate.mcts={simulations: 4, expansions: 3, rollouts: 1, value: prm}",
        "score.tree={pair_margin: 0.25}", "score.reward_model=prm", "train_reward.enabled=true",
        "train_reward.label_source=tree_hard", "train_reward.steps=10",
        "train_policy.steps=2", "evaluate.problems_per_level=2", "evaluate.maj_k=1",
        "train_policy.method=sft+dpo", "filter.step_dpo_pairs=true", "train_policy.dpo.steps=2",
        "train_policy.dpo.batch_size=2", "train_policy.dpo.max_length=512"])


GUIDED_THRESHOLD = 0.5  # within what round 1's PRM gives these turns (0.1 to 0.7): some pass, some are redrawn


@pytest.fixture(scope="module")
def agent_guided(agent_run):
    """generate.search, generate.until_correct, score.tree.search and evaluate.search on the same environment, from
    agent_run's round-0 policy, recipe coevo: each round runs an episode a problem, then a second wave for the
    problems whose first was wrong; round 1 samples plainly, round 2 draws each turn until round 1's PRM accepts
    it. Each round's score grows a tree over turns around its episodes (valued by rollouts, then by round 1's PRM),
    and the PRM trains on the labels it gives each turn. Each round's evaluation draws its compute curve over turns
    (beam search and MCTS guided by the round's PRM) on two held-out problems."""
    return from_round_zero(agent_run, "calc-guided", 2, "coevo", [
        "generate.problems_per_level=4", "generate.samples_per_problem=2", "generate.until_correct=1",
        "generate.temperature=1.2",  # hot enough for wrong episodes: a second wave, and bad turns for the PRM
        "domain.options={test_size: 40, max_level: 1}",
        f"generate.search={{max_tries: 2, threshold: {GUIDED_THRESHOLD}, redraw_temperature: 1.5}}",
        "score.tree={search: {simulations: 3, expansions: 2, rollouts: 1, value: prm}}",
        "train_reward.label_source=tree_hard", "score.reward_model=prm", "train_reward.enabled=true",
        "train_reward.steps=10", "train_policy.steps=2", "evaluate.problems_per_level=2", "evaluate.maj_k=1",
        "evaluate.search={budgets: [2], problems: 2, expansions: 2}"])


# Each episode the search returned, its node's path rebuilt up to the root: the turns' texts joined.
PATHS = """
WITH RECURSIVE up AS (
    SELECT tree_id, trajectory_id, terminal, reward, node_id, parent_id, step_text AS text FROM nodes
    WHERE trajectory_id IS NOT NULL AND experiment_id = ?
    UNION ALL
    SELECT up.tree_id, up.trajectory_id, up.terminal, up.reward, n.node_id, n.parent_id, n.step_text || up.text
    FROM up JOIN nodes n ON n.tree_id = up.tree_id AND n.node_id = up.parent_id
)
SELECT up.trajectory_id, up.terminal, up.reward, up.text, t.completion, v.correct
FROM up JOIN trajectories t USING (trajectory_id) JOIN verifications v USING (trajectory_id)
WHERE up.parent_id IS NULL
"""


def test_mcts_searches_over_turns_and_its_episodes_are_the_trees_paths(agent_mcts):
    """Every node past the root is an assistant turn with the observations it got; each stored episode is the path
    to the node that named it (a finished leaf whole, or a node its rollout completed), and the verify stage's
    verdict on a finished leaf's episode is the reward the search backed up."""
    cfg, store = agent_mcts
    _, trees = store.query(
        "SELECT tree_id, count(*), max(depth), count(*) FILTER (WHERE terminal), "
        "count(*) FILTER (WHERE depth > 0 AND step_text NOT LIKE '%' || chr(10)) FROM nodes "
        "WHERE experiment_id = ? AND round = 1 AND purpose = 'train' GROUP BY tree_id", [cfg.experiment])
    n_problems = store.query("SELECT count(DISTINCT problem_id) FROM trajectories WHERE experiment_id = ? AND "
                             "round = 1 AND purpose = 'train'", [cfg.experiment])[1][0][0]
    assert len(trees) == n_problems > 0
    assert all(nodes > 1 and 1 <= depth <= 3 and unended == 0 for _, nodes, depth, _, unended in trees), trees
    _, tool_turns = store.query("SELECT count(*) FROM nodes WHERE experiment_id = ? AND step_text LIKE "
                                "'%[tool:calculate] %'", [cfg.experiment])
    assert tool_turns[0][0] > 0  # turns that called the calculator carry what it returned
    _, paths = store.query(PATHS, [cfg.experiment])
    _, stored = store.query("SELECT trajectory_id FROM trajectories WHERE experiment_id = ? AND purpose = 'train'",
                            [cfg.experiment])  # both rounds' episodes
    assert sorted(p[0] for p in paths) == sorted(t for t, in stored)
    for tid, terminal, reward, text, completion, correct in paths:
        if terminal:
            assert text == completion + "\n" and bool(correct) == (reward == 1.0), tid
        else:  # its rollout went on from the node's last turn
            assert (completion + "\n").startswith(text) and len(completion) + 1 > len(text), tid
    gen = json.loads(store.committed_run(cfg.experiment, 1, "generate")["metrics_json"])
    print(f"round 1: {len(trees)} trees, {sum(t[1] for t in trees)} nodes, {gen['trajectories']:.0f} episodes "
          f"({gen['search_from_rollouts']:.0f} from rollouts), {gen['search_generated_tokens']:.0f} tokens searched, "
          f"{gen['tokens']:.0f} kept; both rounds: {len(paths)} episodes, {sum(bool(p[5]) for p in paths)} right")
    assert gen["search_generated_tokens"] == gen["tokens"] + gen["search_discarded_tokens"] > gen["tokens"]
    assert gen["agent_episodes"] == gen["trajectories"] and gen["search_replay_mismatches"] == 0
    # the episodes are any episode's: sampled ids on every assistant turn, and the round trained on them
    _, no_ids = store.query("SELECT count(*) FROM turns u JOIN trajectories t USING (trajectory_id) WHERE "
                            "t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train' AND u.role = 'assistant' "
                            "AND u.token_ids IS NULL", [cfg.experiment])
    assert no_ids[0][0] == 0
    assert json.loads(store.committed_run(cfg.experiment, 1, "train_policy")["metrics_json"])["steps"] == 2


def test_the_tree_labels_each_turn_of_its_episodes_and_the_prm_trains_on_them(agent_mcts):
    """score.tree on turn trees: each episode's steps are its path's nodes, so every assistant turn gets its node's
    tree_hard label, none misaligned; round 1's PRM trains on those labels."""
    cfg, store = agent_mcts
    score = json.loads(store.committed_run(cfg.experiment, 1, "score")["metrics_json"])
    _, rows = store.query(
        "SELECT t.trajectory_id, (SELECT count(*) FROM steps s WHERE s.trajectory_id = t.trajectory_id), "
        "count(l.step_index) FILTER (WHERE l.source = 'tree_hard') FROM trajectories t LEFT JOIN step_labels l "
        "USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train' GROUP BY ALL",
        [cfg.experiment])
    print(f"round 1 tree labels: {score['tree_labelled_trajectories']:.0f} episodes, {score['tree_tree_steps']:.0f} "
          f"turns from nodes, {score['tree_rollout_steps']:.0f} from a rollout, {score['tree_misaligned']:.0f} "
          f"misaligned, {score['tree_unsolved']:.0f} unsolved, {score['tree_pairs']:.0f} pairs")
    assert score["tree_misaligned"] == 0 and score["tree_labelled_trajectories"] == len(rows) > 0
    # every turn labelled, but in a tree with no right episode known, where only a wrong episode's last turn is
    full = [r for r in rows if r[1] == r[2]]
    assert full and all(labelled == 1 for _, _, labelled in set(rows) - set(full)), rows
    assert len(rows) - len(full) <= score["tree_unsolved"]
    prm = json.loads(store.committed_run(cfg.experiment, 1, "train_reward")["metrics_json"])
    assert prm["prm_steps"] == 10 and prm["prm_labelled_steps"] == sum(labelled for *_, labelled in rows)


def test_round_two_values_each_turn_by_round_ones_prm_as_it_reads_a_stored_episode(agent_mcts):
    """value: prm. Round 2's nodes are valued by round 1's PRM, no rollout generated; each value is that PRM's
    score of the node's turn after the turns before it, recomputed here from the tree in SQL and the PRM."""
    from components.rewards.prm import PRMScorer

    cfg, store = agent_mcts
    gen = json.loads(store.committed_run(cfg.experiment, 2, "generate")["metrics_json"])
    _, spent = store.query("SELECT sum(tokens) FROM nodes WHERE experiment_id = ? AND round = 2", [cfg.experiment])
    assert gen["search_generated_tokens"] == spent[0][0] > 0  # the draws alone: no rollout
    prm = store.committed_model(cfg.experiment, 1, "prm")
    _, rows = store.query(
        "WITH RECURSIVE up AS (SELECT tree_id, node_id AS leaf, value, node_id, parent_id, [step_text] AS steps "
        "FROM nodes WHERE experiment_id = ? AND round = 2 AND NOT terminal AND depth > 0 "
        "UNION ALL SELECT up.tree_id, up.leaf, up.value, n.node_id, n.parent_id, list_prepend(n.step_text, up.steps) "
        "FROM up JOIN nodes n ON n.tree_id = up.tree_id AND n.node_id = up.parent_id) "
        "SELECT DISTINCT up.tree_id, up.leaf, up.value, up.steps[2:], p.prompt FROM up "
        "JOIN nodes r ON r.tree_id = up.tree_id AND r.node_id = 0 "
        "JOIN problems p ON p.problem_id = r.problem_id WHERE up.parent_id IS NULL", [cfg.experiment])
    assert rows
    scores = PRMScorer(prm["uri"], prompt_format="chat").score_steps(
        [prompt for *_, prompt in rows], [[s.removesuffix("\n") for s in steps] for _, _, _, steps, _ in rows])
    gaps = [abs(value - sc[-1]) for (_, _, value, _, _), sc in zip(rows, scores)]
    print(f"round 2: {len(rows)} nodes valued by {prm['model_id']}, largest gap to its scores {max(gaps):.1e}")
    assert max(gaps) < 1e-4


def test_dpo_trains_on_turn_pairs_that_part_at_sibling_turns(agent_mcts):
    """filter.step_dpo_pairs on a turn tree: each pair is a wrong episode and a right one of its tree with the same
    turns (the same sampled ids, the same observations) up to the turn where they part; the round's DPO trains on
    exactly the selected pairs, after its SFT."""
    cfg, store = agent_mcts
    _, pairs = store.query(
        "SELECT w.round, p.trajectory_id, p.chosen_from, p.step_index, p.chosen_q - p.rejected_q, vc.correct, "
        "vw.correct FROM step_pairs p JOIN trajectories w USING (trajectory_id) "
        "JOIN trajectories c ON c.trajectory_id = p.chosen_from AND c.problem_id = w.problem_id "
        "JOIN verifications vc ON vc.trajectory_id = c.trajectory_id "
        "JOIN verifications vw ON vw.trajectory_id = w.trajectory_id "
        "WHERE p.source = 'tree' AND w.experiment_id = ?", [cfg.experiment])
    assert pairs and all(gap >= 0.25 and right and not wrong for *_, gap, right, wrong in pairs), pairs

    def turns(tid: str) -> list[tuple]:
        return store.query("SELECT role, content, token_ids FROM turns WHERE trajectory_id = ? ORDER BY turn_index",
                           [tid])[1]

    for _, wrong, right, step, *_ in pairs:
        w, r = turns(wrong), turns(right)
        cut = [i for i, t in enumerate(w) if t[0] == "assistant"][step]
        assert w[:cut] == r[:cut] and w[cut:] != r[cut:], (wrong, right, step)
    for rnd in sorted({p[0] for p in pairs}):
        n = sum(p[0] == rnd for p in pairs)
        train = json.loads(store.committed_run(cfg.experiment, rnd, "train_policy")["metrics_json"])
        uses = dict(store.query("SELECT use, count(*) FROM model_inputs WHERE model_id = ? GROUP BY 1",
                                [store.committed_model(cfg.experiment, rnd, "policy")["model_id"]])[1])
        assert train["dpo_pairs"] == n and train["dpo_steps"] == 2, train
        assert uses["step_dpo_rejected"] == n, uses
    print(f"step pairs over turns: {len(pairs)} in rounds {sorted({p[0] for p in pairs})}, parting at turns "
          f"{sorted(p[3] for p in pairs)}")


def test_prm_guided_turns_keep_a_draw_below_the_threshold_only_after_max_tries(agent_guided):
    """generate.search on an environment: round 2 draws each turn until round 1's PRM scores it at least the
    threshold. Rescored from the store by that PRM, the kept turns below the threshold are exactly the ones the
    search says it kept after max_tries; every draw it discarded is counted in the round's tokens."""
    from components.envs.rollout import episode_steps
    from components.rewards.prm import PRMScorer

    cfg, store = agent_guided
    plain = json.loads(store.committed_run(cfg.experiment, 1, "generate")["metrics_json"])
    assert not any(k.startswith("search_") for k in plain)  # round 1 has no PRM yet: it samples plainly
    gen = json.loads(store.committed_run(cfg.experiment, 2, "generate")["metrics_json"])
    _, rows = store.query("SELECT u.trajectory_id, u.turn_index, u.role, u.content, u.tool_name, t.prompt FROM turns u "
                          "JOIN trajectories t USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 2 "
                          "AND t.purpose = 'train'", [cfg.experiment])
    turns = [dict(zip(("trajectory_id", "turn_index", "role", "content", "tool_name"), r)) for r in rows]
    prompts = {r[0]: r[5] for r in rows}
    steps = episode_steps(turns)
    prm = store.committed_model(cfg.experiment, 1, "prm")
    ids = sorted(steps)
    scorer = PRMScorer(prm["uri"], prompt_format="chat")
    # each turn as the search scored it: after the turns before it
    scores = [scorer.score_steps([prompts[t]], [steps[t][:i + 1]])[0][-1] for t in ids for i in range(len(steps[t]))]
    below = sum(s < GUIDED_THRESHOLD for s in scores)
    print(f"round 2 guided by {prm['model_id']}: {gen['search_steps']:.0f} turns from {gen['search_draws']:.0f} "
          f"draws ({gen['search_redraws']:.0f} redrawn), {gen['search_accepted_below_threshold']:.0f} kept below "
          f"{GUIDED_THRESHOLD} (rescored: {below}), {gen['search_discarded_tokens']:.0f} tokens discarded")
    assert gen["search_steps"] == len(scores) > 0 and gen["search_accepted_below_threshold"] == below
    assert gen["search_draws"] == gen["search_steps"] + gen["search_redraws"] and gen["search_redraws"] > 0
    assert gen["search_generated_tokens"] == gen["tokens"] + gen["search_discarded_tokens"]
    assert gen["trajectories"] == gen["agent_episodes"] == len(ids)


def test_until_correct_runs_a_second_wave_only_for_problems_whose_first_episode_was_wrong(agent_guided):
    """generate.until_correct=1 on an environment, plain (round 1) and PRM-guided (round 2): wave 0 runs one
    episode a problem; wave 1 runs another for exactly the problems the environment scored wrong in wave 0."""
    cfg, store = agent_guided
    for rnd in (1, 2):
        gen = json.loads(store.committed_run(cfg.experiment, rnd, "generate")["metrics_json"])
        _, [(problems, wrong_first, second, right_after)] = store.query(
            "SELECT count(DISTINCT t.problem_id), count(*) FILTER (WHERE t.sample_index = 0 AND NOT v.correct), "
            "count(*) FILTER (WHERE t.sample_index = 1), count(DISTINCT t.problem_id) FILTER (WHERE v.correct) "
            "FROM trajectories t JOIN verifications v USING (trajectory_id) WHERE t.experiment_id = ? "
            "AND t.round = ? AND t.purpose = 'train'", [cfg.experiment, rnd])
        _, [(second_of_wrong,)] = store.query(
            "SELECT count(*) FROM trajectories b JOIN trajectories a ON a.problem_id = b.problem_id AND "
            "a.experiment_id = b.experiment_id AND a.round = b.round AND a.purpose = b.purpose AND a.sample_index = 0 "
            "JOIN verifications v ON v.trajectory_id = a.trajectory_id WHERE b.experiment_id = ? AND b.round = ? "
            "AND b.purpose = 'train' AND b.sample_index = 1 AND NOT v.correct", [cfg.experiment, rnd])
        print(f"round {rnd}: {problems} problems, {wrong_first} wrong in wave 0, {second} in wave 1; "
              f"{right_after} with a right episode after {gen['adaptive_waves']:.0f} waves")
        assert gen["adaptive_wave0_problems"] == problems == gen["problems"]
        assert gen.get("adaptive_wave1_problems", 0) == wrong_first == second == second_of_wrong
        assert gen["adaptive_waves"] == (2 if wrong_first else 1) and gen["trajectories"] == problems + second
        assert gen["adaptive_unmet"] == problems - right_after


def test_trees_grown_in_score_around_the_rounds_episodes_label_each_turn(agent_guided):
    """score.tree.search on an environment: each round's score seeds a tree per problem with its episodes, a path of
    turns each, and grows it; every episode ends at a leaf whose path is its transcript, every turn gets its node's
    label, and the PRM trains on those labels."""
    cfg, store = agent_guided
    for rnd in (1, 2):
        score = json.loads(store.committed_run(cfg.experiment, rnd, "score")["metrics_json"])
        _, [(problems, episodes, turns)] = store.query(
            "SELECT count(DISTINCT t.problem_id), count(DISTINCT t.trajectory_id), count(*) FROM trajectories t "
            "JOIN turns u USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = ? AND t.purpose = 'train' "
            "AND u.role = 'assistant'", [cfg.experiment, rnd])
        _, paths = store.query(PATHS.replace("trajectory_id IS NOT NULL", "purpose = 'label' AND round = ? AND "
                                             "trajectory_id IS NOT NULL"), [rnd, cfg.experiment])
        print(f"round {rnd}: {score['tree_search_trees']:.0f} trees from {episodes} episodes "
              f"({score['tree_search_seeded']:.0f} seeded turns), grown to {score['tree_search_nodes']:.0f} nodes "
              f"with {score['tree_search_generated_tokens']:.0f} tokens; {score['tree_tree_steps']:.0f} turns "
              f"labelled from nodes, {score['tree_unsolved']:.0f} episodes in unsolved trees, "
              f"{score['tree_misaligned']:.0f} misaligned, {score['tree_pairs']:.0f} pairs")
        assert score["tree_search_trees"] == problems and score["tree_search_seeded"] > 0
        assert score["tree_search_nodes"] > score["tree_search_seeded"] + problems  # it grew beyond the seeds
        assert score["tree_misaligned"] == 0 and score["tree_labelled_trajectories"] == episodes
        assert score["tree_search_replay_mismatches"] == 0
        assert paths and all(text == completion + "\n" and bool(correct) == (reward == 1.0)
                             for _, terminal, reward, text, completion, correct in paths)
        prm = json.loads(store.committed_run(cfg.experiment, rnd, "train_reward")["metrics_json"])
        _, [(labelled,)] = store.query(
            "SELECT count(*) FROM step_labels l JOIN trajectories t USING (trajectory_id) WHERE t.experiment_id = ? "
            "AND t.round = ? AND l.source = 'tree_hard'", [cfg.experiment, rnd])
        # an answer in a tree with no right episode known gets its last turn labelled alone
        assert score["tree_tree_steps"] + score["tree_rollout_steps"] + score["tree_unsolved"] == labelled <= turns
        # the PRM trains on tree labels alone (identical episodes once), this round's and earlier ones'
        _, reasons = store.query("SELECT DISTINCT reason FROM selections WHERE purpose = 'reward_train' AND selected "
                                 "AND experiment_id = ? AND round = ?", [cfg.experiment, rnd])
        assert reasons and all(r.startswith("tree labels") for r, in reasons), reasons
        assert 0 < prm["prm_labelled_steps"]


def test_the_compute_curve_over_turns_lands_in_each_rounds_evaluations(agent_guided):
    """evaluate.search on an environment: each round with a PRM draws greedy, maj@2, PRM best-of-2, beam search and
    MCTS over turns on its two held-out problems, each point at its tokens per problem."""
    cfg, store = agent_guided
    _, rows = store.query("SELECT round, metric, value FROM evaluations WHERE experiment_id = ? AND metric LIKE "
                          "'curve_%' ORDER BY round, metric", [cfg.experiment])
    by_round: dict[int, dict[str, float]] = {}
    for rnd, metric, value in rows:
        by_round.setdefault(rnd, {})[metric] = value
    assert sorted(by_round) == [1, 2]
    for rnd, got in by_round.items():
        for method in ("greedy_at_1", "maj_at_2", "prm_bon_at_2", "beam_at_2", "mcts_at_2"):
            assert 0.0 <= got[f"curve_{method}"] <= 1.0 and got[f"curve_{method}_tokens"] > 0, (rnd, method)
        print(f"round {rnd} curve: " + ", ".join(f"{m} {got[f'curve_{m}_at_2']:.2f} at "
                                                 f"{got[f'curve_{m}_at_2_tokens']:.0f} tokens"
                                                 for m in ("maj", "prm_bon", "beam", "mcts")))


def test_grpo_credits_each_turn_of_an_episode_from_its_turn_label_then_a_prm(agent_grpo):
    cfg, store = agent_grpo
    _, rows = store.query(
        "WITH u AS (SELECT trajectory_id, turn_index, "
        "           row_number() OVER (PARTITION BY trajectory_id ORDER BY turn_index) - 1 AS step_index "
        "           FROM turns WHERE role = 'assistant') "
        "SELECT a.round, u.step_index, a.process, "
        "       CASE WHEN a.round = 1 THEN l.value ELSE s.value END, s.model_id = p.model_id, "
        "       a.advantage - r.advantage - 0.5 * a.process_return "
        "FROM advantages a JOIN advantages r ON r.trajectory_id = a.trajectory_id AND r.turn_index = -1 "
        "LEFT JOIN u ON u.trajectory_id = a.trajectory_id AND u.turn_index = a.turn_index "
        "LEFT JOIN step_labels l ON l.trajectory_id = a.trajectory_id AND l.step_index = u.step_index "
        " AND l.source = 'mc_soft' "
        "LEFT JOIN scores s ON s.trajectory_id = a.trajectory_id AND s.step_index = u.step_index "
        " AND s.scorer = 'prm' AND s.aggregate = 'step' "
        "LEFT JOIN models p ON p.experiment_id = a.experiment_id AND p.role = 'prm' AND p.round = a.round - 1 "
        "WHERE a.experiment_id = ? AND a.turn_index >= 0", [cfg.experiment])
    _, [(assistant_turns, rolled_out)] = store.query(
        "SELECT count(*), (SELECT count(*) FROM step_labels l JOIN trajectories t USING (trajectory_id) "
        "                  WHERE t.experiment_id = ? AND l.source = 'mc_soft' AND l.num_rollouts = 2) "
        "FROM turns u JOIN trajectories t USING (trajectory_id) "
        "WHERE t.experiment_id = ? AND t.purpose = 'train' AND u.role = 'assistant'", [cfg.experiment] * 2)
    # One row per assistant turn, keyed by the turn, whose advantage is the episode's plus 0.5 x the normalised
    # step rewards from it on. A turn's step reward is its Monte Carlo label in round 1 (nothing was trained
    # yet), and in round 2 the score of the PRM that round 1 trained on those labels.
    assert len(rows) == assistant_turns and {r[0] for r in rows} == {1, 2}
    assert all(step is not None and process == value and abs(gap) < 1e-9 for _, step, process, value, _, gap in rows)
    assert all(from_prm for rnd, *_, from_prm, _ in rows if rnd == 2)
    # Turns before an episode's last were valued by going on from them (k=2), and some episode's turns differ.
    assert rolled_out > 0
    # Those episodes train each turn's tokens on that turn's advantage (a per-token advantage for TRL).
    _, credit = store.query(
        "SELECT s.round, json_extract(s.metrics_json, '$.turn_credit_rollouts')::DOUBLE, "
        "(SELECT count(*) FROM (SELECT a.trajectory_id FROM advantages a WHERE a.experiment_id = s.experiment_id "
        " AND a.round = s.round AND a.kept AND a.turn_index >= 0 GROUP BY ALL HAVING count(DISTINCT a.advantage) > 1)) "
        "FROM stage_runs s WHERE s.experiment_id = ? AND s.stage = 'train_policy' AND s.status = 'committed' "
        "ORDER BY ALL", [cfg.experiment])
    assert [r for r, *_ in credit] == [1, 2] and all(per_turn == split > 0 for _, per_turn, split in credit)
    # The PRM trained on episodes: the round's labelled episodes and the reference episodes, as their turns.
    _, [(prm_inputs, demos)] = store.query(
        "SELECT count(*), count(*) FILTER (WHERE i.source_round = 0) FROM model_inputs i JOIN models m "
        "USING (model_id) WHERE m.experiment_id = ? AND m.role = 'prm' AND m.round = 1", [cfg.experiment])
    assert prm_inputs > demos > 0
    _, [(steps, trained, logprobs, tokens, assistant_tokens)] = store.query(
        "SELECT json_extract(s.metrics_json, '$.steps')::DOUBLE, "
        "(SELECT count(*) FROM model_inputs i JOIN models m USING (model_id) WHERE m.experiment_id = s.experiment_id "
        " AND m.round = 1 AND i.use = 'grpo'), "
        "(SELECT count(*) FROM rollout_logprobs l JOIN models m USING (model_id) WHERE m.experiment_id = s.experiment_id "
        " AND m.round = 1), "
        "(SELECT sum(l.tokens) FROM rollout_logprobs l JOIN models m USING (model_id) "
        " WHERE m.experiment_id = s.experiment_id AND m.round = 1), "
        "(SELECT sum(u.num_tokens) FROM turns u JOIN rollout_logprobs l USING (trajectory_id) JOIN models m "
        " USING (model_id) WHERE m.experiment_id = s.experiment_id AND m.round = 1 AND u.role = 'assistant') "
        "FROM stage_runs s WHERE s.experiment_id = ? AND s.stage = 'train_policy' AND s.round = 1 "
        "AND s.status = 'committed'", [cfg.experiment])
    assert trained == logprobs > 0 and steps >= 1
    # The log-probabilities run over the tokens the model sampled, never the tool's observations.
    assert tokens == assistant_tokens
    # PPO-ptx: each round also trained on every reference episode of round 0, on its assistant turns.
    assert_ptx_replays_the_demonstrations(store, cfg.experiment, [1, 2])


@pytest.mark.parametrize("scorer, aggregate", [("prm", "min"), ("orm", "outcome")])
def test_a_reward_model_picks_the_best_of_n_held_out_episodes(agent_grpo, scorer, aggregate):
    """prm_bon_at_2 and orm_bon_at_2, recomputed in SQL: per held-out problem, of its two sampled episodes (sample 0
    is greedy), the one the round's reward model scores highest (the PRM: by its weakest turn, every turn scored;
    the ORM: the whole transcript; ties: the earlier); the share of those that are right."""
    cfg, store = agent_grpo
    _, rows = store.query(
        "WITH s AS (SELECT t.round, t.problem_id, t.sample_index, v.correct, m.value, "
        "           (SELECT count(*) FROM turns u WHERE u.trajectory_id = t.trajectory_id AND u.role = 'assistant') "
        "           AS turns, (SELECT count(*) FROM scores x WHERE x.trajectory_id = t.trajectory_id "
        "           AND x.scorer = $scorer AND x.aggregate = 'step') AS scored "
        "           FROM trajectories t JOIN verifications v USING (trajectory_id) "
        "           JOIN scores m ON m.trajectory_id = t.trajectory_id AND m.scorer = $scorer "
        "           AND m.aggregate = $aggregate "
        "           JOIN models p ON p.model_id = m.model_id AND p.role = $scorer AND p.round = t.round "
        "           WHERE t.experiment_id = $exp AND t.purpose = 'eval' AND t.sample_index BETWEEN 1 AND 2), "
        "     pick AS (SELECT round, problem_id, arg_max(correct::INT, [value, -sample_index]) AS ok, "
        "              bool_and(turns = scored) AS every_turn, count(*) AS n FROM s GROUP BY ALL) "
        "SELECT p.round, avg(p.ok), bool_and(p.every_turn), min(p.n), max(e.value) FROM pick p "
        "JOIN evaluations e ON e.experiment_id = $exp AND e.round = p.round AND e.metric = $scorer || '_bon_at_2' "
        " AND e.level = -1 GROUP BY p.round ORDER BY p.round",
        {"exp": cfg.experiment, "scorer": scorer, "aggregate": aggregate})
    assert [r[0] for r in rows] == [1, 2], rows
    for _, recomputed, every_turn, n, logged in rows:
        assert (every_turn or scorer == "orm") and n == 2 and abs(recomputed - logged) < 1e-9, rows
    if scorer == "orm":  # trained on the round's episodes, right and wrong, as their transcripts
        _, [(inputs, episodes)] = store.query(
            "SELECT count(*), count(*) FILTER (WHERE EXISTS (SELECT 1 FROM turns u WHERE u.trajectory_id = "
            "i.trajectory_id)) FROM model_inputs i JOIN models m USING (model_id) WHERE m.experiment_id = ? "
            "AND m.role = 'orm' AND m.round = 1", [cfg.experiment])
        assert inputs == episodes > 0


def test_the_implicit_prm_scores_each_held_out_episode_turn_by_turn(agent_run):
    """score.reward_model=implicit: round 1's evaluation scores each held-out episode by the log-ratio of round 1's
    policy to round 0's, one step score per assistant turn, and ranks its two samples by the weakest (best-of-2)."""
    cfg, store = agent_run
    _, rows = store.query(
        "SELECT t.trajectory_id, count(*) FILTER (WHERE s.aggregate = 'step'), "
        "(SELECT count(*) FROM turns u WHERE u.trajectory_id = t.trajectory_id AND u.role = 'assistant'), "
        "max(abs(s.value)) FILTER (WHERE s.aggregate = 'step'), "
        "abs(min(s.value) FILTER (WHERE s.aggregate = 'step') - any_value(s.value) FILTER (WHERE s.aggregate = "
        "'min')) < 1e-9 "
        "FROM trajectories t JOIN scores s USING (trajectory_id) JOIN models m ON m.model_id = s.model_id "
        "WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'eval' AND s.scorer = 'implicit' "
        "AND m.role = 'policy' AND m.round = 1 GROUP BY t.trajectory_id", [cfg.experiment])
    _, [(episodes,)] = store.query("SELECT count(*) FROM trajectories WHERE experiment_id = ? AND round = 1 "
                                   "AND purpose = 'eval'", [cfg.experiment])
    assert len(rows) == episodes > 0
    assert all(steps == turns and min_is_min for _, steps, turns, _, min_is_min in rows), rows
    assert max(r[3] for r in rows) > 0  # round 1's policy moved away from round 0's
    _, bon = store.query("SELECT value FROM evaluations WHERE experiment_id = ? AND round = 1 "
                         "AND metric = 'implicit_bon_at_2' AND level = -1", [cfg.experiment])
    assert len(bon) == 1 and 0.0 <= bon[0][0] <= 1.0


def test_first_error_labels_each_turn_by_bisecting_the_wrong_episodes(agent_run):
    """score.mc_strategy=first_error on episodes: hard labels only; a right episode's turns are 1 with no rollout;
    a searched wrong one is 1 up to its first dead turn and 0 from there, its last turn known without rollout; a
    wrong episode of a problem no episode solved has its last turn alone."""
    cfg, store = agent_run
    _, rows = store.query(
        "WITH r AS (SELECT t.trajectory_id, t.problem_id, v.correct FROM trajectories t JOIN verifications v "
        "           USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train'), "
        "solved AS (SELECT problem_id, bool_or(correct) AS solved FROM r GROUP BY ALL), "
        "n AS (SELECT trajectory_id, count(*) AS turns FROM steps GROUP BY ALL) "
        "SELECT r.trajectory_id, r.correct, list(l.value ORDER BY l.step_index), "
        "       list(l.step_index ORDER BY l.step_index), list(l.num_rollouts ORDER BY l.step_index), "
        "       any_value(n.turns), any_value(s.solved) "
        "FROM r JOIN step_labels l USING (trajectory_id) JOIN n USING (trajectory_id) JOIN solved s USING (problem_id) "
        "WHERE l.source = 'mc_hard' GROUP BY r.trajectory_id, r.correct", [cfg.experiment])
    sources = store.query("SELECT DISTINCT source FROM step_labels l JOIN trajectories t USING (trajectory_id) "
                          "WHERE t.experiment_id = ?", [cfg.experiment])[1]
    assert sources == [("mc_hard",)]
    searched = 0
    for tid, correct, values, index, rollouts, turns, solved in rows:
        if correct:
            assert values == [1.0] * turns and index == list(range(turns)) and set(rollouts) == {0}, tid
        elif not solved:
            assert (values, index, rollouts) == ([0.0], [turns - 1], [0]), tid
        else:
            searched += 1
            first_dead = values.index(0.0)
            assert values == [1.0] * first_dead + [0.0] * (turns - first_dead) and rollouts[-1] == 0, tid
            assert set(rollouts) <= {0, 2} and (turns == 1 or 2 in rollouts), tid
    assert searched > 0 and any(correct for _, correct, *_ in rows)
    metrics = json.loads(store.committed_run(cfg.experiment, 1, "score")["metrics_json"])
    print(f"{len(rows)} episodes labelled, {sum(c for _, c, *_ in rows)} right, {searched} searched; "
          f"{metrics['mc_search_levels']:.0f} levels, {metrics['mc_rollouts']:.0f} rollouts from "
          f"{metrics['mc_unique_prefixes']:.0f} prefixes, {metrics['mc_dead_root']:.0f} unsolved not searched")
    assert metrics["mc_search_levels"] >= 1 and metrics["mc_rollouts"] == 2 * metrics["mc_unique_prefixes"] > 0


def test_every_turn_of_every_episode_is_stored_with_its_sampled_ids(agent_run):
    cfg, store = agent_run
    _, rows = store.query(
        "SELECT t.round, t.purpose, count(DISTINCT t.trajectory_id), count(*) FILTER (WHERE u.role = 'assistant'), "
        "count(*) FILTER (WHERE u.role = 'assistant' AND u.token_ids IS NULL), "
        "count(*) FILTER (WHERE u.role = 'system'), count(*) FILTER (WHERE u.role = 'user') "
        "FROM trajectories t JOIN turns u USING (trajectory_id) WHERE t.experiment_id = ? GROUP BY ALL ORDER BY ALL",
        [cfg.experiment])
    by = {(r[0], r[1]): r[2:] for r in rows}
    assert set(by) == {(0, "demo"), (0, "eval"), (1, "train"), (1, "eval")}
    n_train = store.query("SELECT count(*) FROM trajectories WHERE experiment_id = ? AND round = 1 AND purpose = "
                          "'train'", [cfg.experiment])[1][0][0]
    assert by[(1, "train")][0] == n_train == 8 * 3 * len(json.loads(store.query(
        "SELECT levels_json FROM round_plans WHERE experiment_id = ? AND round = 1", [cfg.experiment])[1][0][0]))
    for key, (episodes, assistant, no_ids, system, user) in by.items():
        assert system == user == episodes, key  # each episode opens with its system and user turns
        assert assistant >= episodes, key
        # Sampled turns keep their ids; the reference episodes were written, not sampled.
        assert no_ids == (assistant if key[1] == "demo" else 0), key
    # Held-out episodes: one greedy and maj_k sampled per problem.
    assert by[(1, "eval")][0] == 5 * 6 * (1 + cfg.evaluate.maj_k)


def test_the_agent_loop_samples_through_vllm_and_vllm_serve_as_through_hf(prefect_server, tmp_path_factory):
    """generate.backend=vllm and generate.backend=openai on an environment: round 0's held-out episodes of one policy
    (a `--size micro` stand-in, as vLLM's CPU attention needs a head of 32 or more, after a short bootstrap on HF),
    through HF, through the vLLM engine in .venv-vllm, and through a `vllm serve` of it. Greedy episodes (all in
    float32) agree turn for turn but where two logits tie to rounding; every sampled turn keeps the ids the engine
    drew, which decode to the turn's text. The served run goes on for a whole round on the same server, each stage
    loading its policy into it (`reload_weights`): its episodes, their Monte Carlo turn labels and the held-out
    episodes of the model trained on them."""
    from transformers import AutoTokenizer

    from components.servers import free_port, vllm_served
    from flows.evolution import self_evolution

    vllm_python = REPO / ".venv-vllm" / "bin" / "python"
    if not vllm_python.exists():
        pytest.fail(".venv-vllm is missing: `make vllm` builds it (make test does)")
    w = tmp_path_factory.mktemp("agents-vllm")
    model = w / "standin-calculator"
    run_coevo("build-model", str(model), "--domain", "calculator", "--size", "micro", "--per-level", "100", check=True)
    config = REPO / "configs" / "calculator.yaml"
    base = [f"workdir={w}", "rounds=0", "bootstrap.levels=[1, 2]", "bootstrap.seed_levels=[]",
            "bootstrap.problems_per_level=60", "evaluate.levels=[1, 2]", "evaluate.problems_per_level=4",
            "evaluate.maj_k=2"]
    runs = {}

    def run(name: str, extra: list[str]) -> None:
        overrides = [*base, f"experiment=calc-{name}", *extra]
        self_evolution(config_path=str(config), overrides=overrides)
        runs[name] = (load_config(config, overrides), Store.for_config(load_config(config, overrides)))

    run("hf", [f"policy.model={model}", "bootstrap.steps=150"])
    trained = runs["hf"][1].committed_model("calc-hf", 0, "policy")["uri"]  # the same weights, copied as round 0
    run("vllm", ["generate.backend=vllm", "bootstrap.steps=0", f"policy.model={trained}"])
    # vLLM's CPU build keeps a tied output layer's prepacked weights across a reload: serve an untied copy.
    untied = untied_copy(trained, w / "untied")
    port = free_port()
    options = {"base_url": f"http://127.0.0.1:{port}/v1", "timeout_s": 60, "served_model_name": "policy",
               "reload_weights": True}
    with vllm_served(str(untied), port, w / "serve.log", python=vllm_python, kv_cache_gib=1,
                     served_model_name="policy", dev_mode=True):
        run("openai", ["generate.backend=openai", "bootstrap.steps=0", f"policy.model={untied}", "rounds=1",
                       "generate.problems_per_level=3", "generate.samples_per_problem=2", "score.mc_rollouts=2",
                       "score.mc_max_trajectories=4", "train_policy.steps=5",
                       f"generate.backend_options={json.dumps(options)}"])
    q = ("SELECT t.problem_id, t.sample_index, t.completion, v.correct FROM trajectories t JOIN verifications v "
         "USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 0 AND t.purpose = 'eval' ORDER BY 1, 2")
    got = {name: store.query(q, [cfg.experiment])[1] for name, (cfg, store) in runs.items()}
    hf = got["hf"]
    assert len(hf) == 2 * 4 * 3  # 2 levels x 4 problems: greedy + 2 sampled
    tok = AutoTokenizer.from_pretrained(trained)
    for name in ("vllm", "openai"):
        cfg, store = runs[name]
        assert [r[:2] for r in got[name]] == [r[:2] for r in hf], name
        greedy = [(h, v) for h, v in zip(hf, got[name]) if h[1] == 0]
        same = sum(h[2] == v[2] for h, v in greedy)
        print(f"round 0 through {name}: {same} of {len(greedy)} greedy episodes as through HF; right: HF "
              f"{sum(h[3] for h in hf)}, {name} {sum(v[3] for v in got[name])} of {len(hf)}; "
              f"e.g. {got[name][0][2]!r}")
        assert same >= 0.75 * len(greedy), name
        _, turns = store.query("SELECT u.content, u.token_ids FROM turns u JOIN trajectories t USING (trajectory_id) "
                               "WHERE t.experiment_id = ? AND u.role = 'assistant' AND t.purpose = 'eval'",
                               [cfg.experiment])
        assert turns and all(ids and tok.decode(ids, skip_special_tokens=True).strip() == text.strip()
                             for text, ids in turns), name
        metrics = json.loads(store.committed_run(cfg.experiment, 0, "evaluate")["metrics_json"])
        assert metrics["agent_episodes"] == len(hf), name
    # Round 1 through the server: every sampling stage loaded its policy into it once (round 1's evaluate the
    # policy the round trained), the episodes keep the server's ids, and the Monte Carlo turn labels are rollouts
    # it drew.
    cfg, store = runs["openai"]
    for stage in ("generate", "score", "evaluate"):
        metrics = json.loads(store.committed_run(cfg.experiment, 1, stage)["metrics_json"])
        assert metrics.get("engine_weight_reloads") == 1, (stage, metrics)
    _, turns = store.query("SELECT u.content, u.token_ids FROM turns u JOIN trajectories t USING (trajectory_id) "
                           "WHERE t.experiment_id = ? AND t.round = 1 AND u.role = 'assistant'", [cfg.experiment])
    assert turns and all(ids and tok.decode(ids, skip_special_tokens=True).strip() == text.strip()
                         for text, ids in turns)
    _, labels = store.query("SELECT l.source, count(*), sum(l.num_rollouts) FROM step_labels l JOIN trajectories t "
                            "USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 GROUP BY 1",
                            [cfg.experiment])
    assert labels and all(n > 0 for _, n, _ in labels), labels
    held_out = json.loads(store.committed_run(cfg.experiment, 1, "evaluate")["metrics_json"])["agent_episodes"]
    print(f"round 1 through vllm serve, weights reloaded by each stage: {len(turns)} assistant turns with the "
          f"server's ids; turn labels {labels}; held-out {held_out:.0f} episodes")
    vllm_metrics = json.loads(runs["vllm"][1].committed_run("calc-vllm", 0, "evaluate")["metrics_json"])
    assert vllm_metrics["engine_prefix_cache_queries"] > 0


def test_episodes_are_verified_by_running_their_answers(agent_run):
    cfg, store = agent_run
    # The verify stage re-scored each episode's last turn with the environment: its verdict is the loop's reward.
    _, rows = store.query(
        "SELECT v.correct, v.reward, u.reward, t.finish_reason FROM verifications v JOIN trajectories t "
        "USING (trajectory_id) JOIN turns u USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 AND "
        "t.purpose = 'train' AND u.role = 'assistant' AND u.turn_index = (SELECT max(w.turn_index) FROM turns w "
        "WHERE w.trajectory_id = t.trajectory_id AND w.role = 'assistant')", [cfg.experiment])
    assert len(rows) == 24
    assert all(bool(correct) == (status == "done" and reward == 1.0) for correct, _, reward, status in rows)
    assert all(v == r for _, v, r, status in rows if status == "done")
    _, names = store.query("SELECT DISTINCT verifier FROM verifications v JOIN trajectories t USING (trajectory_id) "
                           "WHERE t.experiment_id = ? AND t.round = 1", [cfg.experiment])
    assert names == [("calculator.score",)]
    # The demonstrations' tool calls all ran; v_tool_stats counts each round's calls.
    _, stats = store.query("SELECT tool_name, calls, errors FROM v_tool_stats WHERE experiment_id = ? AND round = 0 "
                           "AND purpose = 'demo'", [cfg.experiment])
    assert [(name, errors) for name, _, errors in stats] == [("calculate", 0)] and stats[0][1] > 0


def test_training_reads_the_selected_episodes_turns(agent_run):
    cfg, store = agent_run
    boot = json.loads(store.committed_run(cfg.experiment, 0, "bootstrap")["metrics_json"])
    assert boot["truncated"] == 0 and boot["examples"] > 0
    # Every trajectory the round's policy trained on is an episode with stored turns (demos replayed, or new).
    _, rows = store.query(
        "SELECT mi.use, count(*), count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM turns u WHERE "
        "u.trajectory_id = mi.trajectory_id AND u.role = 'assistant')) FROM model_inputs mi JOIN models m "
        "USING (model_id) WHERE m.experiment_id = ? AND m.round = 1 GROUP BY ALL", [cfg.experiment])
    assert rows and all(missing == 0 for _, _, missing in rows), rows
    tp = json.loads(store.committed_run(cfg.experiment, 1, "train_policy")["metrics_json"])
    uses = {use: n for use, n, _ in rows}
    assert tp["examples"] == uses.get("new", 0) + uses.get("replay", 0)
    # sft+dpo: then DPO on pairs of episodes of one problem, a right one against a wrong one, observations masked.
    _, pairs = store.query(
        "SELECT s.pair_id, list(s.purpose ORDER BY s.purpose), list(v.correct ORDER BY s.purpose), "
        "count(DISTINCT t.problem_id) FROM selections s JOIN trajectories t USING (trajectory_id) "
        "JOIN verifications v USING (trajectory_id) WHERE s.experiment_id = ? AND s.round = 1 "
        "AND s.purpose LIKE 'dpo_%' GROUP BY s.pair_id", [cfg.experiment])
    assert pairs and all(p[1] == ["dpo_chosen", "dpo_rejected"] and p[2] == [True, False] and p[3] == 1
                         for p in pairs), pairs
    assert tp["dpo_pairs"] == len(pairs) and tp["dpo_steps"] == 3 and tp["dpo_truncated"] == 0
    assert uses.get("dpo_rejected") == len(pairs)


def test_the_round_logs_the_loops_figures(agent_run):
    cfg, store = agent_run
    gen = json.loads(store.committed_run(cfg.experiment, 1, "generate")["metrics_json"])
    assert gen["agent_episodes"] == gen["trajectories"] and gen["agent_assistant_turns"] >= gen["trajectories"]
    assert 0.0 <= gen["agent_env_share"] < 1.0 and gen["tokens"] > 0 and gen["prompt_tokens"] > gen["tokens"]


def test_a_sample_of_each_rounds_episodes_lands_in_mlflow_as_traces(agent_run):
    from mlflow import MlflowClient

    from components.tracking import tracking_uri

    cfg, store = agent_run
    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.experiment)
    run = client.search_runs([exp.experiment_id], filter_string="tags.`coevo.round` = '1'")[0]
    traces = client.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id)
    assert len(traces) == min(cfg.tracking.trace_episodes, 24)  # round 1 sampled 24 episodes
    for trace in traces:
        tid = trace.info.tags["coevo.trajectory_id"]
        turns = store.query("SELECT role, content FROM turns WHERE trajectory_id = ? AND turn_index >= 2 "
                            "ORDER BY turn_index", [tid])[1]
        spans = sorted(trace.data.spans, key=lambda s: (s.start_time_ns, s.parent_id is not None))
        assert [s.name.split()[0] for s in spans[1:]] == ["turn" if r == "assistant" else "tool" for r, _ in turns]
        assert spans[0].span_type == "AGENT" and {s.span_type for s in spans[1:]} <= {"CHAT_MODEL", "TOOL"}
        assert [s.outputs for s in spans[1:] if s.span_type == "CHAT_MODEL"] == [
            {"content": c} for r, c in turns if r == "assistant"]
        verdict = store.query("SELECT reward, correct FROM verifications WHERE trajectory_id = ?", [tid])[1][0]
        got = {a.name: a.value for a in trace.search_assessments()}
        assert got == {"reward": verdict[0], "correct": verdict[1]}


@pytest.fixture(scope="module")
def hindsight_run(prefect_server, tmp_path_factory):
    """configs/code.yaml for a round with filter.hindsight and filter.variants, sampled from a coding agent that
    slips a constant on three answers of four (tests/integration/slips.py); a tiny code stand-in trains on what the
    filter keeps."""
    from flows.evolution import self_evolution

    w = tmp_path_factory.mktemp("hindsight")
    model = w / "standin-code"
    run_coevo("build-model", str(model), "--domain", "code", "--size", "tiny", "--per-level", "20",
              "--positions", "768", check=True)
    config = REPO / "configs" / "code.yaml"
    overrides = [f"workdir={w}", "experiment=code-hindsight", "rounds=1", f"policy.model={model}", "bootstrap.steps=0",
                 "bootstrap.levels=[1]", "bootstrap.seed_levels=[]", "bootstrap.problems_per_level=10",
                 "generate.backend=tests.integration.slips:SlipPolicy", "generate.problems_per_level=6",
                 "generate.samples_per_problem=2", "generate.until_correct=null", "generate.wave_size=1",
                 "train_policy.steps=3", "evaluate.problems_per_level=3",
                 "domain.options.test_size=6", "filter.hindsight=true", "filter.max_per_value=1", "filter.variants=2"]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def test_hindsight_trains_on_wrong_episodes_relabeled_with_the_task_their_program_solves(hindsight_run):
    from components.envs.code import CodeEnv, answer_code

    cfg, store = hindsight_run
    env = CodeEnv(**cfg.domain.options)  # the run's tasks and held-out set
    _, wrong = store.query(
        "SELECT t.trajectory_id, t.level, p.prompt, t.answer FROM trajectories t JOIN problems p USING (problem_id) "
        "JOIN verifications v USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train' "
        "AND NOT v.correct", [cfg.experiment])
    # What each wrong answer solved, as the environment names it; a held-out task is no relabel's goal.
    held_out = {p.prompt for lv in env.levels() for p in env.test_set(lv)}
    goals = {tid: env.hindsight(_problem(env, q), f"```python\n{a}\n```") for tid, _, q, a in wrong}
    expected = {tid: g.prompt for tid, g in goals.items() if g is not None and g.prompt not in held_out}
    assert len(expected) >= 3, (len(wrong), expected)  # the slips are there to relabel
    _, got = store.query(
        "SELECT s.reason, t.prompt, t.answer, v.correct, s.selected, t.policy_model_id FROM trajectories t "
        "JOIN selections s USING (trajectory_id) JOIN verifications v USING (trajectory_id) "
        "WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'hindsight' AND s.purpose = 'policy_sft'",
        [cfg.experiment])
    by_source = {reason.removeprefix("hindsight: relabeled from ").split(";")[0]: row for reason, *row in got}
    assert sorted(by_source) == sorted(expected)
    answers = {tid: a for tid, _, _, a in wrong}
    for source, (prompt, answer, correct, _, policy) in by_source.items():
        # The relabeled task asks for what the program does: the source's own answer, now right.
        assert prompt == expected[source] and answer == answers[source] and correct
        assert policy == f"{cfg.experiment}/policy/r0/a1"
        assert env.score(_problem(env, prompt), f"```python\n{answer_code(answer)}\n```") == 1.0
    # Its turns are stored, and the round's policy trained on it (v_lineage), beside the round's right answers.
    _, lineage = store.query(
        "SELECT trajectory_purpose, count(*) FROM v_lineage WHERE experiment_id = ? AND trained_round = 1 "
        "AND use = 'new' GROUP BY ALL", [cfg.experiment])
    chosen = sum(row[4] for row in got)  # a relabel is deduplicated and capped per task like any right answer
    assert dict(lineage)["hindsight"] == chosen >= 3
    tp = json.loads(store.committed_run(cfg.experiment, 1, "train_policy")["metrics_json"])
    flt = json.loads(store.committed_run(cfg.experiment, 1, "filter")["metrics_json"])
    assert (flt["hindsight_relabeled"], flt["hindsight_selected"]) == (len(expected), chosen)
    assert tp["examples"] > chosen
    # The round's training pass rate counts the sampled episodes only.
    _, [(rate,)] = store.query("SELECT train_pass_rate FROM v_round_summary WHERE experiment_id = ? AND round = 1",
                               [cfg.experiment])
    _, [(n_right, n)] = store.query(
        "SELECT count(*) FILTER (WHERE v.correct), count(*) FROM verifications v JOIN trajectories t "
        "USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train'", [cfg.experiment])
    assert rate == pytest.approx(n_right / n) and n_right < n


def test_max_per_value_keeps_any_one_constant_of_a_template_to_its_cap_relabels_last(hindsight_run):
    from components.envs.code import CodeEnv

    cfg, store = hindsight_run
    cap, env = cfg.filter.max_per_value, CodeEnv(**cfg.domain.options)
    _, rows = store.query(
        "SELECT t.trajectory_id, t.purpose, t.prompt, s.selected, s.reason FROM selections s JOIN trajectories t "
        "USING (trajectory_id) WHERE t.experiment_id = ? AND s.round = 1 AND s.purpose = 'policy_sft'",
        [cfg.experiment])
    kept: dict[str, int] = {}
    for _, _, prompt, selected, _ in rows:
        for key in env.constants(prompt) if selected else []:
            kept[key] = kept.get(key, 0) + 1
    assert kept and max(kept.values()) <= cap
    capped = [(purpose, prompt, reason) for _, purpose, prompt, selected, reason in rows if "max_per_value" in reason]
    assert capped, "the slips give some constant more right answers and relabels than the cap"
    for purpose, prompt, reason in capped:
        full = reason.split(f"over max_per_value={cap}: ")[1]
        assert full in env.constants(prompt) and kept[full] == cap  # left out only where its value was full
        # A relabel or a variant gives way to a sampled right answer: one is left out only where they fill the
        # value too.
        assert purpose in ("hindsight", "variant") or not any(
            p in ("hindsight", "variant") and sel and full in env.constants(q) for _, p, q, sel, _ in rows)
    flt = json.loads(store.committed_run(cfg.experiment, 1, "filter")["metrics_json"])
    assert flt["over_max_per_value"] == len(capped)


def test_variants_train_on_right_episodes_posed_again_with_other_constants(hindsight_run):
    from components.envs.code import CodeEnv, answer_code, parse_task

    cfg, store = hindsight_run
    env = CodeEnv(**cfg.domain.options)
    _, right = store.query(
        "SELECT t.trajectory_id, p.prompt, t.answer FROM trajectories t JOIN problems p USING (problem_id) "
        "JOIN verifications v USING (trajectory_id) WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train' "
        "AND v.correct", [cfg.experiment])
    asked = {tid: prompt for tid, prompt, _ in right}
    held_out = {p.prompt for lv in env.levels() for p in env.test_set(lv)}
    # What the environment poses again of each right answer (the slip policy answers at once, in one turn), drawn
    # as the filter draws, held-out tasks left out.
    expected = {tid: sum(goal.prompt not in held_out for goal, _ in env.variants(
        _problem(env, prompt), [f"```python\n{answer}\n```"], cfg.filter.variants, random.Random(f"{cfg.seed}|{tid}")))
        for tid, prompt, answer in right}
    assert sum(expected.values()) >= 2, ("the slips leave one answer in four right", right)
    _, got = store.query(
        "SELECT s.reason, t.prompt, t.answer, v.correct, s.selected FROM trajectories t "
        "JOIN selections s USING (trajectory_id) JOIN verifications v USING (trajectory_id) "
        "WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'variant' AND s.purpose = 'policy_sft'",
        [cfg.experiment])
    by_source: dict[str, int] = {}
    for reason, prompt, answer, correct, _ in got:
        source = reason.removeprefix("variant of ").split(";")[0]
        by_source[source] = by_source.get(source, 0) + 1
        # The source's task again, its template with other constants, never held out, and its answer right there.
        (level, template, params), (level0, template0, params0) = parse_task(prompt), parse_task(asked[source])
        assert (level, template) == (level0, template0) and params != params0 and prompt not in held_out
        assert correct and env.score(_problem(env, prompt), f"```python\n{answer_code(answer)}\n```") == 1.0
    assert by_source == {tid: n for tid, n in expected.items() if n}
    chosen = sum(row[4] for row in got)
    _, lineage = store.query(
        "SELECT trajectory_purpose, count(*) FROM v_lineage WHERE experiment_id = ? AND trained_round = 1 "
        "AND use = 'new' GROUP BY ALL", [cfg.experiment])
    assert dict(lineage)["variant"] == chosen >= 2
    flt = json.loads(store.committed_run(cfg.experiment, 1, "filter")["metrics_json"])
    assert (flt["variants"], flt["variants_selected"]) == (len(got), chosen)
    # Each replay was measured against train_policy.max_length; those over it are left out, saying so.
    _, [(over,)] = store.query("SELECT count(*) FROM selections WHERE experiment_id = ? AND round = 1 AND reason LIKE "
                               "'%over train_policy.max_length=%'", [cfg.experiment])
    assert flt["replays_over_max_length"] == over


def _problem(env, prompt):
    """The generated task whose prompt is `prompt`."""
    from components.envs.code import parse_task

    level, template, params = parse_task(prompt)
    return env.task(level, template, params)
