"""Sharding and placement, without running a job: shares, merged metrics, pools, the config hash."""

from __future__ import annotations

import json

import pytest

from components.config import ConfigError, load_config
from components.jobs.launch import pool_of
from components.jobs.shards import shard_specs
from components.jobs.spec import SpecError, StageSpec
from components.stages import STAGES
from components.stages.base import merged_counts
from tests.conftest import REPO

MICRO = REPO / "configs" / "micro.yaml"


def _spec(**kw) -> StageSpec:
    return StageSpec(experiment="e", round=1, stage="generate", attempt=1, out_dir="/w/e/r1/generate/a1", seed=7,
                     config={}, config_hash="h", **kw)


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_every_problem_falls_to_exactly_one_shard(shards):
    keys = [f"p{i}" for i in range(20)] + ["p3", "p5"]  # repeated ids count once
    parts = [_spec(shard=k, shards=shards).share(keys) for k in range(shards)]
    assert sorted(k for p in parts for k in p) == sorted(set(keys))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1, [len(p) for p in parts]


def test_more_shards_than_problems_is_an_error_naming_the_setting():
    with pytest.raises(SpecError, match=r"execution.shards=4 is more than the 3 problems.*shard 3 would get none"):
        _spec(shard=3, shards=4).share(["a", "b", "c"])


def test_shard_specs_have_their_own_seed_and_folder():
    base = _spec()
    parts = shard_specs(base, STAGES["generate"], experiment_seed=0, shards=3)
    assert [p.shard for p in parts] == [0, 1, 2] and all(p.shards == 3 for p in parts)
    assert len({p.seed for p in parts}) == 3
    assert [p.out_dir for p in parts] == [f"/w/e/r1/generate/a1.shard{k}" for k in range(3)]
    assert [p.job_id for p in parts] == [f"e/r1/generate/a1/shard{k}" for k in range(3)]
    from components.seeding import derive_seed

    assert parts[0].seed == derive_seed(0, 1, "generate"), "shard 0 draws with the unsharded stage's seed"


def test_merged_counts_add_counts_and_take_the_longest_time():
    got = merged_counts([{"trajectories": 10, "mc_seconds": 4.0, "engine_prefix_cache_hits": 1,
                          "engine_prefix_cache_queries": 4, "engine_prefix_cache_hit_rate": 0.25},
                         {"trajectories": 6, "mc_seconds": 9.0, "engine_prefix_cache_hits": 5,
                          "engine_prefix_cache_queries": 6, "engine_prefix_cache_hit_rate": 0.83}],
                        maxed=("mc_seconds",))
    assert got == {"trajectories": 16.0, "mc_seconds": 9.0, "engine_prefix_cache_hits": 6.0,
                   "engine_prefix_cache_queries": 10.0, "engine_prefix_cache_hit_rate": 0.6}


def test_the_shardable_stages():
    assert sorted(n for n, s in STAGES.items() if s.merge is not None) == ["evaluate", "generate", "score", "verify"]


def test_pool_precedence(monkeypatch):
    monkeypatch.delenv("COEVO_POOL", raising=False)
    monkeypatch.delenv("COEVO_GPU_POOL", raising=False)
    cfg = load_config(MICRO)
    assert {s: pool_of(cfg, s) for s in ("generate", "filter")} == {"generate": None, "filter": None}
    cfg = load_config(MICRO, ["execution.pool=cpu", "execution.gpu_pool=gpu", "execution.stage_pools={verify: local}"])
    assert (pool_of(cfg, "generate"), pool_of(cfg, "filter"), pool_of(cfg, "verify")) == ("gpu", "cpu", None)
    monkeypatch.setenv("COEVO_POOL", "env-cpu")
    monkeypatch.setenv("COEVO_GPU_POOL", "env-gpu")
    assert (pool_of(cfg, "generate"), pool_of(cfg, "filter"), pool_of(cfg, "verify")) == ("env-gpu", "env-cpu", None)


def test_where_jobs_run_is_not_part_of_the_experiment():
    base = load_config(MICRO)
    on_pool = load_config(MICRO, ["execution.pool=gpu", "execution.worker_timeout_s=5"])
    assert on_pool.config_hash() == base.config_hash()
    assert on_pool.extends(base.model_dump_json()) is False  # the same experiment: nothing to extend
    assert load_config(MICRO, ["execution.shards=2"]).config_hash() != base.config_hash()


def test_a_config_written_before_the_execution_section_keeps_its_hash():
    import hashlib

    cfg = load_config(MICRO)
    body = cfg.to_dict()
    body.pop("execution")
    old = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    assert cfg.config_hash() == old


def test_an_unknown_stage_in_stage_pools_is_refused():
    with pytest.raises(ConfigError, match="execution.stage_pools.*genrate"):
        load_config(MICRO, ["execution.stage_pools={genrate: gpu}"])


def test_a_shard_whose_manifest_is_missing_fails_the_stage_naming_it(tmp_path):
    """A runner that reports success while the shard's files never reached shared storage (a worker writing
    to its own disk): the stage must not be merged or committed."""
    from components.jobs.launch import execute
    from components.manifest import ManifestError

    cfg = load_config(MICRO, [f"workdir={tmp_path}", "execution.shards=2"])
    spec = StageSpec(experiment="micro", round=1, stage="verify", attempt=1,
                     out_dir=str(tmp_path / "micro" / "r1" / "verify" / "a1"), seed=1, config=cfg.to_dict(),
                     config_hash=cfg.config_hash())
    ran = []

    def elsewhere(stage, spec_path, log, timeout_s, python):
        ran.append(spec_path.rsplit("/", 1)[-1])
        return "worker-with-its-own-disk", None

    with pytest.raises(ManifestError, match=r"micro/r1/verify/a1: shard 0 has no manifest at .*a1.shard0/manifest.json"):
        execute(cfg, spec, runner=elsewhere, log=lambda _: None)
    assert sorted(ran) == ["a1.shard0.spec.json", "a1.shard1.spec.json"]
    assert not (tmp_path / "micro" / "r1" / "verify" / "a1").exists()
