"""vLLM end to end: the engine beside HF on one model, the micro config's sampling stages through it, and
the OpenAI-compatible backend against a real `vllm serve`.

vLLM runs in `.venv-vllm`, which `make test` builds (`make vllm`). Without it these tests fail, saying
so: they never pass because the engine is missing.

The bounds. Sampled outcomes are compared paired, per problem (pass rates) or per step prefix (Monte
Carlo labels): the mean paired difference must lie within 4 standard errors of zero, as two samplers of
the same distribution do but for about 1 in 16,000 runs. Samples of one problem are correlated; pairing
by problem keeps that out of the bound.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, untied_copy

pytestmark = pytest.mark.slow

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CONFIG = REPO / "configs" / "micro.yaml"
# Round 1 of the micro config, with Monte Carlo step labels so that `score` samples too, and a short
# policy training: what is compared here is sampling, not learning.
ROUND1 = ["rounds=1", "score.mc_rollouts=4", "train_policy.steps=20"]


def paired_bound(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean of a - b, 4 standard errors of that mean)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)
    return mean, 4 * math.sqrt(var / len(d)) + 1e-9


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm` builds it (make test does)")
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def hf_run(prefect_server, tmp_path_factory):
    """The micro config's round 0 and round 1 on the hf backend (a 250-step bootstrap: enough for the
    policy to solve levels 1-2 and some of 3), in a workdir the vLLM and server runs share."""
    from components.store import Store
    from flows.evolution import self_evolution

    wd = tmp_path_factory.mktemp("vllm")
    self_evolution(config_path=str(CONFIG), overrides=[f"workdir={wd}", "experiment=hf", "bootstrap.steps=250",
                                                       *ROUND1])
    store = Store(wd / "store")
    return wd, store.committed_model("hf", 0, "policy")["uri"]


def _q(store, sql: str, params: list) -> list[tuple]:
    return store.query(sql, params)[1]


def _stage(store, experiment: str, round: int, stage: str) -> dict:
    """The committed attempt's rows per table (as the stage wrote them) and metrics."""
    rows = _q(store, "SELECT rows_json, metrics_json FROM stage_runs WHERE experiment_id = ? AND round = ? AND "
                     "stage = ? AND status = 'committed'", [experiment, round, stage])
    assert len(rows) == 1, (experiment, round, stage, rows)
    return {"rows": json.loads(rows[0][0]), "metrics": json.loads(rows[0][1])}


def test_vllm_samples_as_hf_does_on_the_same_model(vllm_python, hf_run, tmp_path):
    """Greedy decoding, sampled pass rates, Monte Carlo labels, reproducibility, the step sampler and the
    waves of until_correct: HF and vLLM in one process of .venv-vllm, on round 0's policy."""
    _, model = hf_run
    out = tmp_path / "side_by_side.json"
    with tempfile.TemporaryDirectory(prefix="coevo-vllm-") as scratch:  # vLLM leaves its IPC sockets in TMPDIR
        p = subprocess.run([str(vllm_python), "tests/integration/vllm_side_by_side.py", model, str(out)], cwd=REPO,
                           env=os.environ | {"PYTHONPATH": str(REPO), "TMPDIR": scratch}, capture_output=True,
                           text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    got = json.loads(out.read_text())
    n = got["problems"]
    # Both in float32: greedy decoding may part only where two tokens' logits tie to rounding.
    assert got["greedy_same_text"] >= 0.95 * n and got["greedy_same_tokens"] >= 0.95 * n, got
    diff, bound = paired_bound(got["hf_right_per_problem"], got["vllm_right_per_problem"])
    assert abs(diff) <= bound, (diff, bound)
    assert 0.05 < sum(got["vllm_right_per_problem"]) / n < 0.95  # a policy that solves some, not all
    soft_hf, soft_vllm = got["hf_mc_soft"], got["vllm_mc_soft"]
    assert soft_hf.keys() == soft_vllm.keys() and len(soft_hf) >= 100, len(soft_hf)
    keys = sorted(soft_hf)
    diff, bound = paired_bound([soft_hf[k] for k in keys], [soft_vllm[k] for k in keys])
    assert abs(diff) <= bound, (diff, bound)
    assert got["vllm_reproduces_itself"] and got["vllm_other_seed_differs"]
    # The step sampler draws each step with stop=[separator] and redraws the ones its judge (here the
    # domain's oracle) rejects: at level 3 it ends no worse than plain sampling.
    assert got["search_redraws"] > 0 and got["searched_right"] >= got["plain_right"], got
    assert got["waves"]["waves"] >= 2 and got["waves_trajectories"] <= 8 * 30, got
    assert got["vllm_stats"]["prefix_cache_queries"] > 0
    # What vLLM cannot start fails at once, naming the backend, the model and the cause, and is not retried.
    for name, what, where in (("unknown_arch", "NoSuchForCausalLM", "unknown-arch"),
                              ("adapter", "LoRA adapter", "adapter"), ("out_of_memory", "if out of memory", model)):
        refused = got["refused"][name]
        assert refused and not refused["transient"], (name, refused)
        assert "backend 'vllm'" in refused["message"] and where in refused["message"], refused
        assert what in refused["message"], refused
    # The engine's own words: in its error where it runs in the job's process (a CPU's default), else in its log.
    assert "requested memory for kv" in got["refused"]["out_of_memory"]["message"] + p.stdout + p.stderr


def test_the_micro_configs_sampling_stages_commit_through_vllm_what_they_commit_through_hf(vllm_python, hf_run):
    from components.store import Store
    from flows.evolution import self_evolution

    wd, model = hf_run
    self_evolution(config_path=str(CONFIG), overrides=[f"workdir={wd}", "experiment=vllm", "generate.backend=vllm",
                                                       f"policy.model={model}", "bootstrap.steps=0", *ROUND1])
    store = Store(wd / "store")
    tables = {"generate": ("problems", "trajectories", "steps"), "verify": ("verifications",),
              "score": ("scores", "step_labels"),
              "evaluate": ("problems", "trajectories", "steps", "verifications", "evaluations")}
    # Sampled text differs, so the number of steps (and of their labels) may; everything keyed by problem or
    # sample may not.
    free = {("generate", "steps"), ("score", "step_labels"), ("evaluate", "steps")}
    for round, stages in ((0, ("evaluate",)), (1, ("generate", "verify", "score", "evaluate"))):
        for stage in stages:
            hf, vl = _stage(store, "hf", round, stage)["rows"], _stage(store, "vllm", round, stage)["rows"]
            assert set(tables[stage]) <= set(hf) and set(vl) == set(hf), (round, stage, hf, vl)
            for table in tables[stage]:
                ok = vl[table] == hf[table] or ((stage, table) in free and vl[table] > 0)
                assert ok, (round, stage, table, hf[table], vl[table])
    # The same problems, drawn from the same seeds.
    q = ("SELECT DISTINCT problem_id FROM trajectories WHERE experiment_id = ? AND round = 1 AND purpose = 'train' "
         "ORDER BY 1")
    assert _q(store, q, ["hf"]) == _q(store, q, ["vllm"])
    # Pass rates per problem agree within the paired bound.
    q = ("SELECT t.problem_id, avg(v.correct::DOUBLE) FROM verifications v JOIN trajectories t USING "
         "(trajectory_id) JOIN stage_runs s ON v.stage_run_id = s.stage_run_id WHERE s.experiment_id = ? AND "
         "s.round = 1 AND s.stage = 'verify' AND s.status = 'committed' GROUP BY 1 ORDER BY 1")
    hf, vl = dict(_q(store, q, ["hf"])), dict(_q(store, q, ["vllm"]))
    assert hf.keys() == vl.keys()
    diff, bound = paired_bound([hf[k] for k in sorted(hf)], [vl[k] for k in sorted(hf)])
    assert abs(diff) <= bound, (diff, bound)
    # Seeded vLLM reproduces its own hashes for the same batch composition: generate rerun into scratch.
    from components.config import load_config
    from components.jobs.launch import reproduce_stage

    cfg = load_config(CONFIG, [f"workdir={wd}", "experiment=vllm", "generate.backend=vllm", f"policy.model={model}",
                               "bootstrap.steps=0", *ROUND1])
    pairs = reproduce_stage(cfg, store, 1, "generate", code_version=None, log=lambda _: None)
    assert pairs and all(a == b != "" for a, b in pairs.values()), pairs
    # Each sampling stage ran in .venv-vllm and reports the engine's prefix cache.
    for stage in ("generate", "score", "evaluate"):
        metrics = _stage(store, "vllm", 1, stage)["metrics"]
        assert 0 <= metrics["engine_prefix_cache_hit_rate"] <= 1 and metrics["engine_prefix_cache_queries"] > 0
        assert "engine_prefix_cache_hit_rate" not in _stage(store, "hf", 1, stage)["metrics"]


def test_the_openai_backend_runs_a_round_against_one_vllm_serve(vllm_python, hf_run, tmp_path):
    """Rounds 0 and 1 of the micro config through one `vllm serve`, started on round 0's policy: each sampling
    stage loads its own policy into it (`reload_weights`), so round 1's evaluate samples the round-1 policy. The
    server then samples each policy as HF does, greedy, after each reload. With the server gone, a stage attempt
    fails as transient and commits nothing."""
    from components.config import load_config
    from components.jobs.launch import StageJobError, run_stage_attempt
    from components.models.backends import get_backend
    from components.servers import free_port, vllm_served
    from components.store import Store
    from flows.evolution import self_evolution

    wd, tied = hf_run
    # vLLM's CPU build keeps a tied output layer's prepacked weights across a reload (the backend refuses one):
    # the same model, its output layer a copy of its embeddings.
    model = untied_copy(tied, tmp_path / "untied")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    options = {"base_url": url, "timeout_s": 60, "max_retries": 1, "served_model_name": "policy",
               "reload_weights": True}
    over = [f"workdir={wd}", "experiment=served", "generate.backend=openai", f"policy.model={model}",
            "bootstrap.steps=0", *ROUND1, "score.mc_max_trajectories=24",
            f"generate.backend_options={json.dumps(options)}"]
    cfg = load_config(CONFIG, over)
    with vllm_served(str(model), port, tmp_path / "serve.log", python=vllm_python, kv_cache_gib=1,
                     served_model_name="policy", dev_mode=True):
        self_evolution(config_path=str(CONFIG), overrides=over)
        store = Store(wd / "store")
        policies = {r: store.committed_model("served", r, "policy")["uri"] for r in (0, 1)}
        prompts = [p for (p,) in _q(store, "SELECT DISTINCT p.prompt FROM problems p JOIN trajectories t USING "
                                           "(problem_id) WHERE t.experiment_id = 'served' AND t.round = 1 AND "
                                           "t.purpose = 'eval' ORDER BY 1", [])]
        greedy = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=cfg.evaluate.max_new_tokens, seed=0)
        by = {}
        for r in (1, 0):  # round 1's policy is the one loaded last by the run; then back to round 0's
            served = get_backend("openai", policies[r], base_url=url, served_model_name="policy",
                                 reload_weights=True)
            by[r] = ([s[0].text for s in get_backend("hf", policies[r]).generate(prompts, **greedy)],
                     [s[0].text for s in served.generate(prompts, **greedy)])
            assert served.stats()["weight_reloads"] == 1
    same = {r: sum(a == b for a, b in zip(*by[r])) for r in by}
    differ = [i for i, (a, b) in enumerate(zip(by[0][0], by[1][0])) if a != b]  # where the policies' HF answers do
    print(f"one vllm serve, weights reloaded: greedy as HF on {same[1]} of {len(prompts)} held-out prompts with "
          f"round 1's policy, {same[0]} with round 0's; the two policies differ on {len(differ)}")
    assert differ, "round 1's training changed no greedy answer: the reload is not tested"
    assert same[0] >= 0.9 * len(prompts) and same[1] >= 0.9 * len(prompts), same
    # Where the policies differ, a server that kept round 0's weights would answer as round 0 does.
    assert sum(by[1][1][i] == by[1][0][i] for i in differ) >= 0.9 * len(differ)
    for stage in ("generate", "score", "evaluate"):  # each sampling stage loaded its policy once
        assert _stage(store, "served", 1, stage)["metrics"]["engine_weight_reloads"] == 1, stage
    # The same held-out problems and samples per problem as hf's round 0; greedy accuracy agrees per level.
    hf, served = _stage(store, "hf", 0, "evaluate"), _stage(store, "served", 0, "evaluate")
    # Steps follow the sampled text (maj@k samples), as in the stage comparison above; the rest is keyed by
    # problem or sample and must match.
    keyed = {t: n for t, n in hf["rows"].items() if t != "steps"}
    assert {t: served["rows"][t] for t in keyed} == keyed and served["rows"]["steps"] > 0, (served["rows"], keyed)
    assert served["rows"].keys() == hf["rows"].keys()
    levels = sorted(k for k in hf["metrics"] if k.startswith("greedy_acc_L"))
    assert levels and all(abs(hf["metrics"][k] - served["metrics"][k]) <= 0.05 for k in levels), (hf, served)
    assert _stage(store, "served", 1, "generate")["rows"]["trajectories"] \
        == _stage(store, "hf", 1, "generate")["rows"]["trajectories"]
    # The server is gone: a new attempt fails as transient (the flow would retry it) and commits nothing.
    with pytest.raises(StageJobError, match=r"backend 'openai'.*127\.0\.0\.1") as e:
        run_stage_attempt(cfg, store, 0, "evaluate", code_version=None, log=lambda _: None)
    assert e.value.transient
    states = _q(store, "SELECT attempt, status FROM stage_runs WHERE experiment_id = 'served' AND round = 0 AND "
                       "stage = 'evaluate' ORDER BY attempt", [])
    assert states == [(1, "committed"), (2, "failed")]


def test_a_grpo_round_trains_on_the_ids_vllm_sampled(vllm_python, hf_run):
    """Recipe grpo sampling through vLLM: TRL's loss reads each rollout's ids as the engine sampled them (none
    re-tokenized), its group advantages are the stored ones, and the round lands in `v_rl_round`."""
    from components.store import Store
    from flows.evolution import self_evolution

    wd, model = hf_run
    self_evolution(config_path=str(REPO / "configs" / "micro-grpo.yaml"), overrides=[
        f"workdir={wd}", "experiment=grpo-vllm", "rounds=1", "generate.backend=vllm", f"policy.model={model}",
        "bootstrap.steps=0", "generate.problems_per_level=16", "evaluate.problems_per_level=10", "evaluate.maj_k=1"])
    store = Store(wd / "store")
    problems, rollouts, no_ids, cut = _q(
        store, "SELECT count(DISTINCT problem_id), count(*), count(*) FILTER (WHERE token_ids IS NULL), count(*) "
               "FILTER (WHERE len(token_ids) <> num_tokens) FROM trajectories WHERE experiment_id = ? AND round = 1 "
               "AND purpose = 'train'", ["grpo-vllm"])[0]
    assert rollouts == problems * 8 > 0 and no_ids == cut == 0
    assert _stage(store, "grpo-vllm", 1, "generate")["metrics"]["engine_prefix_cache_queries"] > 0  # in vLLM
    trained = _stage(store, "grpo-vllm", 1, "train_policy")["metrics"]
    assert trained["retokenized"] == 0 and trained["advantage_gap"] < 1e-5
    cols, rows = store.query("SELECT * FROM v_rl_round WHERE experiment_id = ?", ["grpo-vllm"])
    r = dict(zip(cols, rows[0]))
    assert r["rollouts"] == rollouts and r["rollouts_trained"] > 0 and r["optimizer_steps"] > 0
    assert 0 <= r["clip_fraction"] <= 1 and 0 < r["staleness_max"] < r["optimizer_steps"]
