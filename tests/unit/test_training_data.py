"""What the training stages train on: round 0's demonstrations, replay mixing, the carry-over rule."""

from __future__ import annotations

from components.config import BootstrapConfig
from components.domains.arith import ArithDomain
from components.training.data import demonstrations, replay_mix, sft_steps


def test_demonstrations_are_gold_solutions_with_seed_demos_of_the_hard_level():
    domain, b = ArithDomain(max_level=3), BootstrapConfig(levels=[1, 2], problems_per_level=50, seed_levels=[3],
                                                        seed_fraction=0.2)
    problems, trajs, sels = demonstrations(domain, b, seed=7, experiment="e")
    levels = [t["level"] for t in trajs]
    assert levels.count(1) == levels.count(2) == 50 and levels.count(3) == 25  # 20% of all: 100 * 0.2 / 0.8
    assert len(problems) == len(trajs) == len(sels) == len({t["trajectory_id"] for t in trajs})
    for t in trajs:
        assert t["round"] == 0 and t["purpose"] == "demo"
        assert domain.verify([t["completion"]], [t["answer"]]) == [1.0]
    assert all(s["selected"] and s["purpose"] == "policy_sft" for s in sels)
    assert demonstrations(domain, b, seed=7, experiment="e") == (problems, trajs, sels)
    assert demonstrations(domain, b, seed=8, experiment="e")[1] != trajs


def test_replay_mix_keeps_every_new_example_and_samples_the_rest():
    new = {f"n{i}": {"round": 3} for i in range(4)}
    pool = {f"p{i}": {"round": i % 3} for i in range(10)}
    mixed = replay_mix(new, pool, 0.5, seed=1)
    assert [t for t, _, use in mixed if use == "new"] == sorted(new)
    replayed = [t for t, _, use in mixed if use == "replay"]
    assert len(replayed) == 2 and set(replayed) <= set(pool)
    assert replay_mix(new, pool, 0.5, seed=1) == mixed and replay_mix(new, pool, 0.5, seed=2) != mixed
    assert len(replay_mix(new, pool, 10.0, seed=1)) == 4 + 10  # no more than the pool holds


def test_a_round_that_kept_nothing_trains_no_step():
    assert sft_steps(300, None, 0, 64) == 0 and sft_steps(300, 3.0, 0, 64) == 0
    assert sft_steps(300, 3.0, 1000, 64) == 47 and sft_steps(30, 3.0, 1000, 64) == 30


def test_demonstration_episodes_report_their_progress_in_tenths(capsys):
    """Each episode's tools really run (in the code environment, its sandbox): thousands take minutes, so the
    bootstrap reports them in the words the progress bar reads."""
    from components.envs import get_env
    from components.envs.rollout import demonstration_episodes
    from components.progress import parse_progress
    from components.stages.base import count_progress

    env = get_env("calculator")
    problems, trajs, _ = demonstrations(env, BootstrapConfig(levels=[2], problems_per_level=25, seed_levels=[]),
                                        seed=0, experiment="e")
    calls: list[tuple[int, int]] = []
    report = count_progress("bootstrap", "demonstration episodes")

    def progress(done: int, total: int) -> None:
        calls.append((done, total))
        report(done, total)

    episodes, turns = demonstration_episodes(env, problems, trajs, progress=progress)
    assert calls == [(k, 25) for k in range(1, 26)] and len(episodes) == 25
    assert {t["role"] for t in turns} >= {"assistant", "tool"}  # level 2 calls the calculator
    lines = capsys.readouterr().out.splitlines()
    assert [parse_progress(line) for line in lines] == [(k, 25) for k in [*range(2, 25, 2), 25]]  # each 25 // 10
    assert all(line.startswith("[bootstrap] demonstration episodes ") and line.endswith("s)") for line in lines)


def test_an_environments_demonstrations_run_its_tools_once(monkeypatch):
    """The bootstrap asks for an environment's demonstrations unsolved (`solve=False`): their episodes make the
    completions, and each reference episode runs once, not once for the text and again for the turns."""
    from components.envs import get_env
    from components.envs.rollout import demonstration_episodes

    env, b = get_env("calculator"), BootstrapConfig(levels=[2], problems_per_level=10, seed_levels=[])
    solved = demonstration_episodes(env, *demonstrations(env, b, seed=0, experiment="e")[:2])
    runs: list[str] = []
    episode = type(env).reference_episode
    monkeypatch.setattr(type(env), "reference_episode", lambda self, p: runs.append(p.problem_id) or episode(self, p))
    problems, trajs, _ = demonstrations(env, b, seed=0, experiment="e", solve=False)
    assert {t["completion"] for t in trajs} == {None} and not runs
    assert demonstration_episodes(env, problems, trajs) == solved
    assert sorted(runs) == sorted(t["problem_id"] for t in trajs) and len(runs) == 10
