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
