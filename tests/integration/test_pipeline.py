"""A micro experiment through the real Prefect flow, real MLflow (SQLite) and a real DuckDB store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.config import load_config
from components.store import Store

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def micro_run(prefect_server, tmp_path_factory):
    from flows.evolution import self_evolution

    workdir = tmp_path_factory.mktemp("micro")
    overrides = [f"workdir={workdir}"]
    summaries = self_evolution(config_path=str(REPO / "configs/micro.yaml"), overrides=overrides)
    cfg = load_config(REPO / "configs/micro.yaml", overrides)
    return cfg, Store(cfg.store_path), summaries


def test_every_stage_committed_once(micro_run):
    cfg, store, _ = micro_run
    cols, rows = store.query("SELECT round, stage, status, count(*) FROM stage_runs GROUP BY ALL ORDER BY 1, 2")
    got = {(r, s): (st, n) for r, s, st, n in rows}
    assert got[(0, "train_policy")] == ("committed", 1)
    assert got[(0, "evaluate")] == ("committed", 1)
    for r in (1, 2):
        for s in ("generate", "verify", "score", "filter", "train_policy", "evaluate"):
            assert got[(r, s)] == ("committed", 1), (r, s)


def test_rows_committed_each_round(micro_run):
    cfg, store, _ = micro_run
    _, rows = store.query("SELECT round, count(*) FROM trajectories WHERE purpose='train' GROUP BY 1 ORDER BY 1")
    per_round = dict(rows)
    for r in (1, 2):
        levels = json.loads(store.query("SELECT levels_json FROM round_plans WHERE round=?", [r])[1][0][0])
        expected = len(levels) * cfg.generate.problems_per_level * cfg.generate.samples_per_problem
        assert per_round[r] == expected
    n_ver = store.query("SELECT count(*) FROM verifications v JOIN trajectories t USING (trajectory_id) "
                        "WHERE t.purpose='train'")[1][0][0]
    assert n_ver == sum(per_round.values())
    assert store.query("SELECT count(*) FROM selections WHERE selected")[1][0][0] > 0
    assert store.query("SELECT count(*) FROM models WHERE role='policy'")[1][0][0] == 3


def test_accuracy_rises_at_the_curriculum_level(micro_run):
    cfg, store, _ = micro_run
    target = max(json.loads(store.query("SELECT levels_json FROM round_plans WHERE round=1")[1][0][0]))
    _, rows = store.query("SELECT round, value FROM evaluations WHERE metric='greedy_acc' AND level=? ORDER BY 1",
                          [target])
    acc = dict(rows)
    assert acc[2] > acc[0], f"level {target} greedy accuracy did not rise: {acc}"


def test_mlflow_matches_the_store(micro_run):
    from mlflow.tracking import MlflowClient

    from components.tracking import TAG_ROUND, tracking_uri

    cfg, store, _ = micro_run
    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags[TAG_ROUND] == "all"]
    children = [r for r in runs if r.data.tags[TAG_ROUND] != "all"]
    assert len(parents) == 1
    parent = parents[0]
    assert sorted(int(r.data.tags[TAG_ROUND]) for r in children) == [0, 1, 2]
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert parent.data.tags["config_hash"] == cfg.config_hash()
    assert "git_sha" in parent.data.tags
    history = {m.step: m.value for m in client.get_metric_history(parent.info.run_id, "evaluate/greedy_acc")}
    _, rows = store.query("SELECT round, greedy_acc FROM v_round_summary ORDER BY 1")
    assert {r: pytest.approx(v) for r, v in rows} == history
    for child in children:
        assert child.data.metrics["evaluate/greedy_acc"] == pytest.approx(history[int(child.data.tags[TAG_ROUND])])
        assert "timing/evaluate" in child.data.metrics
    artifacts = [a.path for a in client.list_artifacts(parent.info.run_id, "plots")]
    assert "plots/accuracy_per_round.png" in artifacts


def test_second_run_is_a_no_op_resume(micro_run, prefect_server):
    from flows.evolution import self_evolution

    cfg, store, _ = micro_run
    before = store.table_hashes(cfg.experiment)
    self_evolution(config_path=str(REPO / "configs/micro.yaml"), overrides=[f"workdir={cfg.workdir}"])
    assert store.table_hashes(cfg.experiment) == before
    assert store.query("SELECT count(*) FROM stage_runs WHERE status <> 'committed'")[1][0][0] == 0


def test_lineage_names_the_exact_training_examples(micro_run):
    cfg, store, _ = micro_run
    # Every example that trained round 2's policy is a selected trajectory, new from round 2 or replayed.
    _, rows = store.query(
        "SELECT use, count(*), count(*) FILTER (WHERE selection_reason IS NULL), min(source_round), max(source_round) "
        "FROM v_lineage WHERE trained_model_id = ? GROUP BY 1 ORDER BY 1", [f"{cfg.experiment}/policy/r2"])
    by_use = {r[0]: r[1:] for r in rows}
    assert by_use["new"][0] > 0 and by_use["new"][2:] == (2, 2)
    assert by_use["replay"][0] > 0 and by_use["replay"][3] < 2
    assert all(v[1] == 0 for v in by_use.values()), "every training example has a selection decision"
    n_train = store.query("SELECT train_examples FROM models WHERE model_id = ?",
                          [f"{cfg.experiment}/policy/r2"])[1][0][0]
    assert sum(v[0] for v in by_use.values()) == n_train
