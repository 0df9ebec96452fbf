"""MCTS over an agent's turns (components/search/episodes.py) on the real calculator environment, with a scripted
policy whose draws differ by their place in a batch: what is under test is the tree over turns, the environment
replayed under each node, and the episodes handed back."""

import pytest

from components.envs import get_env, toolcalls
from components.envs.base import EpisodeRunner
from components.envs.records import episode_rows
from components.search.episodes import episode_mcts, turn_text
from components.search.mcts import MCTSConfig


def branching(calls: list[int]):
    """Before any observation, even places in a batch call `calculate` on the problem's expression and odd places
    on 1+1; after one, every draw answers with the last observation. Each call's batch size goes to `calls`."""
    def generate(conversations):
        calls.append(len(conversations))
        out = []
        for i, conv in enumerate(conversations):
            seen = [m["content"] for m in conv if m["role"] == "tool"]
            if seen:
                text = f"#### {seen[-1]}"
            else:
                user = next(m["content"] for m in conv if m["role"] == "user")
                expression = user.removeprefix("What is ").split("?")[0]
                text = toolcalls.format_call("calculate", {"expression": expression if i % 2 == 0 else "1+1"})
            out.append((text, len(text.split()), "stop", tuple(range(100, 100 + len(text.split())))))
        return out
    return generate


@pytest.fixture(scope="module")
def env():
    return get_env("calculator")


def test_an_episode_runs_one_turn_at_a_time_and_resumes_where_it_stood(env):
    p = env.sample_problems(3, 1, seed=0)[0]
    runner = EpisodeRunner(branching([]), toolcalls.parse, env.limits)
    [first] = runner.run([(p, env.episode(p))], max_new_turns=1)
    assert first.status == "open" and [t.role for t in first.turns][-2:] == ["assistant", "tool"]
    [rest] = runner.run([(p, env.episode(p))], prefixes=[first.messages])
    assert rest.status == "done" and rest.reward == 1.0 and not rest.replay_mismatch
    assert rest.messages[:len(first.messages)] == first.messages


def test_the_search_branches_on_turns_values_them_by_rollouts_and_returns_the_right_episode(env):
    problems = env.sample_problems(3, 2, seed=0)
    calls: list[int] = []
    trees, episodes, stats = episode_mcts(env, branching(calls), problems, MCTSConfig(simulations=4, expansions=2),
                                          rollouts=2, n=2)
    assert len(trees) == len(episodes) == 2
    for p, tree, got in zip(problems, trees, episodes):
        root = tree.nodes[0]
        kids = [tree.nodes[c] for c in root.children]
        # two openings, one each of the two draws: the right call and the wrong one, each with what it returned
        assert sorted(k.text.splitlines()[-1] for k in kids) == sorted([f"[tool:calculate] {p.answer}",
                                                                        "[tool:calculate] 2"])
        assert [k.prior for k in kids] == [0.5, 0.5] and not any(k.terminal for k in kids)
        right, wrong = sorted(kids, key=lambda k: -k.value)
        assert (right.value, wrong.value) == (1.0, 0.0)  # its rollouts answer what they read
        # the search went down the right call, whose answer turn ends the episode with reward 1
        leaf = tree.nodes[right.children[0]]
        assert leaf.terminal and leaf.reward == 1.0 and leaf.text == f"#### {p.answer}\n" and leaf.draws == 2
        assert right.visits > wrong.visits
        (node_id, rec), *rest = got
        assert node_id == leaf.node_id and rec.reward == 1.0 and rec.status == "done"
        assert [t.turn_index for t in rec.turns] == list(range(len(rec.turns)))
        assert [t.role for t in rec.turns] == ["system", "user", "assistant", "tool", "assistant"]
        assert all(t.num_tokens and t.token_ids for t in rec.turns if t.role == "assistant")
        assert [m["content"] for m in rec.messages] == [t.content for t in rec.turns]
        # what the store keeps: its transcript is the tree's prefix, turn by turn
        rows = episode_rows(rec, experiment="e", round=1, purpose="train", policy_model_id=None, sample_index=0,
                            temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, verifier="calculator.score",
                            verifier_version="1", answer=env.extract_answer)
        assert rows["trajectories"][0]["completion"] + "\n" == tree.prefix(leaf.node_id)
        assert turn_text(rec.turns[2:]) == tree.prefix(leaf.node_id)
        # a second episode: the wrong call's rollout, a whole episode the search paid for
        assert [r.reward for _, r in rest] == [0.0] and rest[0][0] == wrong.node_id
        assert rest[0][1].turns[3].content == "2" and rest[0][1].status == "done"
    # every leaf of a simulation steps in one batch, both trees': 2 roots x 2 draws, then 2 x 2 children x 2
    # rollouts (one turn each: they answer), then the 2 right children x 2 draws. The last two simulations select
    # the terminal leaf again: no call.
    assert calls == [4, 8, 4] and stats["replay_mismatches"] == 0
    assert stats["solved"] == 2 and stats["right_leaves"] == 2 and stats["from_rollouts"] == 2
    tokens = sum(n.tokens for t in trees for n in t.nodes)
    assert stats["generated_tokens"] > tokens  # the rollouts' tokens count too


def test_a_prms_values_replace_the_rollouts_and_it_reads_each_node_as_the_score_stage_reads_an_episode(env):
    """With a PRM's score_steps, a new node is valued by the PRM's score of its turn after the turns before it, the
    user message as the prompt: what the score stage hands the same PRM for a stored episode. No rollout runs."""
    from components.envs.rollout import episode_steps

    problems = env.sample_problems(3, 2, seed=0)
    seen: list[tuple[str, list[str]]] = []

    def score_steps(prompts, steps):
        seen.extend(zip(prompts, steps))
        # P(good) of each step: high where it read the calculator's answer to the problem
        return [[0.9 if any(f"] {p.answer}" in s for p in problems) else 0.2 for s in st] for st in steps]

    calls: list[int] = []
    trees, episodes, stats = episode_mcts(env, branching(calls), problems, MCTSConfig(simulations=3, expansions=2),
                                          rollouts=2, n=1, score_steps=score_steps)
    assert calls == [4, 4]  # the roots' draws, then the better children's: no rollout batch between them
    assert stats["generated_tokens"] == sum(n.tokens for t in trees for n in t.nodes)
    for p, tree, [(node_id, rec)] in zip(problems, trees, episodes):
        kids = sorted((tree.nodes[c] for c in tree.nodes[0].children), key=lambda k: -k.value)
        assert [k.value for k in kids] == [0.9, 0.2]
        assert rec.reward == 1.0 and tree.nodes[node_id].parent_id == kids[0].node_id
        rows = episode_rows(rec, experiment="e", round=1, purpose="train", policy_model_id=None, sample_index=0,
                            temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, verifier="calculator.score",
                            verifier_version="1", answer=env.extract_answer)
        stored = episode_steps(rows["turns"])[rows["trajectories"][0]["trajectory_id"]]
        # the PRM read the right call's node as the score stage reads the stored episode's first step
        assert (p.prompt, stored[:1]) in seen and rows["trajectories"][0]["prompt"] == p.prompt


def test_the_compute_curve_searches_over_turns_by_the_prm_and_runs_an_unfinished_episode_on(env):
    """evaluate.search on an environment: beam search and MCTS over turns, each turn valued by the PRM (never by
    the calculator's verdict), the best episode's answer then verified by the environment. A PRM that likes the
    wrong call leads both searches to the wrong answer; with one turn allowed, the best beam has not answered and
    is run on greedily, its tokens counted."""
    from components.search.curves import compute_curve
    from components.search.episodes import EpisodeSearches

    problems = env.sample_problems(3, 2, seed=0)
    samples = {p.problem_id: [{"trajectory_id": f"{p.problem_id}/{i}", "sample_index": i, "num_tokens": 30,
                               "answer": p.answer if i != 1 else "2"} for i in range(3)] for p in problems}
    correct = {t["trajectory_id"]: t["answer"] != "2" for g in samples.values() for t in g}

    def prm(likes: str):  # P(good) of a turn: high where the calculator answered `likes` (the answer, or 2)
        def score_steps(prompts, steps):
            marks = [f"] {p.answer}" for p in problems] if likes == "answer" else ["] 2"]
            return [[0.9 if any(m in s for m in marks) else 0.2 for s in st] for st in steps]
        return score_steps

    def curve(likes: str, max_depth: int = 4, methods=("beam", "mcts")):
        calls: list[tuple[float, int]] = []

        def sampler(temperature, seed):
            calls.append((temperature, seed))
            return branching([])

        searches = EpisodeSearches(env, sampler, problems, prm(likes), temperature=0.8, seed=0)
        points = compute_curve(env, None, problems, samples, correct, None, prm(likes), budgets=[2],
                               methods=methods, expansions=2, max_step_tokens=16, max_depth=max_depth,
                               c_puct=1.5, temperature=0.8, max_new_tokens=32, seed=0, searches=searches)
        return {p["method"]: (p["tokens"], p["accuracy"]) for p in points}, calls

    got, _ = curve("answer")
    assert got["greedy"] == (30, 1.0) and got["maj"] == (60, 0.0)  # maj@2: a tie of 3 and 2, the earlier wins
    assert got["beam"][1] == got["mcts"][1] == 1.0
    misled, _ = curve("2")
    assert misled["beam"][1] == misled["mcts"][1] == 0.0
    beam, calls = curve("answer", methods=["beam"])
    assert beam["beam"] == got["beam"] and [t for t, _ in calls] == [0.8]  # each beam answered: nothing run on
    cut, calls = curve("answer", max_depth=1, methods=["beam"])
    # one turn each: the right call, not yet answered, is run on greedily, answers what it read, and is paid for
    assert cut["beam"][1] == 1.0 and [t for t, _ in calls] == [0.8, 0.0] and cut["beam"][0] > 0
    assert cut["beam"][0] < beam["beam"][0]  # one beam's answer turn instead of two beams' draws of it


def test_prm_guided_turns_redraw_a_turn_the_prm_rejects_and_keep_the_best_draw(env):
    """generate.search on an environment: each turn is drawn, with what the calculator answered, until the PRM
    accepts it; a rejected turn is redrawn by the redraw sampler, and after max_tries the best draw is kept."""
    from components.search.episodes import prm_turn_search

    problems = env.sample_problems(3, 2, seed=0)
    assert all(p.answer != "2" for p in problems)
    seen: list[list[str]] = []

    def score_steps(prompts, steps):  # dislikes a turn that read 2, the wrong call's result
        seen.extend(steps)
        return [[0.2 if "[tool:calculate] 2" in s else 0.9 for s in st] for st in steps]

    calls, redraws = [], []
    records, stats = prm_turn_search(env, branching(calls), problems, score_steps, n=2, max_tries=2, threshold=0.5,
                                     redraw=branching(redraws))
    # 4 episodes: the odd places of the first batch called 1+1 and were redrawn, as a batch of 2 whose odd place
    # called 1+1 again: that episode keeps the better of two equal draws, the first, below the threshold
    assert calls == [4, 4] and redraws == [2]
    assert [r.right for r in records] == [True, True, True, False]
    assert stats["draws"] == 10 and stats["redraws"] == 2 and stats["accepted_below_threshold"] == 1
    assert stats["steps"] == 8  # two turns kept per episode
    for rec in records:
        assert [t.role for t in rec.turns] == ["system", "user", "assistant", "tool", "assistant"]
        assert [t.turn_index for t in rec.turns] == list(range(5)) and rec.status == "done"
        assert all(t.token_ids for t in rec.turns if t.role == "assistant")
    kept = sum(t.num_tokens for r in records for t in r.turns if t.role == "assistant")
    assert stats["generated_tokens"] == kept + stats["discarded_tokens"] and stats["discarded_tokens"] > 0
    assert all(len(st) in (1, 2) for st in seen)  # each draw scored after the turns before it
    # one guided turn: the episodes, still open, answer unguided, and their answer turns are paid for
    calls = []
    cut, cut_stats = prm_turn_search(env, branching(calls), problems, score_steps, n=2, max_tries=2, threshold=0.5,
                                     max_steps=1, redraw=branching([]))
    assert calls == [4, 4] and [r.right for r in cut] == [True, True, True, False] and cut_stats["steps"] == 4
    # the same turns as guided (every answer turn was accepted there at once), fewer draws scored
    assert cut_stats["generated_tokens"] == stats["generated_tokens"] and cut_stats["draws"] == 6
    with pytest.raises(ValueError, match="max_tries must be >= 1"):
        prm_turn_search(env, branching([]), problems, score_steps, n=1, max_tries=0, threshold=0.5)


def test_trees_grown_in_score_start_from_the_rounds_episodes_and_label_every_turn(env):
    """score.tree.search on an environment: each problem's stored episodes seed its tree, a path of turns each; the
    search resumes seeded turns from their stored conversations and draws beside them; every episode ends at its
    own leaf, so the tree labels each of its turns and pairs the wrong episode with the right one."""
    from types import SimpleNamespace

    from components.envs.rollout import episode_steps, run_episodes
    from components.search.episodes import grow_episode_trees
    from components.search.training import label_tree_rows, tree_step_labels, tree_step_pairs

    problems = env.sample_problems(3, 2, seed=0)
    batch, _ = run_episodes(env, branching([]), problems, n=2, experiment="e", round=1, purpose="train",
                            policy_model_id=None, seed=0)
    trajs, turns = batch.tables["trajectories"], batch.tables["turns"]
    correct = {t: r == 1.0 for t, r in batch.rewards.items()}
    assert sorted(correct.values()) == [False, False, True, True]  # each problem: the right call, and 1+1
    calls: list[int] = []
    section = SimpleNamespace(simulations=3, expansions=2, c_puct=1.5, fpu=0.0, max_depth=8, token_budget=None,
                              rollouts=1, widening=0.0)
    owners, trees, leaf_of, counts = grow_episode_trees(env, branching(calls), {p.problem_id: p for p in problems},
                                                        trajs, turns, correct, section)
    assert owners == sorted(problems, key=lambda p: p.prompt)  # a tree per prompt, in prompt order
    assert counts["trees"] == 2 and counts["seeded"] == 8 and counts["replay_mismatches"] == 0
    steps = episode_steps(turns)
    for t in trajs:
        p, node_id = leaf_of[t["trajectory_id"]]
        tree = trees[owners.index(p)]
        leaf = tree.nodes[node_id]
        assert leaf.terminal and leaf.reward == float(correct[t["trajectory_id"]])
        assert tree.prefix(node_id) == "".join(s + "\n" for s in steps[t["trajectory_id"]])
    # The roots' two draws (the right call and 1+1) each joined its seeded turn; then the right call, resumed from its
    # stored conversation with the calculator replayed, drew its answer twice, joining the seeded answer. The third
    # simulation selects that answer's terminal leaf again: no call.
    assert calls == [4, 4]
    for tree in trees:
        kids = [tree.nodes[c] for c in tree.nodes[0].children]
        assert [k.draws for k in kids] == [2, 2] and len(tree.nodes) == 5
        right = next(k for k in kids if k.q == 1.0)
        assert right.expanded and tree.nodes[right.children[0]].draws == 3
    assert counts["generated_tokens"] > 0
    nodes, placed = label_tree_rows(owners, trees, leaf_of, experiment="e", round=1)
    labels, stats = tree_step_labels(nodes, trajs, steps, correct, rollouts_valued=True, placed=placed)
    assert stats["misaligned"] == 0 and stats["labelled_trajectories"] == 4 and stats["tree_steps"] == 8
    hard = {(r["trajectory_id"], r["step_index"]): r["value"] for r in labels if r["source"] == "tree_hard"}
    for t in trajs:  # the wrong call is bad from its first turn on; the right episode is good throughout
        assert [hard[(t["trajectory_id"], i)] for i in range(2)] == [float(correct[t["trajectory_id"]])] * 2
    pairs = tree_step_pairs(nodes, trajs, correct, margin=0.25, placed=placed)
    assert sorted(p["step_index"] for p in pairs) == [0, 0]
    assert all(correct[p["chosen_from"]] and not correct[p["trajectory_id"]] for p in pairs)


def test_until_correct_runs_episodes_in_waves_for_the_problems_short_of_right_ones(env):
    """generate.until_correct on an environment: each wave runs more episodes only for the problems with fewer
    than `want` right ones, each wave with its own seed, sample indices running on, until n per problem ran."""
    from components.envs.rollout import episodes_until_right, run_episodes
    from components.seeding import seed_stream

    problems = env.sample_problems(3, 2, seed=0)
    seeds, sizes = [], []

    def run_wave(pending, k, seed, first):
        # the first problem's episode takes the even place of each batch: right; the second's calls 1+1
        seeds.append(seed)
        return run_episodes(env, branching(sizes), pending, n=k, experiment="e", round=1, purpose="train",
                            policy_model_id=None, seed=seed, first_sample_index=first)[0]

    batch, stats, waves = episodes_until_right(run_wave, problems, want=2, wave_size=1, n=3, seed=7)
    # wave 0 and 1: both problems (the first right each time, the second wrong); wave 2: the second alone, now at
    # the even place, right; it stays one short of 2 right, and n=3 is reached
    assert seeds == [7, seed_stream(7, 1), seed_stream(7, 2)] and sizes == [2, 2, 2, 2, 1, 1]
    assert waves == {"wave0_problems": 2, "wave0_tokens": waves["wave0_tokens"], "wave1_problems": 2,
                     "wave1_tokens": waves["wave1_tokens"], "wave2_problems": 1, "wave2_tokens": waves["wave2_tokens"],
                     "waves": 3, "unmet": 1}
    got = sorted((t["problem_id"] == problems[0].problem_id, t["sample_index"], batch.rewards[t["trajectory_id"]])
                 for t in batch.trajectories)
    assert got == [(False, 0, 0.0), (False, 1, 0.0), (False, 2, 1.0), (True, 0, 1.0), (True, 1, 1.0)]
    assert len({t["trajectory_id"] for t in batch.trajectories}) == 5 and stats["episodes"] == 5
    assert len(batch.tables["problems"]) == 2


def test_a_turn_trees_step_pair_is_two_chats_that_share_their_turns_up_to_where_they_part():
    from components.stages.train_policy import _turn_pair

    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 3*4?"}]
    call = [{"role": "assistant", "content": "call 3*4", "token_ids": [1, 2]}, {"role": "tool", "content": "12"}]
    right = opening + call + [{"role": "assistant", "content": "#### 12", "token_ids": [3]}]
    wrong = opening + [{"role": "assistant", "content": "call 3*4 ", "token_ids": [1, 2, 9]},
                       {"role": "tool", "content": "12"}, {"role": "assistant", "content": "#### 13"}]
    sp = {"trajectory_id": "w", "chosen_from": "r", "step_index": 1}
    # the same turn text (up to whitespace), sampled with other ids: one node of a seeded tree
    assert _turn_pair({"r": right, "w": wrong}, sp) == {"chosen": right, "rejected": wrong}
    with pytest.raises(RuntimeError, match="step pair of w: its first 1 turns differ from r's"):
        _turn_pair({"r": right, "w": opening + [{"role": "assistant", "content": "call 1+1"}] + wrong[3:]}, sp)
    with pytest.raises(RuntimeError, match="step pair of w: r has no stored turns"):
        _turn_pair({"w": wrong}, sp)
