"""The `coevo` recipe, 2 micro rounds, through the real Prefect flow, MLflow (SQLite) and DuckDB:
Monte Carlo step labels, a PRM per round, PRM-ranked selections, DPO pairs and PRM best-of-N.

    .venv/bin/python -m pytest tests/integration/test_coevo_recipe.py -q
"""

from __future__ import annotations

import pytest

from components.config import load_config
from components.store import Store
from tests.conftest import REPO, SHORT_SFT, assert_plans_read_what_they_declare
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def coevo_run(prefect_server, micro_workdir, tmp_path_factory):
    from flows.evolution import self_evolution

    workdir = tmp_path_factory.mktemp("coevo")
    config = REPO / "configs" / "micro-coevo.yaml"
    overrides = [f"workdir={workdir}", *micro_workdir.start_from_round0(), *SHORT_SFT]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def _one(store: Store, sql: str, params: list | None = None):
    return store.query(sql, params)[1][0][0]


def test_rounds_run_train_reward_between_score_and_filter(coevo_run):
    cfg, store = coevo_run
    order = [s for (s,) in store.query("SELECT stage FROM stage_runs WHERE experiment_id=? AND round=1 "
                                       "AND status='committed' ORDER BY started_at", [cfg.experiment])[1]]
    assert order == ["generate", "verify", "score", "train_reward", "filter", "train_policy", "evaluate"]


def test_every_stage_reads_only_what_it_declares(coevo_run, tmp_path):
    assert_plans_read_what_they_declare(*coevo_run, tmp_path)


def test_step_labels_come_from_rollouts_and_the_oracle(coevo_run):
    import math

    cfg, store = coevo_run
    assert cfg.score.mc_strategy == "first_error"
    rows = dict(((r, s), (n, k)) for r, s, n, k in store.query(
        "SELECT t.round, l.source, count(*), max(l.num_rollouts) FROM step_labels l JOIN trajectories t "
        "USING (trajectory_id) WHERE t.experiment_id=? AND t.purpose='train' GROUP BY ALL", [cfg.experiment])[1])
    for r in (1, 2):
        assert (r, "mc_soft") not in rows and rows[(r, "mc_hard")][0] > 0   # hard labels only
        assert rows[(r, "mc_hard")][1] == cfg.score.mc_rollouts
        assert rows[(r, "oracle")][0] >= rows[(r, "mc_hard")][0]
    labelled = store.rows(
        "SELECT t.round, t.trajectory_id, t.problem_id, t.completion, v.correct, "
        "list(l.value ORDER BY l.step_index) AS hard, list(l.num_rollouts ORDER BY l.step_index) AS k, "
        "list(l.step_index ORDER BY l.step_index) AS idx, "
        "(SELECT count(*) FROM steps s WHERE s.trajectory_id = t.trajectory_id) AS n_steps "
        "FROM step_labels l JOIN trajectories t USING (trajectory_id) JOIN verifications v USING (trajectory_id) "
        "WHERE t.experiment_id=? AND l.source='mc_hard' GROUP BY ALL", [cfg.experiment])
    solved = {(r, p) for r, p in store.query(
        "SELECT t.round, t.problem_id FROM trajectories t JOIN verifications v USING (trajectory_id) "
        "WHERE t.experiment_id=? AND t.purpose='train' AND v.correct", [cfg.experiment])[1]}
    right = [x for x in labelled if x["correct"]]
    wrong = [x for x in labelled if not x["correct"]]
    # Every right answer is labelled, by itself: all steps good, no rollout.
    n_right = _one(store, "SELECT count(*) FROM trajectories t JOIN verifications v USING (trajectory_id) "
                          "WHERE t.experiment_id=? AND t.purpose='train' AND v.correct", [cfg.experiment])
    assert len(right) == n_right and all(set(x["hard"]) == {1.0} and set(x["k"]) == {0} for x in right)
    # A wrong answer to a problem the round solved: good steps, then bad ones from its first dead prefix on;
    # a binary search's rollouts. To a problem it never solved: no search, its final step alone is bad.
    searched = [x for x in wrong if (x["round"], x["problem_id"]) in solved]
    unsearched = [x for x in wrong if (x["round"], x["problem_id"]) not in solved]
    assert searched and unsearched
    for x in searched:
        first_bad = x["hard"].index(0.0)
        assert x["idx"] == list(range(x["n_steps"]))
        assert x["hard"] == [1.0] * first_bad + [0.0] * (len(x["hard"]) - first_bad)
        assert sum(1 for k in x["k"] if k) <= math.ceil(math.log2(len(x["hard"])))
    assert all(x["hard"] == [0.0] and x["k"] == [0] and x["idx"] == [x["n_steps"] - 1] for x in unsearched)
    # At most mc_max_trajectories distinct wrong texts were searched per round; their tokens count in the budget.
    for r in (1, 2):
        assert len({(x["problem_id"], x["completion"]) for x in searched if x["round"] == r}) <= cfg.score.mc_max_trajectories
    budget = store.query("SELECT round, generated_tokens, mc_tokens, search_tokens, budget_tokens FROM v_round_summary "
                         "WHERE experiment_id=? AND round > 0 ORDER BY 1", [cfg.experiment])[1]
    assert all(mc > 0 and b == g + mc + s for _, g, mc, s, b in budget)


def test_generate_draws_in_waves_until_two_right_answers(coevo_run):
    """generate.until_correct=2, wave_size=2: no problem is drawn for again once it has 2 right answers,
    and one that never gets them has all samples_per_problem draws."""
    import json

    cfg, store = coevo_run
    g = cfg.generate
    assert (g.until_correct, g.wave_size, g.samples_per_problem) == (2, 2, 8)
    for r in (1, 2):
        per_problem = store.rows(
            "SELECT t.problem_id, list(v.correct::INT ORDER BY t.sample_index) AS right, "
            "list(t.sample_index ORDER BY t.sample_index) AS idx FROM trajectories t JOIN verifications v "
            "USING (trajectory_id) WHERE t.experiment_id=? AND t.round=? AND t.purpose='train' GROUP BY 1",
            [cfg.experiment, r])
        for p in per_problem:
            n = len(p["idx"])
            assert p["idx"] == list(range(n)) and n % 2 == 0
            assert sum(p["right"][:n - 2]) < 2   # it was still short before its last wave
            assert sum(p["right"]) >= 2 or n == 8
        m = json.loads(_one(store, "SELECT metrics_json FROM stage_runs WHERE experiment_id=? AND round=? "
                                   "AND stage='generate' AND status='committed'", [cfg.experiment, r]))
        waves = int(m["adaptive_waves"])
        drawn_for = [m[f"adaptive_wave{w}_problems"] for w in range(waves)]
        assert drawn_for[0] == len(per_problem) > drawn_for[-1] and drawn_for == sorted(drawn_for, reverse=True)
        assert sum(drawn_for) * 2 == m["trajectories"] == sum(len(p["idx"]) for p in per_problem)
        assert m["adaptive_unmet"] == sum(1 for p in per_problem if sum(p["right"]) < 2)


def test_round_two_samples_step_by_step_guided_by_round_ones_prm(coevo_run):
    cfg, store = coevo_run
    import json

    metrics = {r: json.loads(m) for r, m in store.query(
        "SELECT round, metrics_json FROM stage_runs WHERE experiment_id=? AND stage='generate' "
        "AND status='committed'", [cfg.experiment])[1]}
    assert "search_draws" not in metrics[1]  # no PRM before round 1's train_reward: plain sampling
    m = metrics[2]
    assert m["search_draws"] >= m["search_steps"] > 0 and m["search_redraws"] == m["search_draws"] - m["search_steps"]
    # The discarded draws are in the budget, on top of the kept tokens that the trajectories hold.
    kept, search = store.query("SELECT generated_tokens, search_tokens FROM v_round_summary WHERE experiment_id=? "
                               "AND round=2", [cfg.experiment])[1][0]
    assert kept == m["search_accepted_tokens"] and search == m["search_discarded_tokens"]
    assert (search > 0) == (m["search_redraws"] > 0)
    # Every guided sample is whole lines, the form plain sampling gives.
    completions = [c for (c,) in store.query("SELECT completion FROM trajectories WHERE experiment_id=? AND round=2 "
                                             "AND purpose='train'", [cfg.experiment])[1]]
    assert completions and all(not c or (c.endswith("\n") and "\n\n" not in c) for c in completions)


def test_each_round_trains_a_prm_and_round_two_is_scored_by_round_ones(coevo_run):
    cfg, store = coevo_run
    prms = store.rows("SELECT model_id, round, parent_model_id, train_examples FROM models "
                      "WHERE experiment_id=? AND role='prm' ORDER BY round", [cfg.experiment])
    assert [m["model_id"] for m in prms] == ["micro-coevo/prm/r1/a1", "micro-coevo/prm/r2/a1"]
    assert prms[1]["parent_model_id"] == "micro-coevo/prm/r1/a1"   # warm start
    assert prms[1]["train_examples"] > prms[0]["train_examples"]  # all labels so far
    scorers = dict(store.query(
        "SELECT t.round, list(DISTINCT s.model_id ORDER BY s.model_id) FROM scores s JOIN trajectories t "
        "USING (trajectory_id) WHERE t.experiment_id=? AND t.purpose='train' AND s.scorer='prm' GROUP BY 1",
        [cfg.experiment])[1])
    assert scorers == {2: ["micro-coevo/prm/r1/a1"]}   # round 1 had no earlier PRM
    # Every scored trajectory has one score per step, plus min/last/mean.
    bad = _one(store, "SELECT count(*) FROM (SELECT s.trajectory_id, count(*) FILTER (WHERE aggregate='step') AS n "
                      "FROM scores s WHERE scorer='prm' GROUP BY 1) x JOIN (SELECT trajectory_id, count(*) AS k "
                      "FROM steps GROUP BY 1) y USING (trajectory_id) WHERE n <> k")
    assert bad == 0
    # The PRM's training data is in the lineage: new labels this round, replayed ones from round 1.
    uses = dict(store.query("SELECT use, count(*) FROM v_lineage WHERE trained_model_id='micro-coevo/prm/r2/a1' "
                            "AND selection_reason IS NOT NULL GROUP BY 1")[1])
    assert uses["new"] > 0 and uses["replay"] > 0
    # train_reward.demos: the round-0 gold solutions train each PRM too, every one of them at most once.
    demos = dict(store.query(
        "SELECT mi.model_id, count(*) FROM model_inputs mi JOIN trajectories t USING (trajectory_id) "
        "WHERE t.experiment_id=? AND t.purpose='demo' AND mi.source_round=0 GROUP BY 1", [cfg.experiment])[1])
    n_demos = _one(store, "SELECT count(DISTINCT (prompt, completion)) FROM trajectories WHERE experiment_id=? "
                          "AND purpose='demo'", [cfg.experiment])
    assert 0 < demos["micro-coevo/prm/r1/a1"] <= n_demos and 0 < demos["micro-coevo/prm/r2/a1"] <= n_demos


def test_selections_rank_by_prm_and_pair_for_dpo(coevo_run):
    cfg, store = coevo_run
    purposes = dict(store.query("SELECT purpose, count(*) FROM selections WHERE experiment_id=? AND round=2 "
                                "AND selected GROUP BY 1", [cfg.experiment])[1])
    assert purposes["policy_sft"] > 0 and purposes["reward_train"] > 0
    assert purposes["dpo_chosen"] == purposes["dpo_rejected"] > 0
    # In round 2, within each problem, a selected SFT trajectory never has a lower PRM min than a
    # right answer dropped for the per-problem cap.
    inversions = _one(store, """
        WITH s AS (SELECT sel.trajectory_id, t.problem_id, sel.selected, sel.reason, sc.value
                   FROM selections sel JOIN trajectories t USING (trajectory_id)
                   JOIN scores sc ON sc.trajectory_id = sel.trajectory_id AND sc.scorer='prm' AND sc.aggregate='min'
                   WHERE sel.experiment_id=? AND sel.round=2 AND sel.purpose='policy_sft')
        SELECT count(*) FROM s a JOIN s b USING (problem_id)
        WHERE a.selected AND b.reason LIKE 'over max_per_problem%' AND a.value < b.value""", [cfg.experiment])
    assert inversions == 0
    # Each pair: a verified-correct chosen side, an incorrect rejected side, of the same problem.
    pairs = store.query("""
        SELECT pair_id, bool_and((s.purpose='dpo_chosen') = v.correct), count(DISTINCT t.problem_id), count(*)
        FROM selections s JOIN verifications v USING (trajectory_id) JOIN trajectories t USING (trajectory_id)
        WHERE s.experiment_id=? AND s.purpose LIKE 'dpo_%' GROUP BY 1""", [cfg.experiment])[1]
    assert pairs and all(ok and n_prob == 1 and n == 2 for _, ok, n_prob, n in pairs)
    # The rejected sides trained the policy too, and say so in the lineage.
    assert _one(store, "SELECT count(*) FROM v_lineage WHERE trained_model_id='micro-coevo/policy/r2/a1' "
                       "AND use='dpo_rejected' AND selection_reason = 'incorrect, worst reward'") > 0


def test_without_the_checker_the_prm_judges_right_answers_and_the_reasons_name_it(coevo_run):
    """filter.check_steps=false, min_step_score: from round 2 the previous round's PRM drops right answers whose
    weakest step it scores below the threshold, and each such selection says so; the checker only measures it."""
    import json

    cfg, store = coevo_run
    assert not cfg.filter.check_steps and cfg.filter.min_step_score is not None
    rows = store.rows("""
        SELECT sel.round, sel.reason, v.correct, sc.value AS prm_min FROM selections sel
        JOIN verifications v USING (trajectory_id)
        LEFT JOIN scores sc ON sc.trajectory_id = sel.trajectory_id AND sc.scorer = 'prm' AND sc.aggregate = 'min'
        WHERE sel.experiment_id = ? AND sel.purpose = 'policy_sft'""", [cfg.experiment])
    assert not [r for r in rows if "steps do not check" in r["reason"]]  # the checker is off
    by_prm = [r for r in rows if r["reason"].startswith("prm: weakest step")]
    assert by_prm and {r["round"] for r in by_prm} == {2}  # round 1 has no earlier PRM to judge with
    assert all(r["correct"] and r["prm_min"] < cfg.filter.min_step_score for r in by_prm)
    kept = [r for r in rows if r["reason"] == "correct" and r["round"] == 2]
    assert kept and all(r["prm_min"] >= cfg.filter.min_step_score for r in kept)
    # The domain's checker measures the PRM as a judge: how many right answers with unsound steps it caught.
    m = {r: json.loads(x) for r, x in store.query("SELECT round, metrics_json FROM stage_runs WHERE experiment_id=? "
                                                  "AND stage='filter' AND status='committed'", [cfg.experiment])[1]}
    assert m[1]["right_answers"] > 0 and m[1].get("judge_false_reject_rate") == 0.0  # no judge in round 1
    assert 0.0 <= m[2]["judge_false_reject_rate"] <= 1.0 and 0 <= m[2]["right_unsound"] <= m[2]["right_answers"]
    ev = dict(store.query("SELECT metric, value FROM evaluations WHERE experiment_id=? AND round=2 AND level=-1",
                          [cfg.experiment])[1])
    assert 0.0 <= ev["greedy_sound_acc"] <= ev["greedy_acc"] and 0.0 <= ev["greedy_unsound_rate"] <= 1.0


def test_step_pairs_from_the_search_train_the_policy_by_dpo(coevo_run):
    """filter.step_dpo_pairs: at each searched wrong answer's first dead step, a continuation that reached the
    answer from the live prefix (chosen) against the answer's own way on (rejected), whole solutions both."""
    from components.domains.arith import ArithDomain

    cfg, store = coevo_run
    pairs = store.rows("""
        SELECT sp.*, t.round, t.problem_id, t.completion, p.answer,
               (SELECT list(text ORDER BY step_index) FROM steps s WHERE s.trajectory_id = t.trajectory_id) AS steps,
               (SELECT min(step_index) FROM step_labels l WHERE l.trajectory_id = t.trajectory_id
                AND l.source = 'mc_hard' AND l.value = 0) AS first_dead
        FROM step_pairs sp JOIN trajectories t USING (trajectory_id) JOIN problems p USING (problem_id)
        WHERE t.experiment_id = ?""", [cfg.experiment])
    assert {p["round"] for p in pairs} == {1, 2}
    d = ArithDomain()
    for p in pairs:
        assert p["step_index"] == p["first_dead"]
        assert p["prefix"] + p["rejected"] == "".join(s + "\n" for s in p["steps"])
        assert d.verify([p["prefix"] + p["chosen"]], [p["answer"]]) == [1.0]  # the chosen side reaches the answer
        assert d.verify([p["completion"]], [p["answer"]]) == [0.0]
    assert any(p["chosen_from"] == "rollout" for p in pairs)
    # Each is selected (purpose step_dpo, on its rejected side) and trains the round's policy.
    selected = dict(store.query("SELECT round, count(*) FROM selections WHERE experiment_id=? AND purpose='step_dpo' "
                                "AND selected GROUP BY 1", [cfg.experiment])[1])
    assert selected == {r: sum(p["round"] == r for p in pairs) for r in (1, 2)}
    assert _one(store, "SELECT count(*) FROM v_lineage WHERE trained_model_id='micro-coevo/policy/r1/a1' "
                       "AND use='step_dpo_rejected'") > 0
    import json

    m = json.loads(_one(store, "SELECT metrics_json FROM stage_runs WHERE experiment_id=? AND round=1 "
                               "AND stage='train_policy' AND status='committed'", [cfg.experiment]))
    assert m["dpo_pairs"] == selected[1] + _one(store, "SELECT count(*) FROM selections WHERE experiment_id=? AND "
                                                       "round=1 AND purpose='dpo_chosen'", [cfg.experiment])


def test_evaluation_reports_best_of_n_and_step_quality(coevo_run):
    cfg, store = coevo_run
    ev = dict(store.query("SELECT metric, value FROM evaluations WHERE experiment_id=? AND round=2 AND level=-1",
                          [cfg.experiment])[1])
    for n in cfg.evaluate.best_of_n:
        assert 0.0 <= ev[f"prm_bon_at_{n}"] <= ev[f"pass_at_{n}"] <= 1.0
        assert f"maj_at_{n}" in ev and f"distinct_correct_at_{n}" in ev
    for k in ("prm_step_precision", "prm_step_recall", "prm_step_f1", "prm_error_f1", "processbench_f1",
              "first_error_acc_erroneous", "prm_verifier_disagreement"):
        assert 0.0 <= ev[k] <= 1.0, k
    assert "prm_bon_at_4" not in dict(store.query("SELECT metric, value FROM evaluations WHERE experiment_id=? "
                                                  "AND round=0", [cfg.experiment])[1])
    # The step metrics are recomputable from the store: oracle labels beside the PRM's step scores.
    f1 = _one(store, """
        WITH c AS (SELECT score >= 0.5 AS pred, oracle = 1.0 AS gold FROM v_prm_calibration
                   WHERE experiment_id=? AND round=2 AND oracle IS NOT NULL AND trajectory_id IN
                   (SELECT trajectory_id FROM trajectories WHERE purpose='eval'))
        SELECT 2 * count(*) FILTER (WHERE pred AND gold) /
               (2 * count(*) FILTER (WHERE pred AND gold) + count(*) FILTER (WHERE pred <> gold)) FROM c""",
               [cfg.experiment])
    assert f1 == pytest.approx(ev["prm_step_f1"])


def test_each_round_with_a_prm_draws_accuracy_against_compute(coevo_run):
    from mlflow.tracking import MlflowClient

    from components.search.curves import curve_points
    from components.tracking import TAG_ROUND, tracking_uri

    cfg, store = coevo_run
    s = cfg.evaluate.search
    curves = curve_points(store.evaluations(cfg.experiment))
    assert sorted(curves) == [1, 2]  # round 0 has no PRM to guide the searches
    for points in curves.values():
        got = {(p["method"], p["budget"]): p for p in points}
        want = {("greedy", 1)} | {(m, b) for m in ("maj", "prm_bon", "beam", "mcts") for b in s.budgets}
        assert set(got) == want
        assert all(0.0 <= p["accuracy"] <= 1.0 and p["tokens"] > 0 and p["n"] == s.problems and p["level"] == 3
                   for p in points)
        maj = [got[("maj", b)]["tokens"] for b in s.budgets]
        assert maj == sorted(maj) and got[("prm_bon", 8)]["tokens"] == got[("maj", 8)]["tokens"]
        # MCTS gets N samples' tokens: it may stop early (its best leaf settled), never more than one simulation
        # past them, plus a greedy completion of an answer cut short.
        for b in s.budgets:
            assert got[("mcts", b)]["tokens"] <= (got[("maj", b)]["tokens"] + s.expansions * s.max_step_tokens
                                                  + cfg.evaluate.max_new_tokens)
    client = MlflowClient(tracking_uri(cfg))
    runs = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
    plotted = {r.data.tags[TAG_ROUND]: {a.path for a in client.list_artifacts(r.info.run_id, "plots")} for r in runs}
    assert "plots/compute_curve.png" not in plotted["0"]
    assert all("plots/compute_curve.png" in plotted[k] for k in ("1", "2", "all"))
    from components.report import gather, render

    assert "alt='accuracy against compute'" in render(gather(store, cfg.experiment))


def test_prm_versions_are_registered_with_round_and_lineage(coevo_run):
    from mlflow.tracking import MlflowClient

    from components.tracking import tracking_uri

    cfg, store = coevo_run
    client = MlflowClient(tracking_uri(cfg), registry_uri=tracking_uri(cfg))
    versions = {int(v.tags["coevo.round"]): v for v in client.search_model_versions("name = 'micro-coevo-prm'")}
    assert sorted(versions) == [1, 2]
    for r, v in versions.items():
        assert v.tags["coevo.model_id"] == f"micro-coevo/prm/r{r}/a1"
        assert v.tags["coevo.lineage"] == f"SELECT * FROM v_lineage WHERE trained_model_id = 'micro-coevo/prm/r{r}/a1'"
        assert "heldout_prm_step_f1" in v.tags
        assert "prm/a1/model.safetensors" in {a.path for a in client.list_artifacts(v.run_id, "prm/a1")}
    assert client.get_model_version_by_alias("micro-coevo-prm", "current").version == versions[2].version
    policy = client.search_model_versions("name = 'micro-coevo-policy'")
    # Round 0's policy is micro's, given as it is (bootstrap.steps=0): not copied into MLflow again.
    assert sorted(int(v.tags["coevo.round"]) for v in policy) == [1, 2]


def test_round_zero_is_the_given_model_as_it_is(coevo_run, micro_workdir):
    """`policy.model` with `bootstrap.steps: 0`: round 0's policy is micro's checkpoint where it lies, not
    retrained or re-saved, and not copied into MLflow; the demonstrations are still stored for replay."""
    cfg, store = coevo_run
    given = Store(micro_workdir.path / "store").committed_model("micro", 0, "policy")
    mine = store.committed_model(cfg.experiment, 0, "policy")
    assert mine["uri"] == given["uri"] == cfg.policy.model and mine["sha256"] == given["sha256"]
    out = cfg.experiment_dir / "r0" / "bootstrap" / "a1"
    assert out.is_dir() and not (out / "model").exists() and not (out / "init_model").exists()
    assert _one(store, "SELECT count(*) FROM model_inputs WHERE model_id=?", [mine["model_id"]]) == 0
    assert _one(store, "SELECT count(*) FROM selections WHERE experiment_id=? AND round=0 AND selected",
                [cfg.experiment]) > 0


# filter.judge=round_and_previous: each round's PRM judges that round's right answers, and never trained on them;
# from round 2 the previous round's PRM must agree. Round 1, with no previous PRM, is filter.judge=round's.
JUDGE = ["experiment=micro-coevo-judge", "filter.judge=round_and_previous", "generate.problems_per_level=24",
         "generate.search=null", "filter.dpo_pairs=false", "filter.step_dpo_pairs=false", "train_policy.method=sft",
         *SHORT_SFT, "train_reward.steps=60", "evaluate.search=null", "evaluate.best_of_n=[]",
         "evaluate.problems_per_level=10", "evaluate.maj_k=1", "filter.judge_max_drop=0.1"]


@pytest.fixture(scope="module")
def judge_run(prefect_server, micro_workdir, tmp_path_factory):
    from flows.evolution import self_evolution

    config = REPO / "configs" / "micro-coevo.yaml"
    overrides = [f"workdir={tmp_path_factory.mktemp('judge')}", *micro_workdir.start_from_round0(), *JUDGE]
    self_evolution(config_path=str(config), overrides=overrides)
    cfg = load_config(config, overrides)
    return cfg, Store.for_config(cfg)


def test_a_judge_that_never_trained_on_what_it_judges(judge_run, tmp_path):
    """Round r's PRM trains on wrong answers' labels, the demonstrations and right answers an earlier filter kept;
    it scores round r's right answers (scorer `judge`), from round 1, and the filter drops those it scores low: below
    min_step_score, or at most judge_max_drop of them where more score below it. From round 2 it drops only those
    the previous round's PRM (scorer `prm`) also scores below its own threshold, set by the same rule."""
    import json

    from components.domains.arith import ArithDomain

    cfg, store = judge_run
    exp = cfg.experiment
    # No PRM trained on a right answer of its own round, nor on one no filter had kept.
    leaks = store.rows("""
        SELECT l.trained_round, l.source_round, l.trajectory_id, sel.selected AS kept FROM v_lineage l
        JOIN verifications v USING (trajectory_id)
        LEFT JOIN selections sel ON sel.trajectory_id = l.trajectory_id AND sel.purpose = 'policy_sft'
        WHERE l.experiment_id = ? AND l.role = 'prm' AND l.source_round > 0 AND v.correct""", [exp])
    assert all(r["source_round"] < r["trained_round"] and r["kept"] for r in leaks)
    assert any(r["trained_round"] == 2 for r in leaks)  # round 2's PRM learned from round 1's kept answers
    # Every right answer of a round is held out of that round's PRM, and judged by it.
    _, per_round = store.query("""
        SELECT t.round, count(*) AS right_answers,
               count(*) FILTER (WHERE d.reason LIKE 'held out%' AND NOT d.selected) AS held_out,
               count(*) FILTER (WHERE j.model_id = p.model_id) AS judged
        FROM trajectories t JOIN verifications v USING (trajectory_id)
        LEFT JOIN selections d ON d.trajectory_id = t.trajectory_id AND d.purpose = 'reward_train'
        LEFT JOIN scores j ON j.trajectory_id = t.trajectory_id AND j.scorer = 'judge' AND j.aggregate = 'min'
        LEFT JOIN models p ON p.experiment_id = t.experiment_id AND p.round = t.round AND p.role = 'prm'
        WHERE t.experiment_id = ? AND t.purpose = 'train' AND v.correct GROUP BY ALL ORDER BY ALL""", [exp])
    assert [r[0] for r in per_round] == [1, 2] and all(n == held == judged > 0 for _, n, held, judged in per_round)
    # The filter drops the right answers the judge scores low, from round 1 on, and says so. Its threshold is
    # min_step_score, lowered in a round where that would drop more than judge_max_drop of the right answers.
    rows = store.rows("""
        SELECT sel.round, sel.reason, j.value AS judge_min, p.value AS previous_min FROM selections sel
        JOIN verifications v USING (trajectory_id)
        JOIN scores j ON j.trajectory_id = sel.trajectory_id AND j.scorer = 'judge' AND j.aggregate = 'min'
        LEFT JOIN scores p ON p.trajectory_id = sel.trajectory_id AND p.scorer = 'prm' AND p.aggregate = 'min'
        WHERE sel.experiment_id = ? AND sel.purpose = 'policy_sft' AND v.correct""", [exp])

    def metrics(stage: str) -> dict[int, dict]:
        return {r: json.loads(x) for r, x in store.query("SELECT round, metrics_json FROM stage_runs WHERE "
                                                         "experiment_id=? AND stage=? AND status='committed'",
                                                         [exp, stage])[1]}

    threshold = {r: m["judge_min_step_score"] for r, m in metrics("filter").items()}
    assert sorted(threshold) == [1, 2] and all(t <= cfg.filter.min_step_score for t in threshold.values())
    second = {r: m["judge_previous_min_step_score"] for r, m in metrics("filter").items()
              if "judge_previous_min_step_score" in m}
    assert sorted(second) == [2] and second[2] <= cfg.filter.min_step_score  # round 1 has no previous PRM
    low = [r for r in rows if r["judge_min"] < threshold[r["round"]]]
    agreed = [r for r in low if r["round"] == 1 or r["previous_min"] < second[2]]
    assert {r["round"] for r in agreed} == {1, 2} and len(agreed) < len(low)  # the previous PRM spared some
    assert all(r["reason"].startswith("prm: weakest step") for r in agreed)
    assert all((", and the previous round's PRM's" in r["reason"]) is (r["round"] == 2) for r in agreed)
    assert all(not r["reason"].startswith("prm:") for r in rows if r not in agreed)
    judged = {rnd: [r["judge_min"] for r in rows if r["round"] == rnd] for rnd in threshold}

    def below(rnd: int, score: float) -> int:
        return sum(v < score for v in judged[rnd])

    cap = {rnd: cfg.filter.judge_max_drop * len(judged[rnd]) for rnd in threshold}
    assert all(below(rnd, threshold[rnd]) <= cap[rnd] for rnd in threshold)
    # The cap bound: min_step_score alone would have dropped more than judge_max_drop of a round's right answers.
    bound = [rnd for rnd, t in threshold.items() if t < cfg.filter.min_step_score]
    assert bound and all(below(rnd, cfg.filter.min_step_score) > cap[rnd] for rnd in bound)
    # How the judge ranked each round's right answers, whatever its threshold, as the domain's checker sees them:
    # the chance that an unsound one scored below a sound one, counted here pair by pair.
    domain = ArithDomain()
    answers = store.rows("SELECT t.round, t.prompt, t.completion, j.value FROM trajectories t JOIN verifications v "
                         "USING (trajectory_id) JOIN scores j ON j.trajectory_id = t.trajectory_id AND j.scorer = "
                         "'judge' AND j.aggregate = 'min' WHERE t.experiment_id = ? AND v.correct", [exp])
    for rnd, m in metrics("filter").items():
        verdicts = [(domain.check_steps(a["prompt"], a["completion"]), a["value"])
                     for a in answers if a["round"] == rnd]
        pairs = [(u < s) + 0.5 * (u == s) for ok_u, u in verdicts if ok_u is False for ok_s, s in verdicts if ok_s]
        assert pairs and m["judge_auc"] == pytest.approx(sum(pairs) / len(pairs)), rnd
        assert 0.0 <= m["judge_hindsight_catch"] <= 1.0
    m = metrics("train_policy")
    assert m[2]["replay_judged_out"] >= 0  # round 2's PRM re-judged the replay pool (round 1's kept answers)
    assert_plans_read_what_they_declare(cfg, store, tmp_path)


def test_a_prm_on_its_own_backbone_whatever_the_plan_warm_started_from(judge_run, tmp_path):
    """train_reward.model: a new PRM starts from the named backbone, not from the policy that sampled the round. The
    job reads train_reward.init and .model from its config, so a stored round-2 spec whose plan named the previous
    PRM trains from the backbone under init=policy (benchmarks/judge_settings.py retrains stored specs so)."""
    import json

    from transformers import AutoConfig

    from components.jobs.launch import run_job
    from components.models.tiny import TinyLlamaConfig, create_tiny_llama

    cfg, store = judge_run
    backbone = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_heads=2, intermediate_size=96),
                                 tmp_path / "backbone", seed=3)
    policy_width = AutoConfig.from_pretrained(store.committed_model(cfg.experiment, 0, "policy")["uri"]).hidden_size
    for rnd, init in ((1, "previous"), (2, "policy"), (2, "previous")):
        spec = json.loads(store.committed_run(cfg.experiment, rnd, "train_reward")["spec_json"])
        assert bool(spec["params"]["init_prm_uri"]) is (rnd == 2)
        spec["config"]["train_reward"] |= {"model": str(backbone), "init": init, "steps": 5}
        spec["out_dir"], spec["attempt"] = str(tmp_path / f"r{rnd}-{init}"), 99
        path = tmp_path / f"r{rnd}-{init}.json"
        path.write_text(json.dumps(spec))
        run_job("train_reward", path, log=lambda line: None, timeout_s=600)
        width = AutoConfig.from_pretrained(tmp_path / f"r{rnd}-{init}" / "prm").hidden_size
        # round 2 under init=previous warm-starts from round 1's PRM, on the policy's backbone in this run
        assert width == (policy_width if (rnd, init) == (2, "previous") else 32), (rnd, init)
        assert list((tmp_path / f"r{rnd}-{init}").glob("part-scores-*.parquet"))  # it judged the round's answers
