"""MCTS as generate's sampler (`generate.mcts`), one micro round of the coevo recipe through the real flow: every
tree in the store's `nodes` table, the trajectories the search returned pointing at their leaves, the whole search
counted in the round's token budget, and the training data the tree gives with no rollouts of score's own: step
labels the PRM trains on (`score.tree`, `train_reward.label_source=tree_hard`) and step pairs DPO trains on
(`filter.step_dpo_pairs`). What is asserted is read back with SQL, as a user would ask it.

    .venv/bin/python -m pytest tests/integration/test_search.py -q
"""

from __future__ import annotations

import json

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, SHORT_SFT, run_coevo

pytestmark = pytest.mark.slow

MCTS = ["rounds=1", "generate.mcts={simulations: 6, expansions: 3, max_step_tokens: 16, rollouts: 2}",
        "generate.problems_per_level=20", "generate.samples_per_problem=4", *SHORT_SFT,
        "evaluate.problems_per_level=20", "evaluate.maj_k=1"]
TREE_DATA = ["recipe=coevo", "score.tree={pair_margin: 0.25}",
             "train_reward={enabled: true, label_source: tree_hard, head: likelihood, lm_weight: 1.0, steps: 30, "
             "batch_size: 32, learning_rate: 1.0e-3}",
             "filter.step_dpo_pairs=true", "train_policy.method=sft+dpo", "train_policy.dpo={steps: 10, batch_size: 16}"]

# Each returned trajectory's node path, rebuilt from its node up to the root: a terminal leaf's path is the whole
# completion; a node the search completed by one of its rollouts starts it.
PATHS = """
WITH RECURSIVE up AS (
    SELECT tree_id, trajectory_id, terminal, node_id, parent_id, step_text AS text FROM nodes
    WHERE trajectory_id IS NOT NULL
    UNION ALL
    SELECT up.tree_id, up.trajectory_id, up.terminal, n.node_id, n.parent_id, n.step_text || up.text
    FROM up JOIN nodes n ON n.tree_id = up.tree_id AND n.node_id = up.parent_id
)
SELECT up.trajectory_id, up.terminal, up.text, t.completion FROM up JOIN trajectories t USING (trajectory_id)
WHERE up.parent_id IS NULL
"""


def _micro_round(micro_workdir, tmp_path_factory, experiment: str, settings: list[str]):
    """One micro experiment from micro's round-0 policy, in a workdir of its own: its config and store."""
    from flows.evolution import self_evolution

    w = tmp_path_factory.mktemp(experiment)
    config = REPO / "configs" / "micro.yaml"
    overrides = [f"workdir={w}", f"experiment={experiment}", *settings, *micro_workdir.start_from_round0()]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


@pytest.fixture(scope="module")
def mcts_run(prefect_server, micro_workdir, tmp_path_factory):
    return _micro_round(micro_workdir, tmp_path_factory, "micro-mcts", [*MCTS, *TREE_DATA])


def test_one_tree_per_problem_whose_returned_leaves_are_the_trajectories(mcts_run):
    cfg, store = mcts_run
    problems = store.query("SELECT count(DISTINCT problem_id), count(*) FROM trajectories WHERE experiment_id = ? "
                           "AND round = 1 AND purpose = 'train'", [cfg.experiment])[1][0]
    trees = store.query("SELECT count(*), sum(returned), count(*) FILTER (WHERE root_visits > 0) FROM v_search "
                        "WHERE experiment_id = ? AND round = 1", [cfg.experiment])[1][0]
    assert problems[0] == trees[0] == trees[2] > 0  # every tree was searched
    assert problems[1] == trees[1] <= problems[0] * cfg.generate.samples_per_problem
    rebuilt = store.query(PATHS)[1]
    assert len(rebuilt) == problems[1]
    assert all(completion.startswith(text) and (text == completion) == terminal
               for _, terminal, text, completion in rebuilt)
    assert any(terminal for _, terminal, _, _ in rebuilt) and any(not terminal for _, terminal, _, _ in rebuilt)


def test_the_tree_is_consistent_and_its_terminal_rewards_are_the_verifiers(mcts_run):
    _, store = mcts_run
    bad = store.query("""
        SELECT p.tree_id, p.node_id FROM nodes p JOIN nodes c ON c.tree_id = p.tree_id AND c.parent_id = p.node_id
        GROUP BY p.tree_id, p.node_id, p.visits, p.depth
        HAVING sum(c.visits) > p.visits OR min(c.depth) <> p.depth + 1 OR max(c.depth) <> p.depth + 1""")[1]
    assert bad == []  # a parent is visited once per child's visit (and once more when it was the new leaf)
    assert store.query("SELECT count(*) FROM nodes WHERE q < 0 OR q > 1 OR prior <= 0 OR prior > 1")[1] == [(0,)]
    assert store.query("SELECT count(*) FROM nodes WHERE (node_id = 0) <> (parent_id IS NULL)")[1] == [(0,)]
    judged = store.query("SELECT count(*), count(*) FILTER (WHERE n.reward = v.reward) FROM nodes n "
                         "JOIN verifications v USING (trajectory_id) WHERE n.terminal")[1][0]
    assert judged[0] > 0 and judged[0] == judged[1]
    # Where fewer leaves ended than were asked for, the rollouts the search paid for complete their nodes.
    assert store.query("SELECT count(*) FROM nodes WHERE trajectory_id IS NOT NULL AND NOT terminal "
                       "AND value IS NULL")[1] == [(0,)]


def test_the_whole_search_is_the_rounds_token_budget(mcts_run):
    cfg, store = mcts_run
    metrics = json.loads(store.query("SELECT metrics_json FROM stage_runs WHERE experiment_id = ? AND round = 1 "
                                     "AND stage = 'generate' AND status = 'committed'", [cfg.experiment])[1][0][0])
    budget = store.query("SELECT budget_tokens FROM v_round_summary WHERE experiment_id = ? AND round = 1",
                         [cfg.experiment])[1][0][0]
    step_tokens = store.query("SELECT sum(tokens) FROM nodes WHERE experiment_id = ?", [cfg.experiment])[1][0][0]
    assert budget == metrics["search_generated_tokens"] > step_tokens > 0  # steps, their duplicates and rollouts


def test_a_user_asks_the_tree_where_the_value_dropped(mcts_run):
    cfg, _ = mcts_run
    sql = ("SELECT c.depth, count(*) AS steps, round(avg(p.q - c.q), 3) AS drop FROM nodes c JOIN nodes p "
           "ON p.tree_id = c.tree_id AND p.node_id = c.parent_id WHERE c.visits > 0 GROUP BY 1 ORDER BY 1")
    p = run_coevo("query", sql, "--workdir", cfg.workdir, "--format", "json", check=True)
    rows = json.loads(p.stdout)
    assert [r["depth"] for r in rows][:2] == [1, 2] and all(r["steps"] > 0 for r in rows)


def test_export_carries_the_trees(mcts_run, tmp_path):
    import pyarrow.parquet as pq

    cfg, store = mcts_run
    run_coevo("export", cfg.experiment, "--to", "parquet", "--workdir", cfg.workdir, "--out", str(tmp_path / "x"),
              check=True)
    n = store.query("SELECT count(*) FROM nodes WHERE experiment_id = ?", [cfg.experiment])[1][0][0]
    assert n > 0 and pq.read_table(tmp_path / "x" / "nodes.parquet").num_rows == n


def test_the_tree_labels_every_returned_solution_and_the_prm_trains_on_them(mcts_run):
    cfg, store = mcts_run
    by_source = dict(store.query(
        "SELECT source, count(DISTINCT trajectory_id) FROM step_labels l JOIN trajectories t USING (trajectory_id) "
        "WHERE t.experiment_id = ? AND t.round = 1 GROUP BY 1", [cfg.experiment])[1])
    returned = store.query("SELECT count(*) FROM trajectories WHERE experiment_id = ? AND round = 1 "
                           "AND purpose = 'train'", [cfg.experiment])[1][0][0]
    assert by_source["tree_hard"] == returned and "mc_hard" not in by_source  # no rollouts of score's own
    # Where a right answer ended, every step on its way is good; a terminal step's Q is its verified reward.
    assert store.query("""
        SELECT count(*) FROM step_labels l JOIN verifications v USING (trajectory_id)
        WHERE l.source = 'tree_hard' AND v.correct AND l.value <> 1""")[1] == [(0,)]
    wrong_last = store.query("""
        SELECT count(*), count(*) FILTER (WHERE l.value = 0) FROM step_labels l JOIN verifications v
        USING (trajectory_id) JOIN (SELECT trajectory_id, max(step_index) AS last FROM steps GROUP BY 1) s
        USING (trajectory_id) WHERE l.source = 'tree_soft' AND NOT v.correct AND l.step_index = s.last""")[1][0]
    assert wrong_last[0] > 0 and wrong_last[0] == wrong_last[1]
    metrics = json.loads(store.query("SELECT metrics_json FROM stage_runs WHERE experiment_id = ? AND round = 1 "
                                     "AND stage = 'score' AND status = 'committed'", [cfg.experiment])[1][0][0])
    assert metrics["tree_misaligned"] == 0 and metrics["tree_labelled_trajectories"] == returned
    reasons = store.query("SELECT DISTINCT reason FROM selections WHERE purpose = 'reward_train' AND selected "
                          "AND experiment_id = ?", [cfg.experiment])[1]
    assert reasons and all(r.startswith("tree labels") for r, in reasons)
    assert store.committed_model(cfg.experiment, 1, "prm") is not None


def test_dpo_trains_on_pairs_that_part_at_siblings_of_the_tree(mcts_run):
    cfg, store = mcts_run
    pairs = store.query("""
        SELECT p.trajectory_id, p.chosen_from, p.step_index, p.chosen_q - p.rejected_q, p.prefix || p.chosen = c.completion,
               p.prefix || p.rejected = w.completion, vc.correct, vw.correct
        FROM step_pairs p JOIN trajectories w USING (trajectory_id) JOIN trajectories c ON c.trajectory_id = p.chosen_from
        JOIN verifications vc ON vc.trajectory_id = c.trajectory_id JOIN verifications vw ON vw.trajectory_id = w.trajectory_id
        WHERE p.source = 'tree' AND w.experiment_id = ? AND w.problem_id = c.problem_id""", [cfg.experiment])[1]
    assert pairs and all(gap >= 0.25 and whole_c and whole_w and right and not wrong
                         for _, _, _, gap, whole_c, whole_w, right, wrong in pairs)
    selected = store.query("SELECT count(*) FROM selections WHERE purpose = 'step_dpo' AND selected AND reason LIKE "
                           "'tree: parts at step %' AND experiment_id = ?", [cfg.experiment])[1][0][0]
    assert selected == len(pairs)
    uses = dict(store.query("SELECT use, count(*) FROM model_inputs WHERE model_id = ? GROUP BY 1",
                            [store.committed_model(cfg.experiment, 1, "policy")["model_id"]])[1])
    assert uses["step_dpo_rejected"] == len(pairs) and uses["step_dpo_chosen"] >= 1


def test_a_rerun_of_generate_grows_the_same_trees_node_for_node(mcts_run):
    """The same seed and inputs give the same trees. Last in the module: the rerun leaves the round's later
    stages stale."""
    from flows.evolution import run_stage

    cfg, store = mcts_run
    sql = ("SELECT n.tree_id, n.node_id, n.parent_id, n.step_text, n.depth, n.prior, n.visits, n.q, n.value, "
           "n.terminal, n.reward, n.tokens, n.trajectory_id, n.stage_run_id FROM nodes n WHERE n.experiment_id = ? "
           "ORDER BY n.tree_id, n.node_id")
    before = store.query(sql, [cfg.experiment])[1]
    run_stage(experiment=cfg.experiment, round=1, stage="generate", workdir=cfg.workdir)
    after = Store.for_config(cfg).query(sql, [cfg.experiment])[1]
    assert len(before) > 100 and {r[-1] for r in before}.isdisjoint({r[-1] for r in after})  # a new attempt's rows
    assert [r[:-1] for r in after] == [r[:-1] for r in before]


# -- MCTS in score, for a round that sampled without it (score.tree.search) ------------------------------------

LABEL_SEARCH = ["rounds=1", "recipe=coevo", "generate.problems_per_level=20", "generate.samples_per_problem=4",
                "score.tree={pair_margin: 0.25, search: {simulations: 4, expansions: 3, max_step_tokens: 16, "
                "rollouts: 2}}", *TREE_DATA[2:], "train_policy.steps=40", "evaluate.problems_per_level=20",
                "evaluate.maj_k=1"]


@pytest.fixture(scope="module")
def label_run(prefect_server, micro_workdir, tmp_path_factory):
    return _micro_round(micro_workdir, tmp_path_factory, "micro-labels", LABEL_SEARCH)


def test_score_grows_a_tree_from_each_problems_samples_and_labels_every_sample(label_run):
    cfg, store = label_run
    trees = store.query("SELECT purpose, count(*), count(DISTINCT problem_id) FROM v_search WHERE experiment_id = ? "
                        "GROUP BY 1", [cfg.experiment])[1]
    problems = store.query("SELECT count(DISTINCT problem_id) FROM trajectories WHERE experiment_id = ? AND round = 1 "
                           "AND purpose = 'train'", [cfg.experiment])[1][0][0]
    assert trees == [("label", problems, problems)]  # generate sampled plainly: every tree is score's
    # Every sample is labelled from its tree, and every step of a right one is good. (In a tree with no right
    # solution known, a wrong answer's final step alone is labelled.)
    samples, labelled, right_not_good = store.query("""
        SELECT count(DISTINCT s.trajectory_id), count(DISTINCT l.trajectory_id),
               count(*) FILTER (WHERE v.correct AND l.value IS DISTINCT FROM 1)
        FROM steps s JOIN trajectories t USING (trajectory_id) JOIN verifications v USING (trajectory_id)
        LEFT JOIN step_labels l ON l.trajectory_id = s.trajectory_id AND l.step_index = s.step_index
                                AND l.source = 'tree_hard'
        WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train'""", [cfg.experiment])[1][0]
    assert samples == labelled > 0 and right_not_good == 0
    # A sample the tree names is the path from the root to its leaf, step for step.
    rebuilt = store.query(PATHS.replace("WHERE up.parent_id IS NULL", "WHERE up.parent_id IS NULL AND up.terminal"))[1]
    texts = dict(store.query("SELECT trajectory_id, string_agg(text || chr(10), '' ORDER BY step_index) FROM steps "
                             "GROUP BY 1")[1])
    assert rebuilt and all(text == texts[tid] for tid, _, text, _ in rebuilt)
    metrics = json.loads(store.query("SELECT metrics_json FROM stage_runs WHERE experiment_id = ? AND round = 1 "
                                     "AND stage = 'score' AND status = 'committed'", [cfg.experiment])[1][0][0])
    assert metrics["tree_search_trees"] == problems and metrics["tree_search_generated_tokens"] > 0
    assert metrics["tree_search_nodes"] > metrics["tree_search_seeded"] and metrics["tree_misaligned"] == 0
    # The search's tokens are the round's, as Monte Carlo rollouts are.
    sampled, budget = store.query("SELECT generated_tokens, budget_tokens FROM v_round_summary WHERE experiment_id = ? "
                                  "AND round = 1", [cfg.experiment])[1][0]
    assert budget == sampled + metrics["tree_search_generated_tokens"]
    assert store.committed_model(cfg.experiment, 1, "prm") is not None  # trained on tree_hard
    assert store.query("SELECT count(*) FROM step_pairs WHERE source = 'tree'")[1][0][0] > 0


def test_a_rerun_of_score_grows_the_same_trees(label_run):
    from flows.evolution import run_stage

    cfg, store = label_run
    sql = ("SELECT tree_id, node_id, parent_id, step_text, prior, visits, q, value, terminal, reward, tokens, "
           "trajectory_id FROM nodes WHERE experiment_id = ? ORDER BY tree_id, node_id")
    before = store.query(sql, [cfg.experiment])[1]
    run_stage(experiment=cfg.experiment, round=1, stage="score", workdir=cfg.workdir)
    assert Store.for_config(cfg).query(sql, [cfg.experiment])[1] == before and len(before) > 100
