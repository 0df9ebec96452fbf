"""Training data from a search's trees (the store's `nodes` rows): step labels from the nodes' Q, and step
preference pairs from sibling nodes, for the PRM and for DPO, with no rollouts beyond the search's own.

    labels, stats = tree_step_labels(nodes, trajectories, steps, correct, rollouts_valued=True)
    pairs = tree_step_pairs(nodes, trajectories, correct, margin=0.25)

    # a round that sampled without MCTS: score grows the trees around its solutions
    nodes, placed, counts = grow_label_trees(domain, backend, problems, trajectories, steps, correct, search, ...)
    labels, stats = tree_step_labels(nodes, trajectories, steps, correct, rollouts_valued=True, placed=placed)

A trajectory the search returned names its node (`nodes.trajectory_id`): a terminal leaf, whose path is the whole
solution, or a node one of its rollouts completed, whose path is the solution's first steps. Each path step is
one node, so its labels are the node's:

- `tree_soft`: the node's Q, the mean of the values backed up through it (the verifier's rewards at terminal
  nodes below it, rollouts' shares or a PRM's scores at the others): rStar-Math's Q-value annotation;
- `tree_hard`: 1 where a right solution is known to pass through the node (a right terminal leaf below it, a
  right trajectory through it, or, where rollouts valued the tree, a rollout from it or below that reached the
  answer), else 0: Math-Shepherd's hard estimate, over what the search drew.

For a round that did not sample by MCTS, `grow_label_trees` grows the trees in score: each problem's starts from
the round's solutions, their steps seeded as paths and each backed up with its verifier's reward, and the
simulations draw K steps beside theirs (`Tree.seed`). Every solution is then a path of the tree, ending at its own
terminal leaf; `placed` says which (the `nodes` rows name one trajectory per node, and duplicates share one).

In a tree where no right solution is known at all (its root is not right), every step would be labelled bad,
though many are right: the policy could not finish from them, which is not an error in them. Such an answer gets
only its final step labelled (bad), as first_error labels an answer it does not search; `label_unsolved` labels
them all.

A rollout's own steps (after the node it completed) are labelled as `score.mc_strategy=first_error` labels a
trajectory it did not search: each step of a right one good, only the final step of a wrong one bad.

Pairs (MCTS-DPO, Xie et al. 2024; Step-DPO, Lai et al. 2024): a wrong trajectory against a right one of the same
tree where their paths split at two siblings whose Q differs by at least `margin`. Both sides are whole
solutions sharing the prefix up to the split, so the DPO margin falls on the step where they part.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any


class _Tree:
    """One tree's `nodes` rows, by node id, with each node's children."""

    def __init__(self, rows: list[dict[str, Any]]):
        self.nodes = {r["node_id"]: r for r in rows}
        self.root = next(r["node_id"] for r in rows if r["parent_id"] is None)
        self.children: dict[int, list[int]] = defaultdict(list)
        for r in rows:
            if r["parent_id"] is not None:
                self.children[r["parent_id"]].append(r["node_id"])

    def right(self, correct: dict[str, bool | None], rollouts_valued: bool) -> dict[int, bool]:
        """node id -> whether a right solution is known to pass through it (the module docstring's tree_hard)."""
        right: dict[int, bool] = {}
        for nid in sorted(self.nodes, key=lambda i: -self.nodes[i]["depth"]):  # children before their parents
            n = self.nodes[nid]
            right[nid] = bool(
                (n["terminal"] and n["reward"] == 1.0)
                or (n["trajectory_id"] is not None and correct.get(n["trajectory_id"]) is True)
                or (rollouts_valued and not n["terminal"] and (n["value"] or 0.0) > 0.0)
                or any(right[c] for c in self.children[nid]))
        return right

    def path(self, node_id: int) -> list[dict[str, Any]]:
        """The nodes from the root's first child down to `node_id` (the root, the problem, is left out)."""
        out = []
        at = node_id
        while self.nodes[at]["parent_id"] is not None:
            out.append(self.nodes[at])
            at = self.nodes[at]["parent_id"]
        return out[::-1]


def _trees(nodes: Iterable[dict[str, Any]]) -> dict[str, _Tree]:
    by_tree: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in nodes:
        by_tree[r["tree_id"]].append(r)
    return {tid: _Tree(rows) for tid, rows in by_tree.items()}


def _leaves(trees: dict[str, _Tree], placed: dict[str, tuple[str, int]] | None) -> dict[str, tuple[_Tree, int]]:
    """trajectory id -> (its tree, the node it became): `placed`'s (tree id, node id) where given, else the nodes
    that name a trajectory."""
    if placed is not None:
        return {tid: (trees[tree_id], nid) for tid, (tree_id, nid) in placed.items() if tree_id in trees}
    return {n["trajectory_id"]: (t, nid) for t in trees.values() for nid, n in t.nodes.items()
            if n["trajectory_id"] is not None}


def grow_label_trees(domain: Any, backend: Any, problems: dict[str, Any], trajectories: list[dict[str, Any]],
                     steps: dict[str, list[str]], correct: dict[str, bool | None], search: Any, *, experiment: str,
                     round: int, seed: int, temperature: float, top_p: float, max_new_tokens: int,
                     value: Any = None, progress: Any = None,
                     ) -> tuple[list[dict[str, Any]], dict[str, tuple[str, int]], dict[str, float]]:
    """score.tree.search (`search`: its section): one tree per prompt, seeded with the round's solutions to it in
    trajectory id order (each solution's `steps` a path, its verifier's reward backed up once), then searched with
    the policy's `backend` for the section's simulations and budget, K steps drawn beside the seeded ones, valued
    by rollouts or by `value` (a PRM's). `problems` maps problem id to Problem. Returns the trees as `nodes` rows
    (purpose 'label'; a node names the first trajectory that ended there), `placed` (trajectory id -> tree id and
    node id of its terminal leaf) and the search's counts."""
    from components.search.mcts import MCTSConfig, Tree
    from components.search.policy import mcts_sample

    sep = domain.step_separator
    seeds: dict[str, list[tuple[str, list[str]]]] = {}  # prompt -> [(trajectory id, its steps)]
    owner: dict[str, Any] = {}  # prompt -> the problem its tree is filed under: the lowest id of that prompt
    for t in sorted(trajectories, key=lambda t: t["trajectory_id"]):
        own = steps.get(t["trajectory_id"])
        if not own:
            continue
        p = problems[t["problem_id"]]
        seeds.setdefault(p.prompt, []).append((t["trajectory_id"], [s + sep for s in own]))
        if p.prompt not in owner or p.problem_id < owner[p.prompt].problem_id:
            owner[p.prompt] = p
    todo = [owner[prompt] for prompt in sorted(seeds)]
    trees, leaf_of = [], {}
    for p in todo:
        tree = Tree(p.prompt)
        for tid, path in seeds[p.prompt]:
            leaf_of[tid] = (p, tree.seed(path, 1.0 if correct.get(tid) is True else 0.0).node_id)
        trees.append(tree)
    if not trees:
        return [], {}, {"trees": 0, "seeded": 0, "generated_tokens": 0, "backend_calls": 0, "nodes": 0}
    seeded = sum(len(t.nodes) - 1 for t in trees)
    trees, _, stats = mcts_sample(domain, backend, todo, MCTSConfig.of(search, len(todo)), temperature=temperature,
                                  top_p=top_p, max_step_tokens=search.max_step_tokens, max_new_tokens=max_new_tokens,
                                  seed=seed, rollouts=search.rollouts, value=value, progress=progress, trees=trees)
    rows, placed = label_tree_rows(todo, trees, leaf_of, experiment=experiment, round=round)
    counts = {"trees": len(trees), "seeded": seeded, "generated_tokens": stats["generated_tokens"],
              "backend_calls": stats["backend_calls"], "nodes": stats["nodes"]}
    return rows, placed, counts


def label_tree_rows(problems: list[Any], trees: list[Any], leaf_of: dict[str, tuple[Any, int]], *, experiment: str,
                    round: int) -> tuple[list[dict[str, Any]], dict[str, tuple[str, int]]]:
    """Trees grown in score (purpose 'label'), one per problem, as `nodes` rows, each node naming the first
    trajectory (by id) that ended there; and `placed`: trajectory id -> its tree id and the node it ended at
    (`leaf_of` gives the problem and node id)."""
    from components.generation import search_tree_id
    from components.search.mcts import node_rows

    tree_ids = {p.problem_id: search_tree_id(experiment, round, "label", p.problem_id) for p in problems}
    placed = {tid: (tree_ids[p.problem_id], nid) for tid, (p, nid) in leaf_of.items()}
    names: dict[tuple[str, int], str] = {}
    for tid in sorted(placed):
        names.setdefault(placed[tid], tid)
    rows = [{"tree_id": tree_ids[p.problem_id], "experiment_id": experiment, "round": round, "purpose": "label",
             "problem_id": p.problem_id} | row | {"trajectory_id": names.get((tree_ids[p.problem_id], row["node_id"]))}
            for p, tree in zip(problems, trees, strict=True) for row in node_rows(tree)]
    return rows, placed


def tree_step_labels(nodes: Iterable[dict[str, Any]], trajectories: list[dict[str, Any]],
                     steps: dict[str, list[str]], correct: dict[str, bool | None], *, rollouts_valued: bool,
                     placed: dict[str, tuple[str, int]] | None = None, label_unsolved: bool = False,
                     ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """`step_labels` rows (sources tree_soft and tree_hard; see the module docstring) for every trajectory the
    trees returned, and counts: `labelled_trajectories`, `tree_steps` (labelled from nodes), `rollout_steps`
    (from a rollout's outcome), `misaligned` (a trajectory whose stored steps are not its path's: left
    unlabelled) and `unsolved` (an answer in a tree with no right solution known: its final step alone labelled,
    unless `label_unsolved`). `steps` maps a trajectory to its `domain.split_steps` texts; `rollouts_valued` says
    whether rollouts, not a PRM, valued the open nodes; `placed`, where given, is where each trajectory ended
    (`grow_label_trees`)."""
    trees = _trees(nodes)
    right = {id(t): t.right(correct, rollouts_valued) for t in trees.values()}
    leaves = _leaves(trees, placed)
    rows: list[dict[str, Any]] = []
    stats = {"labelled_trajectories": 0, "tree_steps": 0, "rollout_steps": 0, "misaligned": 0, "unsolved": 0}
    for traj in sorted(trajectories, key=lambda t: t["trajectory_id"]):
        tid = traj["trajectory_id"]
        if tid not in leaves:
            continue
        tree, nid = leaves[tid]
        path = [n for n in tree.path(nid) if n["step_text"]]  # an EOS node ends the solution with no step
        own = steps.get(tid, [])
        if len(own) < len(path) or any(s.strip() != n["step_text"].strip() for s, n in zip(own, path)):
            stats["misaligned"] += 1
            continue
        stats["labelled_trajectories"] += 1

        def row(i: int, source: str, value: float, rollouts: int) -> dict[str, Any]:
            return {"trajectory_id": tid, "step_index": i, "source": source, "value": value, "num_rollouts": rollouts}

        if not right[id(tree)][tree.root] and not label_unsolved:  # dead ends for this policy, not known errors
            stats["unsolved"] += 1
            if own and correct.get(tid) is False:
                rows += [row(len(own) - 1, "tree_hard", 0.0, 1), row(len(own) - 1, "tree_soft", 0.0, 1)]
            continue

        for i, n in enumerate(path):
            if n["visits"]:
                rows.append(row(i, "tree_soft", float(n["q"]), n["visits"]))
            rows.append(row(i, "tree_hard", float(right[id(tree)][n["node_id"]]), n["visits"]))
            stats["tree_steps"] += 1
        tail = range(len(path), len(own))
        ok = correct.get(tid)
        if tail and ok is True:  # the rollout is itself a right completion of each of its prefixes
            rows += [row(i, "tree_hard", 1.0, 1) for i in tail] + [row(tail[-1], "tree_soft", 1.0, 1)]
            stats["rollout_steps"] += len(tail)
        elif tail and ok is False:  # only the final step's value is known: the wrong answer itself
            rows += [row(tail[-1], "tree_hard", 0.0, 1), row(tail[-1], "tree_soft", 0.0, 1)]
            stats["rollout_steps"] += 1
    return rows, stats


def tree_step_pairs(nodes: Iterable[dict[str, Any]], trajectories: list[dict[str, Any]],
                    correct: dict[str, bool | None], *, margin: float, min_visits: int = 1,
                    placed: dict[str, tuple[str, int]] | None = None) -> list[dict[str, Any]]:
    """`step_pairs` rows (source `tree`): for each wrong trajectory, the right trajectory of its tree whose path
    parts from its own at siblings with Q apart by at least `margin` (each visited `min_visits` times): the
    widest gap, then the longest shared prefix, then the lower trajectory id. Where one path contains the other
    (a rollout completed an ancestor of the other's node), they part inside a rollout, not at siblings: no pair.

    >>> nodes = [{"tree_id": "t", "node_id": 0, "parent_id": None, "step_text": "", "depth": 0, "visits": 4,
    ...           "q": 0.5, "value": None, "terminal": False, "reward": None, "trajectory_id": None}]
    >>> for i, (text, r, tid) in enumerate([("1+1=2\\n", 1.0, "a"), ("1+1=3\\n", 0.0, "b")], 1):
    ...     nodes.append({"tree_id": "t", "node_id": i, "parent_id": 0, "step_text": text, "depth": 1, "visits": 2,
    ...                   "q": r, "value": None, "terminal": True, "reward": r, "trajectory_id": tid})
    >>> trajs = [{"trajectory_id": "a", "completion": "1+1=2\\n"}, {"trajectory_id": "b", "completion": "1+1=3\\n"}]
    >>> [(p["trajectory_id"], p["step_index"], p["chosen"], p["chosen_from"])
    ...  for p in tree_step_pairs(nodes, trajs, {"a": True, "b": False}, margin=0.5)]
    [('b', 0, '1+1=2\\n', 'a')]
    """
    leaves = _leaves(_trees(nodes), placed)
    by_id = {t["trajectory_id"]: t for t in trajectories if t["trajectory_id"] in leaves}
    right_in: dict[int, list[str]] = defaultdict(list)  # id(tree) -> its right trajectories
    for tid in sorted(by_id):
        if correct.get(tid) is True:
            right_in[id(leaves[tid][0])].append(tid)
    pairs = []
    for wrong in sorted(by_id):
        if correct.get(wrong) is not False:
            continue
        tree, w_node = leaves[wrong]
        w_nodes = tree.path(w_node)
        w_path = [n["node_id"] for n in w_nodes]
        best = None
        for right in right_in[id(tree)]:
            r_path = [n["node_id"] for n in tree.path(leaves[right][1])]
            shared = next((i for i, (a, b) in enumerate(zip(r_path, w_path)) if a != b), None)
            if shared is None:  # one path is a prefix of the other
                continue
            a, b = tree.nodes[r_path[shared]], tree.nodes[w_path[shared]]
            if min(a["visits"], b["visits"]) < max(min_visits, 1) or a["q"] - b["q"] < margin:
                continue
            key = (-(a["q"] - b["q"]), -shared, right)
            if best is None or key < best[0]:
                best = (key, right, shared, a, b)
        if best is None:
            continue
        _, right, shared, a, b = best
        prefix = "".join(n["step_text"] for n in w_nodes[:shared])
        chosen, rejected = by_id[right]["completion"], by_id[wrong]["completion"]
        if not (chosen.startswith(prefix) and rejected.startswith(prefix)):
            raise ValueError(f"tree_step_pairs: {wrong} or {right} does not start with its tree path's steps")
        pairs.append({"trajectory_id": wrong, "step_index": shared, "prefix": prefix,
                      "chosen": chosen[len(prefix):], "rejected": rejected[len(prefix):], "chosen_from": right,
                      "source": "tree", "chosen_q": float(a["q"]), "rejected_q": float(b["q"])})
    return pairs
