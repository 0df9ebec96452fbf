"""Training data from MCTS trees (components/search/training.py), on test_mcts.py's problem whose answer is known
at every prefix: reach a target sum in three steps of +1, +2 or +3. There the value source is exact (1 where the
target can still be reached), so where rollouts valued the tree, a step's hard label must be exactly whether the
target was still reachable after it; and every pair must be a right answer against a wrong one of the same tree.
"""

from __future__ import annotations

import pytest

from components.search import MCTSConfig, mcts_search, node_rows
from components.search.training import tree_step_labels, tree_step_pairs
from tests.unit.test_mcts import STEPS, _total, expand, reward, rewards, value

TARGETS = ("9", "6", "5")


def reachable(target: int, prefix: str) -> bool:
    s, n = _total(prefix)
    left = STEPS - n
    return s + left <= target <= s + 3 * left


@pytest.fixture(scope="module")
def searched():
    """Each tree's rows as the store holds them, every terminal leaf returned as a trajectory."""
    trees, _ = mcts_search(list(TARGETS), expand, value, rewards, MCTSConfig(simulations=10, expansions=3))
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
                     "misaligned": 0, "unsolved": 0}
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
    assert stats == {"labelled_trajectories": 2, "tree_steps": 3, "rollout_steps": 3, "misaligned": 0, "unsolved": 0}
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


def test_score_grows_a_tree_around_a_rounds_solutions_and_labels_each_of_them():
    """score.tree.search, on test_mcts.py's scripted policy (3+4-2: the first step 3+4=7 leads to the answer, 3+4=8
    never does). The round sampled the wrong solution twice and the right one once; each is a path of the tree,
    duplicates at one leaf. Every step the policy draws there is one of theirs, so the search only adds draws; with
    the right solution left out, it finds it, and rollouts value the new steps."""
    from components.config import LabelSearchSection
    from components.domains.arith import ArithDomain
    from components.domains.base import Problem
    from components.search.training import grow_label_trees
    from components.tables import to_table
    from tests.unit.test_mcts import Scripted

    domain, problem = ArithDomain(), Problem.make("arith", 2, "3+4-2\n", "5")
    texts = {"w1": "3+4=8\n8-2=6\n#### 6", "w2": "3+4=8\n8-2=6\n#### 6", "r": "3+4=7\n7-2=5\n#### 5"}
    trajs = [{"trajectory_id": tid, "problem_id": problem.problem_id, "prompt": problem.prompt, "completion": text}
             for tid, text in texts.items()]
    steps = {tid: domain.split_steps(text) for tid, text in texts.items()}
    correct = {"w1": False, "w2": False, "r": True}
    search = LabelSearchSection(simulations=4, expansions=3, max_step_tokens=16, rollouts=2)
    kw = dict(experiment="e", round=1, seed=3, temperature=0.8, top_p=1.0, max_new_tokens=32)
    nodes, placed, counts = grow_label_trees(domain, Scripted(), {problem.problem_id: problem}, trajs, steps, correct,
                                             search, **kw)
    to_table("nodes", nodes)  # the store's schema
    assert {r["purpose"] for r in nodes} == {"label"} and counts["trees"] == 1 and counts["seeded"] == 6
    assert counts["generated_tokens"] > 0 and counts["nodes"] == len(nodes) == counts["seeded"] + 1
    first = sorted((r["step_text"], r["prior"], r["visits"]) for r in nodes if r["depth"] == 1)
    # Seeded 1 and 2 times, drawn 2 and 1 times; a visit is a value backed up (the search's one: the right leaf
    # selected again), and a draw that joins a seeded step adds none.
    assert first == [("3+4=7\n", 0.5, 2), ("3+4=8\n", 0.5, 2)]
    assert placed["w1"] == placed["w2"] != placed["r"]
    named = {r["trajectory_id"]: r["node_id"] for r in nodes if r["trajectory_id"]}
    assert named == {"r": placed["r"][1], "w1": placed["w1"][1]}  # one name per node: the first id
    labels, stats = tree_step_labels(nodes, trajs, steps, correct, rollouts_valued=True, placed=placed)
    assert stats == {"labelled_trajectories": 3, "tree_steps": 9, "rollout_steps": 0, "misaligned": 0, "unsolved": 0}
    hard = {(r["trajectory_id"], r["step_index"]): r["value"] for r in labels if r["source"] == "tree_hard"}
    assert hard == {(t, i): float(t == "r") for t in texts for i in range(3)}
    soft = {(r["trajectory_id"], r["step_index"]): r["value"] for r in labels if r["source"] == "tree_soft"}
    assert soft[("w1", 0)] == 0.0 and soft[("r", 2)] == 1.0 and 0.0 < soft[("r", 0)] <= 1.0
    pairs = tree_step_pairs(nodes, trajs, correct, margin=0.5, placed=placed)
    assert [(p["trajectory_id"], p["chosen_from"], p["step_index"]) for p in pairs] == [("w1", "r", 0), ("w2", "r", 0)]
    # The same inputs and seed grow the same tree.
    again = grow_label_trees(domain, Scripted(), {problem.problem_id: problem}, trajs, steps, correct, search, **kw)
    assert again == (nodes, placed, counts)
    # With the right solution left out of the round, the search finds it beside the wrong one's first step.
    alone, placed1, _ = grow_label_trees(domain, Scripted(), {problem.problem_id: problem}, trajs[:1],
                                         {"w1": steps["w1"]}, {"w1": False}, search, **kw)
    assert any(r["terminal"] and r["reward"] == 1.0 for r in alone) and list(placed1) == ["w1"]
    assert [r["value"] for r in alone if r["depth"] == 1] == [None, 1.0]  # seeded 3+4=8; drawn 3+4=7, rolled out


def test_an_answer_in_a_tree_with_no_right_solution_gets_its_final_step_labelled_only():
    """No right leaf, trajectory or rollout anywhere in the tree: the policy could not finish from any of its steps,
    which does not make them wrong. As first_error labels an answer it does not search, only the final one is bad."""
    nodes = [ROOT | {"q": 0.0}, _node(1, 0, "a\n", 1, q=0.0, value=0.0),
             _node(2, 1, "b\n", 2, q=0.0, terminal=True, reward=0.0, trajectory_id="w")]
    args = (nodes, [{"trajectory_id": "w", "completion": "a\nb\n"}], {"w": ["a", "b"]}, {"w": False})
    labels, stats = tree_step_labels(*args, rollouts_valued=True)
    assert {(r["step_index"], r["source"], r["value"]) for r in labels} == {(1, "tree_hard", 0.0), (1, "tree_soft", 0.0)}
    assert stats["unsolved"] == 1 and stats["labelled_trajectories"] == 1 and stats["tree_steps"] == 0
    labels, stats = tree_step_labels(*args, rollouts_valued=True, label_unsolved=True)
    assert sorted((r["step_index"], r["value"]) for r in labels if r["source"] == "tree_hard") == [(0, 0.0), (1, 0.0)]
    assert stats["unsolved"] == 0 and stats["tree_steps"] == 2
