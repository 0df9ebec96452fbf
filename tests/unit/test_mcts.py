"""MCTS over steps (components/search/mcts.py) on a problem whose tree is known: reach a target sum in three
steps of +1, +2 or +3. The policy prefers +1 (the wrong step for a target of 9), the value source is the
fraction of the remaining distance a prefix can still cover, and the verifier pays 1 at the target.

The search must find the solution the policy alone would not, put its visits on it, back up Q and visits
consistently, be deterministic, stop at its token budget, and give step preferences where siblings' Q differ.
"""

from __future__ import annotations

import math

import pytest

from components.search import Candidate, MCTSConfig, mcts_search, node_rows, sibling_pairs

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


def test_the_search_finds_what_the_policy_alone_would_not():
    trees, spent = mcts_search(["9", "5"], expand, value, reward, MCTSConfig(simulations=12, expansions=3))
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
    trees, _ = mcts_search(["9"], expand, value, reward, MCTSConfig(simulations=10, expansions=3))
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
    a = [node_rows(t) for t in mcts_search(["9", "7"], expand, value, reward, cfg)[0]]
    b = [node_rows(t) for t in mcts_search(["9", "7"], expand, value, reward, cfg)[0]]
    assert a == b
    trees, spent = mcts_search(["9", "7"], expand, value, reward, MCTSConfig(simulations=8, expansions=3,
                                                                             token_budget=20))
    # Each simulation expands one leaf per tree, 3 candidates of 2 tokens: 12 tokens a simulation.
    assert spent == 24 and len(trees[0].nodes) == 1 + 2 * 3


def test_sibling_preferences_follow_q():
    tree = mcts_search(["9"], expand, value, reward, MCTSConfig(simulations=12, expansions=3))[0][0]
    pairs = sibling_pairs(tree, margin=0.25)
    assert pairs and all(p["chosen_q"] - p["rejected_q"] >= 0.25 for p in pairs)
    root = [p for p in pairs if p["prefix"] == ""]
    assert {(p["chosen"], p["rejected"]) for p in root} == {("+3\n", "+1\n"), ("+3\n", "+2\n")}
    assert not sibling_pairs(tree, margin=1.01)


@pytest.mark.parametrize("field, value_, said", [
    ("simulations", 0, "mcts.simulations must be >= 1"),
    ("expansions", 0, "mcts.expansions must be >= 1"),
    ("token_budget", 0, "mcts.token_budget must be >= 1"),
    ("c_puct", -1.0, "mcts.c_puct must be >= 0"),
])
def test_settings_out_of_range_are_refused(field, value_, said):
    with pytest.raises(ValueError, match=said):
        MCTSConfig(**{field: value_})


def test_callbacks_that_break_their_contract_are_named():
    with pytest.raises(ValueError, match="expand returned 0 lists of candidates for 1 leaves"):
        mcts_search(["9"], lambda pairs, k: [], value, reward, MCTSConfig(simulations=1))
    with pytest.raises(ValueError, match=r"value nan for a prefix of '9' is outside \[0, 1\]"):
        mcts_search(["9"], expand, lambda pairs: ([math.nan] * len(pairs), 0), reward, MCTSConfig(simulations=1))


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
    # The only end the search reached is returned; the wrong first step, valued 0, was tried once and abandoned.
    assert [t["completion"] for t in batch.trajectories] == ["3+4=7\n7-2=5\n#### 5\n"]
    wrong = next(n for n in nodes if n["step_text"] == "3+4=8\n")
    assert (wrong["visits"], wrong["q"], [n for n in nodes if n["parent_id"] == wrong["node_id"]]) == (1, 0.0, [])
    leaves = {n["trajectory_id"]: n for n in nodes if n["trajectory_id"]}
    assert set(leaves) == {t["trajectory_id"] for t in batch.trajectories}
    for t in batch.trajectories:
        leaf, path = leaves[t["trajectory_id"]], []
        at = leaf["node_id"]
        while at is not None:
            path.append(by_id[at]["step_text"])
            at = by_id[at]["parent_id"]
        assert "".join(reversed(path)) == t["completion"] and leaf["terminal"]
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
