"""MCTS over steps (components/search/mcts.py) on a problem whose tree is known: reach a target sum in three
steps of +1, +2 or +3. The policy prefers +1 (the wrong step for a target of 9), the value source is the
fraction of the remaining distance a prefix can still cover, and the verifier pays 1 at the target.

The search must find the solution the policy alone would not, put its visits on it, back up Q and visits
consistently, be deterministic and stop at its token budget (test_tree_training.py: the training data the tree
gives).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from components.search import Candidate, MCTSConfig, mcts_search, node_rows

STEPS = 3
LOGPROBS = {1: -0.2, 2: -1.5, 3: -2.5}  # the policy's preference: +1 first


def _total(prefix: str) -> tuple[int, int]:
    parts = [int(line.removeprefix("+")) for line in prefix.splitlines() if line]
    return sum(parts), len(parts)


def expand(pairs, k):
    out = []
    for _, prefix in pairs:
        _, n = _total(prefix)
        out.append([Candidate(f"+{d}\n", LOGPROBS[d] * 2, 2, n + 1 == STEPS) for d in (1, 2, 3)][:k])
    return out


def value(pairs):
    vals = []
    for prompt, prefix in pairs:
        target, (s, n) = int(prompt), _total(prefix)
        left = STEPS - n
        vals.append(1.0 if s + left <= target <= s + 3 * left else 0.0)
    return vals, 0


def reward(prompt, solution):
    return float(_total(solution)[0] == int(prompt))


def rewards(pairs):  # as mcts_search takes it: every solution that ended in a simulation, in one call
    return [reward(p, s) for p, s in pairs]


def test_the_search_finds_what_the_policy_alone_would_not():
    trees, spent = mcts_search(["9", "5"], expand, value, rewards, MCTSConfig(simulations=12, expansions=3))
    for tree, target in zip(trees, (9, 5)):
        best = tree.best_leaf()
        assert best.terminal and best.reward == 1.0 and _total(tree.prefix(best.node_id))[0] == target
    nine = trees[0]
    # The greedy path (+1 +1 +1 = 3) cannot reach 9; the only solution is +3 +3 +3.
    assert nine.prefix(nine.best_leaf().node_id) == "+3\n+3\n+3\n"
    root_kids = [nine.nodes[c] for c in nine.nodes[0].children]
    assert [k.text for k in root_kids] == ["+1\n", "+2\n", "+3\n"]
    # Backed-up Q ranks the first step right, against the policy's prior.
    assert max(root_kids, key=lambda k: k.q).text == "+3\n", [(k.text, k.visits, k.q) for k in root_kids]
    assert root_kids[0].prior > root_kids[1].prior > root_kids[2].prior
    assert sum(k.prior for k in root_kids) == pytest.approx(1.0)
    assert spent == sum(n.tokens for t in trees for n in t.nodes)


def test_visits_and_values_back_up_consistently():
    """An inner node is backed up once when it is made (its own value) and once per visit below it; the root
    only through its children. Exactly, node by node."""
    trees, _ = mcts_search(["9"], expand, value, rewards, MCTSConfig(simulations=10, expansions=3))
    tree = trees[0]
    inner = [n for n in tree.nodes if n.children]
    assert len(inner) > 3
    for n in inner:
        own = 0 if n.parent_id is None else 1
        assert n.visits == own + sum(tree.nodes[c].visits for c in n.children)
        assert n.value_sum == pytest.approx((n.value or 0.0) * own + sum(tree.nodes[c].value_sum for c in n.children))
    assert all(n.q is None or 0.0 <= n.q <= 1.0 for n in tree.nodes)
    rows = node_rows(tree)
    assert [r["node_id"] for r in rows] == list(range(len(tree.nodes)))
    assert all(r["parent_id"] is None or r["parent_id"] < r["node_id"] for r in rows)
    assert {r["depth"] for r in rows if r["terminal"]} == {STEPS}
    assert all(r["reward"] in (0.0, 1.0) for r in rows if r["terminal"])


def test_same_inputs_same_tree_and_the_budget_stops_it():
    cfg = MCTSConfig(simulations=8, expansions=3)
    a = [node_rows(t) for t in mcts_search(["9", "7"], expand, value, rewards, cfg)[0]]
    b = [node_rows(t) for t in mcts_search(["9", "7"], expand, value, rewards, cfg)[0]]
    assert a == b
    trees, spent = mcts_search(["9", "7"], expand, value, rewards, MCTSConfig(simulations=8, expansions=3,
                                                                             token_budget=20))
    # Each simulation expands one leaf per tree, 3 candidates of 2 tokens: 12 tokens a simulation, 6 a leaf. The
    # 8 tokens left after the first pay for one more leaf, the first tree's; then 2 are left, less than a leaf.
    assert spent == 18 and [len(t.nodes) for t in trees] == [1 + 2 * 3, 1 + 3]
    _, spent = mcts_search(["9", "7"], expand, value, rewards, MCTSConfig(simulations=8, expansions=3, token_budget=24))
    assert spent == 24


@pytest.mark.parametrize("field, value_, said", [
    ("simulations", 0, "mcts.simulations must be >= 1"),
    ("expansions", 0, "mcts.expansions must be >= 1"),
    ("token_budget", 0, "mcts.token_budget must be >= 1"),
    ("c_puct", -1.0, "mcts.c_puct must be >= 0"),
    ("widening", 1.0, r"mcts.widening must be in \[0, 1\)"),
])
def test_settings_out_of_range_are_refused(field, value_, said):
    with pytest.raises(ValueError, match=said):
        MCTSConfig(**{field: value_})


def _sure_policy(rng: random.Random):
    """A sampling policy that draws +1 four times in six: identical draws of a node are one candidate, weighted by
    how many of the K drew it (as the policy samplers merge them)."""
    def expand(pairs, k):
        out = []
        for _, prefix in pairs:
            _, n = _total(prefix)
            drawn = Counter(rng.choices((1, 2, 3), weights=(4, 1, 1), k=k))
            out.append([Candidate(f"+{d}\n", LOGPROBS[d] * 2 * c, 2 * c, n + 1 == STEPS, weight=c)
                        for d, c in sorted(drawn.items())])
        return out
    return expand


def test_progressive_widening_keeps_drawing_where_every_path_has_ended():
    """Without widening a node draws once, so a policy that prefers +1 leaves a few distinct paths; once they have
    ended, simulations only count their rewards again: 80 spend what 40 spent, and +3 +3 +3 is seldom found. With
    widening (alpha 0.5) the nodes visited most draw again: more simulations spend more, and find it more often.
    Measured over 20 policy seeds: found at 1 without widening, 8 with it."""
    found, spent = {}, {}
    for alpha in (0.0, 0.5):
        for sims in (40, 80):
            runs = [mcts_search(["9"], _sure_policy(random.Random(seed)), value, rewards,
                                MCTSConfig(simulations=sims, expansions=3, widening=alpha)) for seed in range(20)]
            spent[alpha, sims] = [s for _, s in runs]
            found[alpha, sims] = sum(t[0].best_leaf().reward == 1.0 for t, _ in runs)
    # every path had ended by 40 simulations in 19 trees of 20: nothing left to draw (measured: 19 of 20)
    assert sum(a != b for a, b in zip(spent[0.0, 40], spent[0.0, 80])) <= 1, spent
    assert all(b > a for a, b in zip(spent[0.5, 40], spent[0.5, 80]))
    assert found[0.5, 80] >= found[0.0, 80] + 4, found
    trees, _ = mcts_search(["9"], _sure_policy(random.Random(0)), value, rewards,
                           MCTSConfig(simulations=80, expansions=3, widening=0.5))
    tree = trees[0]
    assert max(n.rounds for n in tree.nodes) > 1
    for n in tree.nodes:  # a step drawn again joined its node: siblings differ, and priors are shares of the draws
        kids = [tree.nodes[c] for c in n.children]
        assert len({(k.text, k.terminal) for k in kids}) == len(kids)
        if n.rounds > 1:
            assert all(k.prior == pytest.approx(k.draws / sum(x.draws for x in kids)) for k in kids)


def test_a_node_that_draws_nothing_new_counts_as_drawn_under_widening():
    """A seeded node where the policy draws nothing new keeps its seeded steps and counts one round of draws, so
    widening does not send every later simulation back to it: each node is asked once in six simulations."""
    from components.search import Tree

    tree = Tree("9")
    tree.seed(["+1\n", "+1\n", "+1\n"], 0.0)
    tree.seed(["+2\n", "+2\n", "+2\n"], 0.0)
    asked: list[str] = []

    def nothing(pairs, k):
        asked.extend(prefix for _, prefix in pairs)
        return [[] for _ in pairs]

    mcts_search(["9"], nothing, value, rewards, MCTSConfig(simulations=6, expansions=3, widening=0.5), trees=[tree])
    assert asked and len(asked) == len(set(asked)), asked
    assert all(n.expanded and n.rounds == 1 for n in tree.nodes if n.children)


def test_callbacks_that_break_their_contract_are_named():
    with pytest.raises(ValueError, match="expand returned 0 lists of candidates for 1 leaves"):
        mcts_search(["9"], lambda pairs, k: [], value, rewards, MCTSConfig(simulations=1))
    with pytest.raises(ValueError, match=r"value nan for a prefix of '9' is outside \[0, 1\]"):
        mcts_search(["9"], expand, lambda pairs: ([math.nan] * len(pairs), 0), rewards, MCTSConfig(simulations=1))
    with pytest.raises(ValueError, match="reward returned 0 rewards for 3 solutions"):
        mcts_search(["9"], expand, value, lambda pairs: [], MCTSConfig(simulations=4))


def test_a_tree_seeded_with_solutions_drawn_before_is_widened_by_the_search():
    """score.tree.search: the round's solutions are paths of the tree before any simulation; the search draws
    beside them, merging a draw of a seeded step into its node, and finds what none of them held."""
    from components.search import Tree

    tree = Tree("9")
    wrong = [["+1\n", "+1\n", "+1\n"], ["+1\n", "+1\n", "+1\n"], ["+2\n", "+2\n", "+2\n"]]
    leaves = [tree.seed(path, 0.0) for path in wrong]
    assert leaves[0] is leaves[1] and leaves[0].visits == 2 and leaves[2].visits == 1  # a duplicate joins its leaf
    first = [tree.nodes[c] for c in tree.nodes[0].children]
    assert [(n.text, n.draws, round(n.prior, 3), n.visits, n.tokens) for n in first] == [
        ("+1\n", 2, 0.667, 2, 0), ("+2\n", 1, 0.333, 1, 0)]
    assert tree.nodes[0].visits == 3 and tree.nodes[0].q == 0.0 and not any(n.expanded for n in tree.nodes)
    seeded = len(tree.nodes)

    trees, spent = mcts_search(["9"], expand, value, rewards, MCTSConfig(simulations=12, expansions=3), trees=[tree])
    assert trees == [tree] and spent > 0
    best = tree.best_leaf()
    assert best.reward == 1.0 and tree.prefix(best.node_id) == "+3\n+3\n+3\n"
    # The root's draws of +1 and +2 joined the seeded children; +3 is new; priors are over all draws.
    first = [tree.nodes[c] for c in tree.nodes[0].children]
    assert [(n.text, n.draws) for n in first] == [("+1\n", 3), ("+2\n", 2), ("+3\n", 1)]
    assert [round(n.prior, 3) for n in first] == [0.5, 0.333, 0.167]
    assert [n.node_id for n in first[:2]] == [1, 4] and first[2].node_id >= seeded
    assert tree.nodes[leaves[0].node_id].reward == 0.0 and tree.nodes[leaves[0].node_id].terminal
    for n in tree.nodes:  # visits still add up: each backup passes every node on its path once
        kids = [tree.nodes[c] for c in n.children]
        assert sum(k.visits for k in kids) <= n.visits
    with pytest.raises(ValueError, match="a solution of '9' with no steps"):
        tree.seed([], 1.0)
    with pytest.raises(ValueError, match="the trees given are not the prompts'"):
        mcts_search(["5"], expand, value, rewards, MCTSConfig(simulations=1), trees=[Tree("9")])


# -- with a policy: components/search/policy.py --------------------------------------------------

class Scripted:
    """A test double of `GenerationBackend` for one arith problem: K draws per prefix from a script, and
    rollouts that reach the right answer from the right first step only."""

    STEPS = {"": ["3+4=7", "3+4=7", "3+4=8"], "3+4=7\n": ["7-2=5"] * 3, "3+4=8\n": ["8-2=6"] * 3,
             "3+4=7\n7-2=5\n": ["#### 5"] * 3, "3+4=8\n8-2=6\n": ["#### 6"] * 3}

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, stop=None):
        from components.models.backends import Sample

        self.seeds.append(seed)
        out = []
        for p in prompts:
            prefix = p.removeprefix("3+4-2\n")
            if stop == ["\n"]:
                out.append([Sample(t, len(t) + 1, "stop") for t in self.STEPS[prefix][:n]])
            else:
                rest = "7-2=5\n#### 5\n" if prefix.startswith("3+4=7") else "#### 6\n"
                rest = rest if not prefix.endswith("=5\n") else "#### 5\n"
                out.append([Sample(rest, len(rest), "stop")] * n)
        return out


def test_mcts_with_a_policy_merges_draws_values_by_rollouts_and_counts_every_token():
    from components.domains.arith import ArithDomain
    from components.domains.base import Problem
    from components.search.policy import mcts_sample

    backend = Scripted()
    problem = Problem.make("arith", 2, "3+4-2\n", "5")
    trees, samples, stats = mcts_sample(ArithDomain(), backend, [problem], MCTSConfig(simulations=6, expansions=3),
                                        temperature=0.8, top_p=1.0, max_step_tokens=16, max_new_tokens=32, seed=0,
                                        rollouts=2)
    tree = trees[0]
    first = [tree.nodes[c] for c in tree.nodes[0].children]
    # Three draws, two the same: two children, priors 2/3 and 1/3; each draw's tokens paid for.
    assert [(n.text, round(n.prior, 3), n.tokens) for n in first] == [("3+4=7\n", 0.667, 12), ("3+4=8\n", 0.333, 6)]
    assert [n.value for n in first] == [1.0, 0.0]  # the rollouts' verdicts
    assert samples[0].text == "3+4=7\n7-2=5\n#### 5\n" and stats["solved"] == 1
    assert samples[0].num_tokens == sum(n.tokens for n in tree.nodes)
    rollout_tokens = stats["generated_tokens"] - samples[0].num_tokens
    assert rollout_tokens > 0 and stats["backend_calls"] == len(backend.seeds) == len(set(backend.seeds))
    assert {n.reward for n in tree.nodes if n.terminal} <= {0.0, 1.0}


def test_mcts_with_the_hf_backend_is_reproducible(tmp_path):
    from components.domains.arith import ArithDomain
    from components.models.backends import HFBackend
    from components.models.tiny import TinyLlamaConfig, create_tiny_llama
    from components.search.policy import mcts_sample

    model = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                              tmp_path / "m", seed=0)
    backend = HFBackend(str(model), batch_size=16, device="cpu", progress=False)
    d = ArithDomain()
    problems = d.sample_problems(level=2, n=2, seed=0)
    kw = dict(temperature=1.0, top_p=1.0, max_step_tokens=8, max_new_tokens=16, seed=5, rollouts=1)
    cfg = MCTSConfig(simulations=3, expansions=2, max_depth=3)
    a_trees, a, sa = mcts_sample(d, backend, problems, cfg, **kw)
    b_trees, b, sb = mcts_sample(d, backend, problems, cfg, **kw)
    assert a == b and sa == sb and [node_rows(t) for t in a_trees] == [node_rows(t) for t in b_trees]
    assert all(len(t.nodes) > 1 for t in a_trees)
    assert sa["generated_tokens"] >= sum(s.num_tokens for s in a) > 0


# -- as generate's sampler: components/generation.generate_mcts ---------------------------------------

def _generate_mcts(**kw):
    from components.config import MCTSSection
    from components.domains.arith import ArithDomain
    from components.domains.base import Problem
    from components.generation import generate_mcts

    problem = Problem.make("arith", 2, "3+4-2\n", "5")
    search = MCTSSection(simulations=6, expansions=3, max_step_tokens=16, rollouts=2)
    return generate_mcts(ArithDomain(), Scripted(), [problem], search, experiment="e", round=1, purpose="train",
                         policy_model_id="e/policy/r0", n=4, temperature=0.8, top_p=1.0, max_new_tokens=32, seed=0,
                         **kw)


def test_generate_mcts_returns_the_best_leaves_as_trajectories_and_every_node_as_a_row():
    from components.tables import to_table

    batch, nodes, stats = _generate_mcts()
    to_table("nodes", nodes)  # the store's schema: a missing or extra column fails here
    by_id = {n["node_id"]: n for n in nodes}
    # The one end the search reached comes first. The wrong first step, valued 0, was tried once and abandoned;
    # its rollout (paid for) completes it as the second trajectory. The right path's rollouts repeat its leaf.
    assert [t["completion"] for t in batch.trajectories] == ["3+4=7\n7-2=5\n#### 5\n", "3+4=8\n#### 6\n"]
    wrong = next(n for n in nodes if n["step_text"] == "3+4=8\n")
    assert (wrong["visits"], wrong["q"], [n for n in nodes if n["parent_id"] == wrong["node_id"]]) == (1, 0.0, [])
    assert stats["from_rollouts"] == 1 and batch.trajectories[1]["num_tokens"] == 6 + len("#### 6\n")
    leaves = {n["trajectory_id"]: n for n in nodes if n["trajectory_id"]}
    assert set(leaves) == {t["trajectory_id"] for t in batch.trajectories}
    assert wrong["trajectory_id"] == batch.trajectories[1]["trajectory_id"]
    for t in batch.trajectories:  # each trajectory starts with its node's path; a terminal leaf is all of it
        leaf, path = leaves[t["trajectory_id"]], []
        at = leaf["node_id"]
        while at is not None:
            path.append(by_id[at]["step_text"])
            at = by_id[at]["parent_id"]
        assert t["completion"].startswith("".join(reversed(path)))
        assert leaf["terminal"] == (t["completion"] == "".join(reversed(path)))
    # One draw of each step is the trajectory's (Scripted pays len(text) + 1 per draw); the search's other tokens,
    # siblings' duplicates and rollouts, are the rest of the round's budget.
    assert batch.trajectories[0]["num_tokens"] == 6 + 6 + 7
    assert batch.num_tokens + stats["discarded_tokens"] == stats["generated_tokens"]
    assert [s["text"] for s in batch.steps if s["trajectory_id"] == batch.trajectories[0]["trajectory_id"]] == \
        ["3+4=7", "7-2=5", "#### 5"]
    again, nodes_again, _ = _generate_mcts()
    assert nodes_again == nodes and again.trajectories == batch.trajectories


def test_a_prm_values_each_prefix_by_its_last_step_and_costs_no_tokens():
    from components.domains.arith import ArithDomain
    from components.search.policy import prm_value

    seen = []

    def score_steps(prompts, steps):
        seen.append(steps)
        return [[0.9] * (len(s) - 1) + [0.2 if s[-1].endswith("8") else 1.3] for s in steps]

    value = prm_value(ArithDomain(), score_steps)
    assert value([("3+4-2\n", "3+4=7\n"), ("3+4-2\n", "3+4=8\n")]) == ([1.0, 0.2], 0)  # clipped to [0, 1]
    assert seen == [[["3+4=7"], ["3+4=8"]]]
    batch, nodes, stats = _generate_mcts(value=value)
    assert batch.trajectories[0]["completion"] == "3+4=7\n7-2=5\n#### 5\n"
    assert stats["generated_tokens"] == sum(n["tokens"] for n in nodes)  # no rollouts: the nodes are the budget


# -- PRM beam search and the compute curve: components/search/beam.py, curves.py ----------------------------

def test_beam_search_keeps_the_best_scored_prefixes_and_finishes_width_solutions():
    from components.search.beam import beam_search

    # The value is the target-sum oracle's; the width-2 beam must keep a prefix that can still reach 9.
    beams, spent = beam_search(["9"], expand, value, width=2, expansions=3, max_depth=5)
    assert (beams[0][0].prefix, beams[0][0].score) == ("+3\n+3\n+3\n", 1.0)
    assert all(b.terminal for b in beams[0]) and len(beams[0]) == 2 and beams[0][1].score == 0.0
    # Only +3 can still reach 9 after one step; +1 (0.0, the earlier of the ties) is the second beam. The root's
    # 3 candidates, then 2 beams x 3 per step: every candidate's 2 tokens paid.
    assert spent == 2 * (3 + 2 * 3 + 2 * 3)
    assert beam_search(["9"], expand, value, width=2, expansions=3, max_depth=5) == (beams, spent)
    with pytest.raises(ValueError, match="beam.width must be >= 1"):
        beam_search(["9"], expand, value, width=0, expansions=3, max_depth=5)


def test_the_compute_curve_puts_every_method_at_its_tokens_and_never_shows_the_searches_the_answer():
    from components.domains.arith import ArithDomain
    from components.domains.base import Problem
    from components.search.curves import compute_curve, curve_points, curve_rows

    problem = Problem.make("arith", 2, "3+4-2\n", "5")
    right, wrong = "3+4=7\n7-2=5\n#### 5\n", "3+4=8\n8-2=6\n#### 6\n"
    texts = [right, wrong, right, right, right]  # greedy, then the samples: maj@2 is a tie, the earlier (6) wins
    samples = {problem.problem_id: [{"trajectory_id": f"t{i}", "sample_index": i, "num_tokens": 10, "completion": x,
                                     "answer": x.strip()[-1]} for i, x in enumerate(texts)]}
    correct = {f"t{i}": x.endswith("5\n") for i, x in enumerate(texts)}
    prm_min = {f"t{i}": 0.9 if correct[f"t{i}"] else 0.1 for i in range(5)}
    def prm(likes: str):  # a PRM that likes the steps through `likes` (3+4=7 or 3+4=8)
        def score_steps(prompts, steps):
            return [[0.9 if likes in "".join(st) else 0.1 for _ in st] for st in steps]
        return score_steps

    def curve(likes: str):
        points = compute_curve(ArithDomain(), Scripted(), [problem], samples, correct, prm_min, prm(likes),
                               budgets=[2, 4], methods=["beam", "mcts"], expansions=3, max_step_tokens=16,
                               max_depth=4, c_puct=1.5, temperature=0.8, max_new_tokens=32, seed=0)
        return points, {(p["method"], p["budget"]): (p["tokens"], p["accuracy"]) for p in points}

    points, got = curve("=7")
    assert got[("greedy", 1)] == (10, 1.0) and got[("maj", 2)] == (20, 0.0) and got[("maj", 4)] == (40, 1.0)
    assert got[("prm_bon", 2)] == (20, 1.0)
    assert got[("beam", 2)][1] == got[("mcts", 4)][1] == 1.0  # the PRM steers both to 7, then 5
    # 2 samples' 20 tokens buy MCTS one expansion (18 tokens; the 2 left would not pay for another): its best path
    # has not ended, and is completed greedily ("7-2=5\n#### 5\n", 13 tokens), which the point counts.
    assert got[("mcts", 2)] == (18 + 13, 1.0)
    assert got[("mcts", 4)] == (36 + 7, 1.0)  # two expansions within the 4 samples' 40 tokens, then "#### 5\n"
    # The searches follow the PRM, never the verifier: a PRM that likes the wrong first step gets the wrong answer.
    _, misled = curve("=8")
    assert misled[("beam", 2)][1] == misled[("mcts", 4)][1] == 0.0 and misled[("maj", 4)] == got[("maj", 4)]
    rows = curve_rows(points, experiment="e", round=1, model_id="m", level=2)
    assert {r["metric"] for r in rows} >= {"curve_mcts_at_4", "curve_mcts_at_4_tokens", "curve_prm_bon_at_2"}
    back = curve_points(rows)[1]
    assert {(p["method"], p["budget"]): (p["tokens"], p["accuracy"]) for p in back} == got
