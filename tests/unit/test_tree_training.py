"""Training data from MCTS trees (components/search/training.py), on test_mcts.py's problem whose answer is known
at every prefix: reach a target sum in three steps of +1, +2 or +3. There the value source is exact (1 where the
target can still be reached), so where rollouts valued the tree, a step's hard label must be exactly whether the
target was still reachable after it; and every pair must be a right answer against a wrong one of the same tree.
"""

from __future__ import annotations

import pytest

from components.search import MCTSConfig, mcts_search, node_rows
from components.search.training import tree_step_labels, tree_step_pairs
from tests.unit.test_mcts import STEPS, _total, expand, reward, value

TARGETS = ("9", "6", "5")


def reachable(target: int, prefix: str) -> bool:
    s, n = _total(prefix)
    left = STEPS - n
    return s + left <= target <= s + 3 * left


@pytest.fixture(scope="module")
def searched():
    """Each tree's rows as the store holds them, every terminal leaf returned as a trajectory."""
    trees, _ = mcts_search(list(TARGETS), expand, value, reward, MCTSConfig(simulations=10, expansions=3))
    nodes, trajs, correct = [], [], {}
    for tree in trees:
        for row in node_rows(tree):
            leaf = tree.nodes[row["node_id"]]
            tid = f"{tree.prompt}/{leaf.node_id}" if leaf.terminal else None
            nodes.append({"tree_id": tree.prompt, "problem_id": tree.prompt} | row | {"trajectory_id": tid})
            if tid:
                text = tree.prefix(leaf.node_id)
                trajs.append({"trajectory_id": tid, "problem_id": tree.prompt, "completion": text})
                correct[tid] = reward(tree.prompt, text) == 1.0
    steps = {t["trajectory_id"]: t["completion"].splitlines() for t in trajs}
    return nodes, trajs, steps, correct


def test_hard_labels_are_exactly_whether_the_answer_was_still_reachable(searched):
    nodes, trajs, steps, correct = searched
    assert sum(correct.values()) >= 3 and not all(correct.values())  # right and wrong answers in the trees
    labels, stats = tree_step_labels(nodes, trajs, steps, correct, rollouts_valued=True)
    assert stats == {"labelled_trajectories": len(trajs), "tree_steps": STEPS * len(trajs), "rollout_steps": 0,
                     "misaligned": 0}
    by = {(r["trajectory_id"], r["step_index"], r["source"]): r["value"] for r in labels}
    text = {t["trajectory_id"]: t for t in trajs}
    for tid, own in steps.items():
        target = int(text[tid]["problem_id"])
        for i in range(STEPS):
            alive = reachable(target, "".join(s + "\n" for s in own[:i + 1]))
            assert by[(tid, i, "tree_hard")] == float(alive), (tid, i)
            assert 0.0 <= by[(tid, i, "tree_soft")] <= 1.0
        # The last step's Q is its verified reward, backed up exactly.
        assert by[(tid, STEPS - 1, "tree_soft")] == float(correct[tid])
    # A PRM's values are no evidence of a right solution: a step is good only where a right leaf is below it.
    prm_labels, _ = tree_step_labels(nodes, trajs, steps, correct, rollouts_valued=False)
    hard = {(r["trajectory_id"], r["step_index"]): r["value"] for r in prm_labels if r["source"] == "tree_hard"}
    assert all(v <= by[(tid, i, "tree_hard")] for (tid, i), v in hard.items())


def test_pairs_are_right_against_wrong_parting_at_siblings_apart_in_q(searched):
    nodes, trajs, _, correct = searched
    pairs = tree_step_pairs(nodes, trajs, correct, margin=0.25)
    text = {t["trajectory_id"]: t["completion"] for t in trajs}
    wrong_in_solved = {tid for tid, ok in correct.items() if not ok
                       and any(correct[r] for r in correct if r.split("/")[0] == tid.split("/")[0])}
    assert pairs and {p["trajectory_id"] for p in pairs} <= wrong_in_solved
    for p in pairs:
        assert correct[p["chosen_from"]] and not correct[p["trajectory_id"]]
        assert p["chosen_from"].split("/")[0] == p["trajectory_id"].split("/")[0]  # the same tree
        assert p["prefix"] + p["chosen"] == text[p["chosen_from"]]
        assert p["prefix"] + p["rejected"] == text[p["trajectory_id"]]
        assert p["prefix"].count("\n") == p["step_index"]
        assert p["chosen"].splitlines()[0] != p["rejected"].splitlines()[0]  # they part at the next step
        assert p["chosen_q"] - p["rejected_q"] >= 0.25 and p["source"] == "tree"
    assert len(pairs) >= len(tree_step_pairs(nodes, trajs, correct, margin=0.9))
    assert tree_step_pairs(nodes, trajs, correct, margin=1.0) == [
        p for p in tree_step_pairs(nodes, trajs, correct, margin=0.0) if p["chosen_q"] - p["rejected_q"] >= 1.0]


ROOT = {"tree_id": "t", "problem_id": "t", "node_id": 0, "parent_id": None, "step_text": "", "depth": 0,
        "prior": 1.0, "visits": 3, "q": 0.5, "value": None, "terminal": False, "reward": None, "tokens": 0,
        "trajectory_id": None}


def _node(i: int, parent: int, text: str, depth: int, **kw) -> dict:
    return ROOT | {"node_id": i, "parent_id": parent, "step_text": text, "depth": depth, "visits": 1} | kw


def test_a_rollouts_own_steps_are_labelled_by_its_outcome_only():
    """Two nodes completed by rollouts: the right rollout's steps are all good; of the wrong one's, only the final
    step (its wrong answer) is labelled. A pair needs the sides to part at siblings, not inside a rollout."""
    nodes = [ROOT, _node(1, 0, "a\n", 1, q=0.5, value=0.5, trajectory_id="right"),
             _node(2, 1, "b\n", 2, q=0.0, value=0.0, trajectory_id="wrong")]
    trajs = [{"trajectory_id": "right", "completion": "a\nx\ny\n"}, {"trajectory_id": "wrong", "completion": "a\nb\nz\nw\n"}]
    steps = {t["trajectory_id"]: t["completion"].splitlines() for t in trajs}
    correct = {"right": True, "wrong": False}
    labels, stats = tree_step_labels(nodes, trajs, steps, correct, rollouts_valued=True)
    got = {(r["trajectory_id"], r["step_index"], r["source"]): r["value"] for r in labels}
    assert got == {("right", 0, "tree_soft"): 0.5, ("right", 0, "tree_hard"): 1.0,
                   ("right", 1, "tree_hard"): 1.0, ("right", 2, "tree_hard"): 1.0, ("right", 2, "tree_soft"): 1.0,
                   ("wrong", 0, "tree_soft"): 0.5, ("wrong", 0, "tree_hard"): 1.0,
                   ("wrong", 1, "tree_soft"): 0.0, ("wrong", 1, "tree_hard"): 0.0,
                   ("wrong", 3, "tree_hard"): 0.0, ("wrong", 3, "tree_soft"): 0.0}
    assert stats == {"labelled_trajectories": 2, "tree_steps": 3, "rollout_steps": 3, "misaligned": 0}
    assert tree_step_pairs(nodes, trajs, correct, margin=0.0) == []  # "wrong" parts from "right" inside a rollout
    # A node a rollout solved from is good where rollouts valued the tree, though no right answer came back
    # through it; where a PRM valued it, its value says nothing of a right solution.
    nodes += [_node(3, 0, "c\n", 1, q=0.25, value=0.5), _node(4, 3, "d\n", 2, q=0.0, terminal=True, reward=0.0,
                                                             trajectory_id="c")]
    trajs.append({"trajectory_id": "c", "completion": "c\nd\n"})
    for rollouts, good in ((True, 1.0), (False, 0.0)):
        labels, _ = tree_step_labels(nodes, trajs, {**steps, "c": ["c", "d"]}, correct | {"c": False},
                                     rollouts_valued=rollouts)
        assert [r["value"] for r in labels if r["trajectory_id"] == "c" and r["source"] == "tree_hard"] == [good, 0.0]


def test_a_trajectory_whose_steps_are_not_its_path_is_left_unlabelled():
    nodes = [ROOT, _node(1, 0, "a\n", 1, q=1.0, terminal=True, reward=1.0, trajectory_id="t1")]
    labels, stats = tree_step_labels(nodes, [{"trajectory_id": "t1", "completion": "a\n"}], {"t1": ["b"]},
                                     {"t1": True}, rollouts_valued=True)
    assert labels == [] and stats["misaligned"] == 1
