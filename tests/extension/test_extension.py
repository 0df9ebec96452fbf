"""A domain, a reward model and a recipe added from `tests/extension/toys.py` by dotted path, with no edit to
`components/`, each run through the real `self_evolution` flow (Prefect, MLflow, DuckDB, tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from components.config import load_config
from components.store import Store

pytestmark = pytest.mark.slow

# One round on a ~20k-parameter model: the mechanics, not learning.
TOY = {
    "experiment": "toy", "seed": 0, "rounds": 1, "recipe": "rft",
    "domain": {"name": "tests.extension.toys:SumDomain", "options": {"max_level": 2, "test_size": 12}},
    "policy": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                        "max_position_embeddings": 128}},
    "bootstrap": {"levels": [1, 2], "problems_per_level": 150, "seed_levels": [], "steps": 300, "batch_size": 32,
                  "learning_rate": 3.0e-3},
    "generate": {"problems_per_level": 8, "samples_per_problem": 4, "max_new_tokens": 40},
    "score": {"reward_model": "tests.extension.toys:WellFormedSteps", "mc_rollouts": 2, "mc_max_trajectories": 12},
    "filter": {"max_per_problem": 2},
    "train_policy": {"steps": 10, "epochs": None, "batch_size": 16},
    "evaluate": {"problems_per_level": 12, "maj_k": 2, "max_new_tokens": 40},
    "curriculum": {"low": 0.0, "high": 1.0, "max_levels": 2},
}


def _run(tmp_path, **changes):
    from flows.evolution import self_evolution

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({**TOY, "workdir": str(tmp_path), **changes}))
    self_evolution(config_path=str(path))
    cfg = load_config(path)
    return cfg, Store.for_config(cfg)


@pytest.fixture(scope="module")
def toy_run(prefect_server, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("toy"))


def test_a_domain_with_multi_line_steps(toy_run):
    cfg, store = toy_run
    steps = store.rows("SELECT s.text FROM steps s JOIN trajectories t USING (trajectory_id) "
                       "WHERE t.round = 1 AND t.purpose = 'train'")
    assert steps and any("\n" in s["text"] for s in steps), "steps keep their inner line break"
    # Monte Carlo labels build each prefix with the domain's separator: with any other, a right answer's
    # full prefix would not verify (SumDomain finds no answer in wrongly joined steps), so its last step,
    # verified as it stands, would be labelled 0.
    last = store.rows(
        "SELECT l.value FROM step_labels l JOIN verifications v USING (trajectory_id) "
        "WHERE l.source = 'mc_hard' AND v.correct AND l.step_index = "
        "(SELECT max(step_index) FROM steps s WHERE s.trajectory_id = l.trajectory_id)")
    assert last, "some right answers were labelled"
    assert all(r["value"] == 1.0 for r in last)


def test_a_reward_model_by_dotted_path_scores_and_ranks(toy_run):
    cfg, store = toy_run
    n_traj = store.rows("SELECT count(*) AS n FROM trajectories WHERE round = 1 AND purpose = 'train'")[0]["n"]
    agg = store.rows("SELECT aggregate, count(*) AS n FROM scores WHERE scorer = 'well_formed' AND step_index = -1 "
                     "GROUP BY 1 ORDER BY 1")
    assert {r["aggregate"]: r["n"] for r in agg} == {"last": n_traj, "mean": n_traj, "min": n_traj}
    run = store.committed_run(cfg.experiment, 1, "filter")
    metrics = json.loads((Path(run["out_dir"]) / "manifest.json").read_text())["metrics"]
    assert "selected_mean_rank_score" in metrics, "the filter ranked by the reward model, not the outcome"


def test_a_recipe_by_dotted_path_decides_the_stages(prefect_server, tmp_path):
    cfg, store = _run(tmp_path, experiment="toy-lite", recipe="tests.extension.toys:RECIPE",
                      score={"mc_rollouts": 0})
    stages = [r["stage"] for r in store.stage_runs(cfg.experiment) if r["status"] == "committed"]
    assert stages == ["bootstrap", "evaluate", "generate", "verify", "filter", "train_policy", "evaluate"]
    reasons = {r["reason"] for r in store.rows("SELECT reason FROM selections WHERE round = 1")}
    assert "correct" in reasons or "incorrect" in reasons
