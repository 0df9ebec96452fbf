"""recipe grpo through the whole pipeline, on configs/micro-grpo.yaml made smaller: a short bootstrap, then two
rounds that sample groups, store every advantage (round 2's rewards shaped by the implicit PRM), and train TRL's
loss on them. What is asserted is the
bookkeeping, in the store: the advantages SQL recomputes from the stored rewards, the ones TRL trained on,
`v_rl_round`, the lineage, and a round whose groups all have equal rewards, which trains nothing. The learning
runs are in benchmarks/ (docs/grpo.md).

    .venv/bin/python -m pytest tests/integration/test_grpo.py -q
"""

from __future__ import annotations

import json

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, assert_plans_read_what_they_declare, assert_ptx_replays_the_demonstrations

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "micro-grpo.yaml"
SMALL = ["bootstrap.problems_per_level=300", "bootstrap.steps=250", "generate.problems_per_level=8",
         "evaluate.problems_per_level=10", "evaluate.maj_k=1"]
# Round 2's rewards are shaped by the implicit PRM (round 1's policy against round 0's); round 1 has none yet.
SHAPED = ["score.reward_model=implicit", "train_policy.grpo.shaping_weight=0.5"]
# The advantage of every rollout, recomputed from the stored scores: the verifier's outcome plus 0.5 times the
# implicit PRM's mean step reward where it scored (docs/grpo.md).
RECOMPUTED = """
WITH r AS (
    SELECT t.trajectory_id, t.experiment_id, t.round, t.problem_id,
           max(s.value) FILTER (WHERE s.scorer = 'outcome')
           + coalesce(0.5 * max(s.value) FILTER (WHERE s.scorer = 'implicit' AND s.aggregate = 'mean'), 0) AS reward
    FROM trajectories t JOIN scores s USING (trajectory_id)
    WHERE t.experiment_id = ? AND t.purpose = 'train' AND s.step_index = -1 GROUP BY ALL
)
SELECT a.trajectory_id, a.round, a.shaping, a.advantage,
       (r.reward - avg(r.reward) OVER g) / (coalesce(stddev_samp(r.reward) OVER g, 0) + 1e-4) AS from_sql
FROM advantages a JOIN r USING (trajectory_id)
WHERE a.turn_index = -1
WINDOW g AS (PARTITION BY r.experiment_id, r.round, r.problem_id)
"""


STEP_CREDIT = ["score.mc_rollouts=2", "train_reward.enabled=true", "train_reward.steps=30", "score.reward_model=prm",
               "train_policy.grpo.credit=step", "train_policy.grpo.shaping_weight=0.5"]
# Every step's advantage, recomputed from the stored step rewards: its rollout's advantage plus 0.5 times the sum,
# from the step to the end, of the step rewards normalised over all steps of its group (docs/grpo.md).
STEP_RECOMPUTED = """
WITH s AS (
    SELECT a.trajectory_id, a.turn_index AS step_index, a.round, a.group_id, a.process, a.advantage,
           r.advantage AS rollout_advantage
    FROM advantages a JOIN advantages r ON r.trajectory_id = a.trajectory_id AND r.turn_index = -1
    WHERE a.experiment_id = ? AND a.turn_index >= 0
), z AS (
    SELECT *, (process - avg(process) OVER g) / (coalesce(stddev_samp(process) OVER g, 0) + 1e-4) AS z
    FROM s WINDOW g AS (PARTITION BY round, group_id)
), explained AS (
    SELECT *, rollout_advantage + 0.5 * sum(z) OVER (PARTITION BY trajectory_id ORDER BY step_index DESC) AS from_sql
    FROM z
)
SELECT round, count(*), max(abs(advantage - from_sql)) FROM explained GROUP BY round ORDER BY round
"""


@pytest.fixture(scope="module")
def grpo_run(prefect_server, tmp_path_factory):
    from flows.evolution import self_evolution

    w = tmp_path_factory.mktemp("grpo")
    overrides = [f"workdir={w}", *SMALL, *SHAPED]
    self_evolution(config_path=str(CONFIG), overrides=overrides)
    cfg = load_config(CONFIG, overrides)
    store = Store.for_config(cfg)
    # Greedy sampling: every group's rollouts are one and the same answer, so no group has a signal.
    model = store.committed_model(cfg.experiment, 0, "policy")
    flat = [f"workdir={w}", *SMALL, "experiment=micro-grpo-flat", "rounds=1", "generate.temperature=0",
            f"policy.model={model['uri']}", "bootstrap.steps=0"]
    self_evolution(config_path=str(CONFIG), overrides=flat)
    # Step-level credit from a PRM trained in the rounds: round 1's step rewards are its Monte Carlo values, round
    # 2's the PRM round 1 trained on them. The round-0 demonstrations train beside the rollouts (PPO-ptx), and a
    # right answer whose steps fail the arith checker earns 0.
    step = [f"workdir={w}", *SMALL, "experiment=micro-grpo-step", f"policy.model={model['uri']}", "bootstrap.steps=0",
            *STEP_CREDIT, "train_policy.grpo.ptx_weight=0.5", "filter.check_steps=true"]
    self_evolution(config_path=str(CONFIG), overrides=step)
    return cfg, store, load_config(CONFIG, flat), load_config(CONFIG, step)


def test_each_round_is_a_row_of_v_rl_round(grpo_run):
    cfg, store, *_ = grpo_run
    cols, rows = store.query("SELECT * FROM v_rl_round WHERE experiment_id = ? ORDER BY round", [cfg.experiment])
    rounds = [dict(zip(cols, r)) for r in rows]
    assert [r["round"] for r in rounds] == [1, 2]
    g = cfg.train_policy.grpo
    for r in rounds:
        levels = json.loads(store.query("SELECT levels_json FROM round_plans WHERE experiment_id = ? AND round = ?",
                                        [cfg.experiment, r["round"]])[1][0][0])
        assert r["groups"] == 8 * len(levels) and r["group_size"] == 8 and r["rollouts"] == 8 * r["groups"]
        assert r["rollouts_trained"] == 8 * r["groups_trained"] > 0
        assert r["zero_variance_share"] == pytest.approx(1 - r["groups_trained"] / r["groups"])
        if r["round"] == 1:  # unshaped: a group trains exactly where one of its rollouts is right and one wrong
            assert r["pass_at_k"] >= r["groups_trained"] / r["groups"] and 0 < r["reward_mean"] < 1
        assert 0 < r["pass_at_k"] <= 1
        steps = r["groups_trained"] * g.num_iterations // g.groups_per_step
        assert r["optimizer_steps"] == steps and r["staleness_max"] == steps - 1
        assert 0 <= r["clip_fraction"] <= 1 and r["entropy"] > 0 and r["policy_shift"] is not None
        assert r["kl"] is None or r["kl"] != r["kl"]  # beta 0: TRL computes no KL


def test_sql_recomputes_every_advantage_and_trl_trained_on_them(grpo_run):
    cfg, store, *_ = grpo_run
    _, rows = store.query(RECOMPUTED, [cfg.experiment])
    assert len(rows) == store.query("SELECT count(*) FROM trajectories WHERE experiment_id = ? AND purpose = 'train'",
                                    [cfg.experiment])[1][0][0]
    assert max(abs(adv - sql) for _, _, _, adv, sql in rows) < 1e-9
    # Round 1's policy is the implicit PRM's reference itself: no shaping. Round 2's rewards are shaped.
    assert all(shaping == 0 for _, rnd, shaping, _, _ in rows if rnd == 1)
    assert sum(shaping != 0 for _, rnd, shaping, _, _ in rows if rnd == 2) > 0.9 * sum(rnd == 2 for _, rnd, *_ in rows)
    _, metrics = store.query("SELECT round, metrics_json FROM stage_runs WHERE experiment_id = ? AND stage = "
                             "'train_policy' AND round > 0 AND status = 'committed' ORDER BY round", [cfg.experiment])
    for _, m in metrics:
        m = json.loads(m)
        assert m["advantage_gap"] < 1e-5  # TRL's own group advantages agree with the stored ones it trained on
        assert m["retokenized"] == 0  # hf returns the sampled ids: training read them, not a re-tokenization


def test_lineage_names_the_rollouts_and_their_logprobs(grpo_run):
    cfg, store, *_ = grpo_run
    _, rows = store.query(
        "SELECT l.trained_round, count(*), count(*) FILTER (WHERE l.selected_for = 'grpo'), "
        "count(*) FILTER (WHERE l.generated_by_model_id = p.parent_model_id), count(lp.trajectory_id), "
        "count(*) FILTER (WHERE t.token_ids IS NULL) "
        "FROM v_lineage l JOIN models p ON p.model_id = l.trained_model_id "
        "JOIN trajectories t USING (trajectory_id) "
        "LEFT JOIN rollout_logprobs lp ON lp.model_id = l.trained_model_id AND lp.trajectory_id = l.trajectory_id "
        "WHERE l.experiment_id = ? AND l.role = 'policy' AND l.trained_round > 0 GROUP BY ALL ORDER BY ALL",
        [cfg.experiment])
    assert [r[0] for r in rows] == [1, 2]
    for _, n, selected, by_parent, logprobs, no_ids in rows:
        # Every rollout trained on was kept by the filter, sampled by the policy training started from, has its
        # two log-probabilities, and its sampled ids.
        assert n == selected == by_parent == logprobs > 0 and no_ids == 0


def test_a_round_without_signal_trains_nothing_and_goes_on(grpo_run):
    _, store, flat, _ = grpo_run
    cols, rows = store.query("SELECT * FROM v_rl_round WHERE experiment_id = ?", [flat.experiment])
    r = dict(zip(cols, rows[0]))
    assert r["zero_variance_share"] == 1.0 and r["groups_trained"] == 0 and r["optimizer_steps"] == 0
    _, models = store.query("SELECT train_examples FROM models WHERE experiment_id = ? AND round = 1",
                            [flat.experiment])
    assert models == [(0,)]
    _, evaluated = store.query("SELECT count(*) FROM evaluations WHERE experiment_id = ? AND round = 1",
                               [flat.experiment])
    assert evaluated[0][0] > 0


def test_plans_read_what_they_declare(grpo_run, tmp_path):
    cfg, store, _, step = grpo_run
    assert_plans_read_what_they_declare(cfg, store, tmp_path / "shaped")
    assert_plans_read_what_they_declare(step, store, tmp_path / "step")  # train_reward in grpo's rounds too


def test_step_credit_from_a_prm_trained_in_the_rounds(grpo_run):
    _, store, _, step = grpo_run
    exp = step.experiment
    # The SQL above explains every step's advantage, in both rounds.
    _, explained = store.query(STEP_RECOMPUTED, [exp])
    assert [r[0] for r in explained] == [1, 2] and all(n > 0 and gap < 1e-9 for _, n, gap in explained)
    # Round 1's step rewards are the Monte Carlo values; round 2's, the scores of the PRM that round 1 trained.
    _, sources = store.query(
        "SELECT a.round, count(*), count(*) FILTER (WHERE a.process = l.value), "
        "count(*) FILTER (WHERE a.process = s.value AND s.model_id = p.model_id) "
        "FROM advantages a LEFT JOIN step_labels l ON l.trajectory_id = a.trajectory_id "
        "AND l.step_index = a.turn_index AND l.source = 'mc_soft' "
        "LEFT JOIN scores s ON s.trajectory_id = a.trajectory_id AND s.step_index = a.turn_index AND s.scorer = 'prm' "
        "LEFT JOIN models p ON p.experiment_id = a.experiment_id AND p.role = 'prm' AND p.round = a.round - 1 "
        "WHERE a.experiment_id = ? AND a.turn_index >= 0 GROUP BY ALL ORDER BY ALL", [exp])
    (r1, n1, mc1, _), (r2, n2, _, prm2) = sources
    assert (r1, r2) == (1, 2) and mc1 == n1 and prm2 == n2
    # Every rollout has its steps, and a group whose outcomes are all equal trains where its step rewards differ.
    _, rollouts = store.query(
        "SELECT r.round, count(DISTINCT r.trajectory_id), count(DISTINCT a.trajectory_id), "
        "count(*) FILTER (WHERE r.kept AND r.group_std < 1e-6) FROM advantages r "
        "LEFT JOIN advantages a ON a.trajectory_id = r.trajectory_id AND a.turn_index >= 0 "
        "WHERE r.experiment_id = ? AND r.turn_index = -1 GROUP BY ALL ORDER BY ALL", [exp])
    assert all(with_steps >= 0.9 * n for _, n, with_steps, _ in rollouts)
    assert sum(equal_kept for *_, equal_kept in rollouts) > 0
    # train_policy spread the step advantages over the tokens of every rollout it trained on
    _, metrics = store.query("SELECT r.round, r.metrics_json, v.rollouts_trained FROM stage_runs r JOIN v_rl_round v "
                             "USING (experiment_id, round) WHERE experiment_id = ? AND stage = 'train_policy' AND "
                             "status = 'committed' ORDER BY round", [exp])
    assert [r for r, *_ in metrics] == [1, 2]
    assert all(json.loads(m)["step_credit_rollouts"] == trained > 0 for _, m, trained in metrics)


def test_ptx_trains_the_demonstrations_beside_the_rollouts(grpo_run):
    """train_policy.grpo.ptx_weight > 0: every grpo round names the round-0 demonstrations it replayed (use 'ptx',
    source round 0) beside its rollouts, and logs their mean NLL; the run without it names none."""
    cfg, store, _, step = grpo_run
    assert_ptx_replays_the_demonstrations(store, step.experiment, [1, 2])
    _, uses = store.query(
        "SELECT m.round, i.use, min(i.source_round), max(i.source_round) FROM model_inputs i "
        "JOIN models m USING (model_id) WHERE m.experiment_id = ? AND m.round > 0 AND m.role = 'policy' "
        "GROUP BY ALL ORDER BY ALL", [step.experiment])
    assert {u for _, u, _, _ in uses} == {"grpo", "ptx"}  # the rollouts trained on come from their own round
    assert all(lo == hi == (0 if u == "ptx" else r) for r, u, lo, hi in uses)
    _, none = store.query("SELECT count(*) FROM model_inputs i JOIN models m USING (model_id) WHERE "
                          "m.experiment_id = ? AND i.use LIKE '%ptx'", [cfg.experiment])
    assert none == [(0,)]


@pytest.fixture(scope="module")
def sil_run(grpo_run):
    """Two rounds from grpo_run's round-0 policy with self-imitation of every round's right answers (ptx_pool
    all_right_answers), outcome rewards alone: the step checker only keeps right answers out of self-imitation
    (train_policy.grpo.unsound_reward=outcome). Sampled at temperature 0.6, some groups' rollouts are all right: they
    have no signal and are dropped. The sampler's confidence judges which right answers are imitated too
    (score.reward_model=confidence, filter.min_step_score; it scores every round): those whose least likely token
    had p < 0.5, at most 30% of a round's."""
    from flows.evolution import self_evolution

    cfg, store, flat, _ = grpo_run
    overrides = [f"workdir={cfg.workdir}", *SMALL, "experiment=micro-grpo-sil", "generate.temperature=0.6",
                 f"policy.model={store.committed_model(cfg.experiment, 0, 'policy')['uri']}", "bootstrap.steps=0",
                 "train_policy.grpo.ptx_weight=0.5", "train_policy.grpo.ptx_pool=all_right_answers",
                 "filter.check_steps=true", "train_policy.grpo.unsound_reward=outcome",
                 "score.reward_model=confidence", "filter.min_step_score=0.5",
                 "filter.judge_max_drop=0.3"]
    self_evolution(config_path=str(CONFIG), overrides=overrides)
    return store, load_config(CONFIG, overrides)


# ptx_pool all_right_answers: round R's policy imitates the right answers of rounds 1..R that pass the step
# checker and the judge, one per distinct completion of a problem (its first sample), 'grpo+ptx' where it is one of
# round R's rollouts that trained on their advantage too.
IMITATED = """
WITH right_answers AS (
    SELECT t.trajectory_id, t.round, t.problem_id, t.completion, t.sample_index, a.kept
    FROM trajectories t JOIN verifications v USING (trajectory_id) JOIN advantages a USING (trajectory_id)
    WHERE t.experiment_id = ? AND t.purpose = 'train' AND a.turn_index = -1 AND v.correct
      AND a.steps_checked IS DISTINCT FROM false
      AND trajectory_id NOT IN (SELECT trajectory_id FROM selections WHERE purpose = 'ptx' AND NOT selected)
), first AS (
    SELECT r.round AS trained_round, arg_min(a.trajectory_id, (a.round, a.sample_index)) AS trajectory_id
    FROM (SELECT DISTINCT round FROM right_answers) r JOIN right_answers a ON a.round <= r.round
    GROUP BY r.round, a.problem_id, a.completion
)
SELECT f.trained_round, f.trajectory_id, a.round,
       CASE WHEN a.kept AND a.round = f.trained_round THEN 'grpo+ptx' ELSE 'ptx' END
FROM first f JOIN right_answers a USING (trajectory_id)
"""


def test_self_imitation_trains_every_rounds_sound_right_answers(sil_run, tmp_path):
    """ptx_pool all_right_answers: each round's ptx batches hold exactly the right answers SQL finds, of that round
    and the ones before (every group's, those without a learning signal too, each distinct completion once, none
    whose steps fail the checker), named in `model_inputs` at their own round ('grpo+ptx' where the rollout trained
    on its advantage as well) beside the demonstrations, and counted in the metrics."""
    store, sil = sil_run
    _, expected = store.query(IMITATED, [sil.experiment])
    _, named = store.query(
        "SELECT m.round, i.trajectory_id, i.source_round, i.use FROM model_inputs i JOIN models m USING (model_id) "
        "WHERE m.experiment_id = ? AND m.role = 'policy' AND i.source_round > 0 AND i.use LIKE '%ptx'",
        [sil.experiment])
    assert sorted(named) == sorted(expected)
    assert {u for *_, u in named} == {"ptx", "grpo+ptx"}  # groups with a signal and groups without
    assert any(src < r for r, _, src, _ in named)  # round 2 imitates round 1's answers too
    _, failed = store.query("SELECT count(*) FROM advantages WHERE experiment_id = ? AND steps_checked = false",
                            [sil.experiment])
    assert failed[0][0] > 0  # the checker turned some right answers away
    _, metrics = store.query("SELECT round, json_extract(metrics_json, '$.ptx_right_answers')::INTEGER FROM "
                             "stage_runs WHERE experiment_id = ? AND stage = 'train_policy' AND status = 'committed' "
                             "AND round > 0 ORDER BY round", [sil.experiment])
    assert metrics == [(r, sum(x == r for x, *_ in expected)) for r in (1, 2)]
    assert_ptx_replays_the_demonstrations(store, sil.experiment, [1, 2])
    assert_plans_read_what_they_declare(sil, store, tmp_path)  # the earlier rounds' samples included
    _, lineage = store.query("SELECT count(*) FILTER (WHERE selected_for = 'grpo'), count(*) FROM v_lineage WHERE "
                             "experiment_id = ? AND use = 'grpo+ptx'", [sil.experiment])
    assert lineage[0][0] == lineage[0][1] > 0  # a rollout imitated too is still the filter's grpo selection


def test_the_judge_leaves_right_answers_out_of_self_imitation_by_their_weakest_step(sil_run):
    """filter.min_step_score under grpo: every right answer has a ptx selection. In each round the judge leaves out
    exactly the right answers whose weakest step scores below the threshold the filter used (0.5, or lower where
    more than 30% would fall below it), naming the score, and the checker those whose steps fail it. Every right
    answer's reward stays the verifier's, those the checker failed too. The filter reports how the judge agrees
    with the checker."""
    store, sil = sil_run
    cols, rows = store.query(
        "SELECT t.round, s.selected, s.reason, a.steps_checked, a.outcome, v.reward, j.value AS weakest FROM "
        "selections s JOIN trajectories t USING (trajectory_id) JOIN advantages a USING (trajectory_id) "
        "JOIN verifications v USING (trajectory_id) LEFT JOIN scores j ON j.trajectory_id = s.trajectory_id "
        "AND j.scorer = 'confidence' AND j.aggregate = 'min' WHERE s.experiment_id = ? AND s.purpose = 'ptx' "
        "AND a.turn_index = -1", [sil.experiment])
    rows = [dict(zip(cols, r)) for r in rows]
    _, right = store.query("SELECT count(*) FROM verifications v JOIN trajectories t USING (trajectory_id) "
                           "WHERE t.experiment_id = ? AND t.purpose = 'train' AND v.correct", [sil.experiment])
    assert len(rows) == right[0][0] > 0
    _, metrics = store.query("SELECT round, metrics_json FROM stage_runs WHERE experiment_id = ? AND stage = 'filter' "
                             "AND status = 'committed' ORDER BY round", [sil.experiment])
    metrics = {r: json.loads(m) for r, m in metrics}
    for r in rows:
        judged = r["weakest"] < metrics[r["round"]]["judge_min_step_score"]
        assert r["selected"] is (r["steps_checked"] is not False and not judged)
        assert r["reason"].startswith("confidence: weakest step") is judged
        assert r["outcome"] == r["reward"]  # the judge and, at unsound_reward=outcome, the checker leave rewards alone
    for k in (1, 2):
        out = sum(r["reason"].startswith("confidence") for r in rows if r["round"] == k)
        assert 0 < out <= 0.3 * sum(r["round"] == k for r in rows)
        assert metrics[k]["ptx_judged_out"] == out and metrics[k]["judge_min_step_score"] <= 0.5
        assert 0 <= metrics[k]["judge_auc"] <= 1
    _, lineage = store.query("SELECT count(*) FILTER (WHERE selected_for = 'ptx'), count(*) FROM v_lineage WHERE "
                             "experiment_id = ? AND use = 'ptx' AND source_round > 0", [sil.experiment])
    assert lineage[0][0] == lineage[0][1] > 0  # an imitated right answer names its ptx selection


def test_the_step_checker_zeroes_the_right_answers_whose_steps_fail(grpo_run):
    """filter.check_steps under grpo: every right answer's `steps_checked` is the arith checker's verdict on its
    text, and one that fails it earns 0 instead of the verifier's reward; a wrong answer is not checked. The run
    without the setting checks nothing."""
    from components.domains import get_domain

    cfg, store, _, step = grpo_run
    domain = get_domain(step.domain.name, **step.domain.options)
    cols, rows = store.query(
        "SELECT t.prompt, t.completion, v.correct, v.reward, a.outcome, a.steps_checked FROM advantages a "
        "JOIN trajectories t USING (trajectory_id) JOIN verifications v USING (trajectory_id) "
        "WHERE a.experiment_id = ? AND a.turn_index = -1", [step.experiment])
    rows = [dict(zip(cols, r)) for r in rows]
    right = [r for r in rows if r["correct"]]
    assert right and all(r["steps_checked"] is domain.check_steps(r["prompt"], r["completion"]) for r in right)
    assert 0 < sum(r["steps_checked"] is False for r in right) < len(right)  # both verdicts occur in the run
    assert all(r["outcome"] == (r["reward"] if r["steps_checked"] else 0.0) for r in right)
    assert all(r["steps_checked"] is None for r in rows if not r["correct"])
    _, unchecked = store.query("SELECT count(*) FILTER (WHERE steps_checked IS NOT NULL), count(*) FROM advantages "
                               "WHERE experiment_id = ?", [cfg.experiment])
    assert unchecked[0][0] == 0 < unchecked[0][1]
