"""The reward models that need no training, through the real flow on configs/micro.yaml (recipe rft): the
implicit PRM (`score.reward_model: implicit`), 2 rounds, with the policy/round-0 log-ratio scoring steps, ranking
the filter and best-of-N; and the sampler's confidence as the filter's judge and best-of-N's ranker, 1 round,
and another model's in its place (`score.confidence_model`), 1 round.

    .venv/bin/python -m pytest tests/integration/test_implicit_prm.py -q
"""

from __future__ import annotations

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, SHORT_SFT
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def implicit_run(prefect_server, micro_workdir, tmp_path_factory):
    from flows.evolution import self_evolution

    config = REPO / "configs" / "micro.yaml"
    overrides = [f"workdir={tmp_path_factory.mktemp('implicit')}", "experiment=micro-implicit",
                 *micro_workdir.start_from_round0(),
                 "score.reward_model=implicit", "evaluate.best_of_n=[4]", *SHORT_SFT]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def _models(store: Store, exp: str) -> dict[int, dict]:
    return {m["round"]: m for m in store.rows("SELECT round, model_id, uri FROM models WHERE experiment_id=? "
                                              "AND role='policy'", [exp])}


def test_round_two_steps_carry_the_log_ratio_of_round_ones_policy_to_round_zeros(implicit_run):
    import torch

    from components.models.tiny import load_policy

    cfg, store = implicit_run
    exp = cfg.experiment
    per_round = dict(store.query(
        "SELECT t.round, list(DISTINCT s.model_id) FROM scores s JOIN trajectories t USING (trajectory_id) "
        "WHERE t.experiment_id=? AND t.purpose='train' AND s.scorer='implicit' GROUP BY 1", [exp])[1])
    models = _models(store, exp)
    assert per_round == {2: [models[1]["model_id"]]}  # round 1's policy IS the reference: nothing to score
    steps = store.rows("SELECT t.trajectory_id, t.prompt, list(st.text ORDER BY st.step_index) AS steps, "
                       "(SELECT list(value ORDER BY step_index) FROM scores s WHERE s.trajectory_id=t.trajectory_id "
                       " AND s.scorer='implicit' AND s.aggregate='step') AS rewards "
                       "FROM trajectories t JOIN steps st USING (trajectory_id) "
                       "WHERE t.experiment_id=? AND t.round=2 AND t.purpose='train' GROUP BY ALL "
                       "ORDER BY t.trajectory_id LIMIT 5", [exp])
    assert steps and all(len(r["rewards"]) == len(r["steps"]) for r in steps)

    # Recompute beta * (log pi_r1 - log pi_r0) of each whole solution, from the two checkpoints.
    def logp(uri: str, prompt: str, completion: str) -> float:
        model, tok = load_policy(uri, device="cpu")
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + tok(completion, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            lp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        return float(lp[len(p_ids) - 1:].sum())

    for r in steps:
        text = "".join(s + "\n" for s in r["steps"])
        ratio = cfg.score.implicit_beta * (logp(models[1]["uri"], r["prompt"], text)
                                           - logp(models[0]["uri"], r["prompt"], text))
        assert sum(r["rewards"]) == pytest.approx(ratio, abs=1e-4)


def test_filter_ranks_right_answers_by_the_weakest_implicit_step(implicit_run):
    import json

    cfg, store = implicit_run
    rows = store.rows(
        "SELECT v.problem_id, sel.rank, v.implicit_min_step_score AS score FROM selections sel "
        "JOIN v_trajectory_scores v USING (trajectory_id) WHERE sel.experiment_id=? AND sel.round=2 "
        "AND sel.purpose='policy_sft' AND sel.selected ORDER BY v.problem_id, sel.rank", [cfg.experiment])
    assert rows and all(r["score"] is not None for r in rows)
    by_problem: dict[str, list[float]] = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r["score"])
    assert all(v == sorted(v, reverse=True) for v in by_problem.values())  # (dedup leaves most problems one)
    # The filter says what ranked it: the implicit scores in round 2, the outcome in round 1 (none yet).
    metrics = {r: json.loads(m) for r, m in store.query(
        "SELECT round, metrics_json FROM stage_runs WHERE experiment_id=? AND stage='filter' AND status='committed'",
        [cfg.experiment])[1]}
    assert "selected_mean_rank_score" not in metrics[1]
    assert metrics[2]["selected_mean_rank_score"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))


def test_evaluation_reports_implicit_best_of_n(implicit_run):
    cfg, store = implicit_run
    got = dict(((r, m), v) for r, m, v in store.query(
        "SELECT round, metric, value FROM evaluations WHERE experiment_id=? AND level=-1 "
        "AND metric IN ('implicit_bon_at_4', 'pass_at_4', 'maj_at_4')", [cfg.experiment])[1])
    for rnd in (1, 2):
        assert 0.0 <= got[(rnd, "implicit_bon_at_4")] <= got[(rnd, "pass_at_4")]
    assert (0, "implicit_bon_at_4") not in got  # round 0's policy is the reference


@pytest.fixture(scope="module")
def confidence_run(prefect_server, micro_workdir, tmp_path_factory):
    from flows.evolution import self_evolution

    config = REPO / "configs" / "micro.yaml"
    overrides = [f"workdir={tmp_path_factory.mktemp('confidence')}", "experiment=micro-confidence", "rounds=1",
                 *micro_workdir.start_from_round0(), "filter.check_steps=false", "score.reward_model=confidence",
                 "filter.min_step_score=0.5", "evaluate.best_of_n=[4]", *SHORT_SFT]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def test_the_samplers_confidence_judges_what_rft_trains_on(confidence_run):
    """rft's filter judges with whatever step reward model the score stage ran, not only a trained PRM: the
    sampler's confidence leaves out exactly the right answers whose least likely token it sampled below
    min_step_score, naming itself, and the checker (off) measures it."""
    import json

    cfg, store = confidence_run
    rows = store.rows("""
        SELECT t.trajectory_id, v.correct, s.value AS weakest, sel.selected, sel.reason
        FROM trajectories t JOIN verifications v USING (trajectory_id)
        JOIN scores s ON s.trajectory_id = t.trajectory_id AND s.scorer = 'confidence' AND s.aggregate = 'min'
        JOIN selections sel ON sel.trajectory_id = t.trajectory_id AND sel.purpose = 'policy_sft'
        WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train'""", [cfg.experiment])
    right = [r for r in rows if r["correct"]]
    low = [r for r in right if r["weakest"] < cfg.filter.min_step_score]
    assert low and len(low) < len(right), "the judge must drop some right answers and keep others"
    assert all(not r["selected"] and r["reason"].startswith("confidence: weakest step") for r in low)
    assert not any(r["reason"].startswith("confidence:") for r in right if r["weakest"] >= cfg.filter.min_step_score)
    assert any(r["selected"] for r in right)
    metrics = json.loads(store.query("SELECT metrics_json FROM stage_runs WHERE experiment_id=? AND stage='filter' "
                                     "AND status='committed'", [cfg.experiment])[1][0][0])
    assert metrics["judge_min_step_score"] == cfg.filter.min_step_score
    assert 0.0 <= metrics["judge_auc"] <= 1.0  # the checker, off, still measures the judge


def test_confidence_best_of_n_picks_each_problems_most_confident_sample(confidence_run):
    """confidence_bon_at_4, rounds 0 and 1: per held-out problem, the first 4 samples' weakest-step confidence as the
    round's own policy scored them (v_trajectory_scores), the highest taken (ties: the earliest), right or not."""
    cfg, store = confidence_run
    samples = store.rows("""
        SELECT round, problem_id, sample_index, correct, confidence_min_step_score AS conf FROM v_trajectory_scores
        WHERE experiment_id = ? AND trajectory_id IN (SELECT trajectory_id FROM trajectories WHERE purpose = 'eval')
          AND sample_index BETWEEN 1 AND 4 ORDER BY round, problem_id, sample_index""", [cfg.experiment])
    assert samples and all(r["conf"] is not None and 0.0 < r["conf"] <= 1.0 for r in samples)
    picked: dict[int, list[bool]] = {}
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in samples:
        groups.setdefault((r["round"], r["problem_id"]), []).append(r)
    for (rnd, _), g in groups.items():
        assert len(g) == 4
        picked.setdefault(rnd, []).append(bool(max(g, key=lambda r: (r["conf"], -r["sample_index"]))["correct"]))
    got = dict(store.query("SELECT round, value FROM evaluations WHERE experiment_id = ? AND level = -1 "
                           "AND metric = 'confidence_bon_at_4'", [cfg.experiment])[1])
    assert sorted(got) == [0, 1]
    for rnd, ok in picked.items():
        assert got[rnd] == pytest.approx(sum(ok) / len(ok))


@pytest.fixture(scope="module")
def fixed_judge_run(prefect_server, micro_workdir, tmp_path_factory):
    """The confidence run with another model as the judge (score.confidence_model): micro's round-1 policy, which
    did not sample this run's round 1 (micro's round-0 policy did)."""
    from flows.evolution import self_evolution

    judge = Store(micro_workdir.path / "store").committed_model("micro", 1, "policy")["uri"]
    config = REPO / "configs" / "micro.yaml"
    overrides = [f"workdir={tmp_path_factory.mktemp('fixed-judge')}", "experiment=micro-fixed-judge", "rounds=1",
                 *micro_workdir.start_from_round0(), "filter.check_steps=false", "score.reward_model=confidence",
                 f"score.confidence_model={judge}", "filter.min_step_score=0.5", "evaluate.best_of_n=[4]", *SHORT_SFT]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg), judge


def test_a_fixed_model_judges_in_place_of_the_sampler(fixed_judge_run):
    """score.confidence_model: the named model, not the sampler, scores every step in score (the filter's judge)
    and in evaluate (best-of-N), each row naming it; its scores are its own confidence, recomputed here, and not
    the sampler's."""
    from components.domains import get_domain
    from components.rewards import load_reward_model
    from components.stages.base import prompt_format_of

    cfg, store, judge = fixed_judge_run
    sampler = store.committed_model(cfg.experiment, 0, "policy")["uri"]
    by_round = dict(store.query("""
        SELECT t.round || '/' || t.purpose, list(DISTINCT s.model_id)
        FROM scores s JOIN trajectories t USING (trajectory_id) WHERE t.experiment_id = ? AND s.scorer = 'confidence' GROUP BY ALL""", [cfg.experiment])[1])
    assert by_round == {"0/eval": [judge], "1/eval": [judge], "1/train": [judge]}
    rows = store.rows("""
        SELECT t.trajectory_id, t.prompt, t.completion, s.value AS weakest, sel.reason,
               list(st.text ORDER BY st.step_index) AS steps
        FROM trajectories t JOIN verifications v USING (trajectory_id)
        JOIN scores s ON s.trajectory_id = t.trajectory_id AND s.scorer = 'confidence' AND s.aggregate = 'min'
        JOIN selections sel ON sel.trajectory_id = t.trajectory_id AND sel.purpose = 'policy_sft'
        JOIN steps st ON st.trajectory_id = t.trajectory_id
        WHERE t.experiment_id = ? AND t.round = 1 AND t.purpose = 'train' AND v.correct
        GROUP BY ALL ORDER BY t.trajectory_id LIMIT 24""", [cfg.experiment])
    assert rows
    args = [r["prompt"] for r in rows], [r["completion"] for r in rows], [r["steps"] for r in rows]
    kw = dict(separator=get_domain(cfg.domain.name).step_separator, prompt_format=prompt_format_of(cfg))
    own = [min(s) for s in load_reward_model("confidence", judge, **kw).score(*args)]
    theirs = [min(s) for s in load_reward_model("confidence", sampler, **kw).score(*args)]
    assert [r["weakest"] for r in rows] == pytest.approx(own, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(own, theirs)) > 1e-3, "the sampler's confidence would score alike"
    assert all(r["reason"].startswith("confidence: weakest step") for r in rows if r["weakest"] < 0.5)
