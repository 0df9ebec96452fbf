"""filter.check_steps on an agent's episodes: configs/calculator.yaml for one round, sampled and evaluated by a
calculator agent that answers every question right, one way of four (tests/integration/slips.py:
ShortcutCalculator): through the tool, without it, ignoring what it returned, or after a call that did not parse.
The environment's step checker reads each episode's stored turns (`CalculatorEnv.check_episode`); the filter keeps
the right episodes that check out, and the evaluation counts the held-out right answers that do not.

    .venv/bin/python -m pytest tests/integration/test_episode_checker.py -q
"""

from __future__ import annotations

import json

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, run_coevo

pytestmark = pytest.mark.slow

TURNS = "SELECT trajectory_id, turn_index, role, content, tool_name, tool_ok FROM turns WHERE trajectory_id IN ({})"


@pytest.fixture(scope="module")
def checked_run(prefect_server, tmp_path_factory):
    from flows.evolution import self_evolution

    w = tmp_path_factory.mktemp("checked")
    model = w / "standin-calculator"
    run_coevo("build-model", str(model), "--domain", "calculator", "--size", "tiny", "--per-level", "20",
              "--positions", "512", check=True)
    config = REPO / "configs" / "calculator.yaml"
    overrides = [f"workdir={w}", "experiment=calc-checked", "rounds=1", f"policy.model={model}", "bootstrap.steps=0",
                 "bootstrap.levels=[2]", "bootstrap.seed_levels=[]", "bootstrap.problems_per_level=10",
                 "generate.backend=tests.integration.slips:ShortcutCalculator", "generate.problems_per_level=8",
                 "generate.samples_per_problem=4", "filter.check_steps=true", "filter.max_per_problem=4",
                 "train_policy.steps=3", "evaluate.problems_per_level=8", "evaluate.maj_k=1",
                 "domain.options={test_size: 8}"]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def verdicts(store: Store, trajectories: dict[str, str]) -> dict[str, bool | None]:
    """The calculator's step checker on each trajectory's stored turns (`trajectories`: id -> prompt)."""
    from components.envs.calculator import CalculatorEnv

    cols, rows = store.query(TURNS.format(", ".join("?" * len(trajectories))), list(trajectories))
    turns: dict[str, list[dict]] = {}
    for r in rows:
        turns.setdefault(r[0], []).append(dict(zip(cols, r, strict=True)))
    env = CalculatorEnv()
    return {t: env.check_episode(prompt, turns[t]) for t, prompt in trajectories.items()}


def test_the_filter_keeps_the_right_episodes_whose_turns_check_out(checked_run):
    cfg, store = checked_run
    _, rows = store.query(
        "SELECT t.trajectory_id, t.prompt, v.correct, s.selected, s.reason FROM trajectories t "
        "JOIN verifications v USING (trajectory_id) JOIN selections s USING (trajectory_id) "
        "WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train' AND s.purpose = 'policy_sft'",
        [cfg.experiment])
    assert rows and all(correct for _, _, correct, _, _ in rows)  # every way answers right
    sound = verdicts(store, {tid: prompt for tid, prompt, *_ in rows})
    assert set(sound.values()) == {True, False}  # one way of four checks out
    for tid, _, _, selected, reason in rows:
        if sound[tid]:
            assert "steps do not check" not in reason
        else:
            assert not selected and "steps do not check" in reason
    assert any(selected for *_, selected, _ in rows)
    flt = json.loads(store.committed_run(cfg.experiment, 1, "filter")["metrics_json"])
    assert (flt["right_answers"], flt["right_unsound"]) == (len(rows), sum(not v for v in sound.values()))
    # The shortcuts, as the store shows them: no call at all, a call that did not parse (v_tool_stats counts it).
    _, [(no_call,)] = store.query(
        "SELECT count(*) FROM v_episodes WHERE experiment_id = ? AND round = 1 AND purpose = 'train' "
        "AND tool_calls = 0", [cfg.experiment])
    _, [(broken,)] = store.query(
        "SELECT sum(calls) FROM v_tool_stats WHERE experiment_id = ? AND round = 1 AND purpose = 'train' "
        "AND tool_name = 'invalid'", [cfg.experiment])
    assert no_call > 0 and broken > 0


def test_the_evaluation_counts_the_held_out_right_answers_that_do_not_check_out(checked_run):
    cfg, store = checked_run
    _, greedy = store.query(
        "SELECT trajectory_id, prompt FROM trajectories WHERE experiment_id = ? AND round = 1 AND purpose = 'eval' "
        "AND sample_index = 0", [cfg.experiment])
    sound = verdicts(store, dict(greedy))
    _, rows = store.query(
        "SELECT metric, value FROM evaluations WHERE experiment_id = ? AND round = 1 AND level = -1 "
        "AND metric IN ('greedy_acc', 'greedy_sound_acc', 'greedy_unsound_rate')", [cfg.experiment])
    unsound = sum(not v for v in sound.values()) / len(sound)
    assert 0 < unsound < 1
    assert dict(rows) == pytest.approx({"greedy_acc": 1.0, "greedy_sound_acc": 1 - unsound,
                                        "greedy_unsound_rate": unsound})
