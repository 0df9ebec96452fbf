"""The stage registry, the recipes and the reward-model loader: what a new part must satisfy to plug in."""

from __future__ import annotations

import dataclasses

import pytest

from components.config import ConfigError, ExperimentConfig, load_config_dict
from components.recipes import RECIPES, get_recipe
from components.rewards import RewardModel, load_reward_model
from components.stages import STAGES, get_stage
from components.store import DATA_TABLES


def test_every_stage_is_registered_once_with_a_config_section_and_known_tables():
    assert set(STAGES) == {"bootstrap", "generate", "verify", "score", "train_reward", "filter", "train_policy",
                           "evaluate", "import"}
    sections = set(ExperimentConfig.model_fields)
    for name, s in STAGES.items():
        assert s.name == name and s.section in sections, name
        assert set(s.writes) <= set(DATA_TABLES), name
        assert set(s.reads) <= set(STAGES), name
        assert dataclasses.is_dataclass(s.inputs), name
    assert {n for n, s in STAGES.items() if not s.gpu} == {"verify", "filter", "import"}


def test_every_recipe_runs_registered_stages_and_ends_with_evaluate():
    # `import` holds existing trajectories: round 0 only, no policy to evaluate.
    assert get_recipe("import").round_stages(0) == ["import"] and get_recipe("import").stages == ()
    for name in set(RECIPES) - {"import"}:
        r = get_recipe(name)
        for rnd in (0, 1):
            stages = r.round_stages(rnd)
            assert set(stages) <= set(STAGES) and stages[-1] == "evaluate", (name, rnd)
        assert r.round_stages(0) == ["bootstrap", "evaluate"]
    assert get_recipe("coevo").round_stages(1) == ["generate", "verify", "score", "train_reward", "filter",
                                                   "train_policy", "evaluate"]


@pytest.mark.parametrize(("data", "message"), [
    ({"recipe": "nope"}, "unknown recipe 'nope'"),
    ({"recipe": "components.recipes:RECIPES"}, "not a components.recipes.Recipe"),
    ({"recipe": "rft", "train_reward": {"enabled": True}, "score": {"mc_rollouts": 2}}, "recipe 'rft' uses no reward model"),
    ({"recipe": "coevo"}, "recipe 'coevo' trains a PRM each round"),
    ({"score": {"reward_model": "magic"}}, "unknown reward model 'magic'"),
])
def test_a_config_that_names_an_unknown_part_or_contradicts_its_recipe_is_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config_dict({"experiment": "x", **data})


def test_a_recipe_and_a_reward_model_by_dotted_path_are_accepted():
    cfg = load_config_dict({"experiment": "x", "recipe": "tests.extension.toys:RECIPE",
                            "score": {"reward_model": "tests.extension.toys:WellFormedSteps"}})
    assert get_recipe(cfg.recipe).round_stages(1) == ["generate", "verify", "filter", "train_policy", "evaluate"]
    rm = load_reward_model(cfg.score.reward_model, None, separator="\n\n")
    assert isinstance(rm, RewardModel) and rm.separator == "\n\n"
    assert rm.score(["1 2\n"], ["1+2\n=3\n\n#### 3\n\n"], [["1+2\n=3", "#### 3"]]) == [[1.0, 1.0]]


def test_a_reward_model_that_does_not_follow_the_protocol_is_refused():
    with pytest.raises(ValueError, match="unknown reward model"):
        load_reward_model("magic")
    with pytest.raises(ValueError, match="does not follow components.rewards.RewardModel"):
        load_reward_model("tests.extension.toys:SumDomain")


def test_an_unknown_stage_is_named():
    with pytest.raises(ValueError, match="unknown stage 'sample'"):
        get_stage("sample")
