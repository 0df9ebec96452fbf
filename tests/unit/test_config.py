import hashlib
import json

import pytest

from components.config import ConfigError, load_config, load_config_dict
from tests.conftest import REPO


def test_every_shipped_config_loads_and_opens_with_its_command():
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs, "no configs shipped"
    for path in configs:
        cfg = load_config(path)
        assert cfg.experiment
        assert path.read_text().splitlines()[0].startswith("# coevo "), f"{path} must open with its command"


def test_overrides_are_typed_and_change_the_hash():
    base = load_config(REPO / "configs/arith.yaml")
    cfg = load_config(REPO / "configs/arith.yaml", ["rounds=2", "train_policy.steps=7", "curriculum.low=0.1"])
    assert (cfg.rounds, cfg.train_policy.steps, cfg.curriculum.low) == (2, 7, 0.1)
    assert cfg.config_hash() != base.config_hash()
    assert load_config(REPO / "configs/arith.yaml").config_hash() == base.config_hash()


def test_an_experiment_continues_with_more_rounds_and_nothing_else(tmp_path):
    """Resuming with a different config is refused, except `rounds` raised: then the store takes it."""
    from components.store import Store, StoreError

    store = Store(tmp_path / "s.duckdb")
    base = load_config(REPO / "configs/arith.yaml", ["rounds=2"])
    more = load_config(REPO / "configs/arith.yaml", ["rounds=4"])
    stored = base.model_dump_json()
    assert more.extends(stored) and not base.extends(stored)
    assert not load_config(REPO / "configs/arith.yaml", ["rounds=1"]).extends(stored)
    assert not load_config(REPO / "configs/arith.yaml", ["rounds=4", "seed=3"]).extends(stored)

    def register(cfg):
        return store.register_experiment(cfg.experiment, cfg.model_dump_json(), cfg.config_hash(), cfg.seed,
                                         cfg.recipe, None, extends=cfg.extends)

    def row():
        return store.rows("SELECT config_hash, config_json FROM experiments")[0]

    assert register(base) is False and register(base) is False
    assert register(more) is True
    assert row()["config_hash"] == more.config_hash() and json.loads(row()["config_json"])["rounds"] == 4
    assert register(more) is False  # now the stored config
    for other in (base, load_config(REPO / "configs/arith.yaml", ["rounds=6", "train_policy.steps=7"])):
        with pytest.raises(StoreError, match=r"raise only `rounds`"):
            register(other)
    assert row()["config_hash"] == more.config_hash()


def test_an_experiment_stored_before_a_field_existed_resumes(tmp_path):
    """A config stored by an older coevo lacks the fields added since: read today they take their defaults,
    so the experiment resumes (and the stored row is brought up to date) unless a new field is set otherwise."""
    from components.store import Store

    store = Store(tmp_path / "s.duckdb")
    cfg = load_config(REPO / "configs/arith.yaml", ["rounds=2"])
    old = cfg.to_dict()
    for field in ("head", "lm_weight"):  # added to train_reward after experiments were stored without them
        del old["train_reward"][field]
    old_json = json.dumps(old)
    assert cfg.config_hash() != hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    assert cfg.extends(old_json)
    assert not load_config(REPO / "configs/arith.yaml", ["rounds=2", "train_reward.head=likelihood"]).extends(old_json)
    assert not load_config(REPO / "configs/arith.yaml", ["rounds=1"]).extends(old_json)
    old["train_reward"]["no_such_field"] = 1
    assert not cfg.extends(json.dumps(old))  # a field this coevo does not know: refused, not dropped

    store.register_experiment(cfg.experiment, old_json, "oldhash", cfg.seed, cfg.recipe, None)
    assert store.register_experiment(cfg.experiment, cfg.model_dump_json(), cfg.config_hash(), cfg.seed,
                                     cfg.recipe, None, extends=cfg.extends) is True
    row = store.rows("SELECT config_hash, config_json FROM experiments")[0]
    assert row["config_hash"] == cfg.config_hash() and json.loads(row["config_json"])["train_reward"]["head"] == "classifier"


def test_hash_ignores_key_order():
    a = load_config_dict({"experiment": "x", "seed": 1, "rounds": 2})
    b = load_config_dict({"rounds": 2, "seed": 1, "experiment": "x"})
    assert a.config_hash() == b.config_hash()


def test_unknown_key_names_the_path():
    with pytest.raises(ConfigError, match=r"train_policy\.stepz: unknown key"):
        load_config_dict({"experiment": "x", "train_policy": {"stepz": 3}})


def test_wrong_type_names_the_path_and_value():
    with pytest.raises(ConfigError, match=r"generate\.temperature: .*number.*'hot'"):
        load_config_dict({"experiment": "x", "generate": {"temperature": "hot"}})


def test_incompatible_settings_say_what_to_change():
    with pytest.raises(ConfigError, match="set train_reward.enabled=true"):
        load_config_dict({"experiment": "x", "score": {"reward_model": "prm"}})
    with pytest.raises(ConfigError, match="curriculum.low"):
        load_config_dict({"experiment": "x", "curriculum": {"low": 0.9, "high": 0.5}})


@pytest.mark.parametrize("data, fix", [
    ({"recipe": "coevo"}, "set train_reward.enabled=true"),
    ({"recipe": "rft", "train_reward": {"enabled": True}, "score": {"mc_rollouts": 4}}, "set recipe=coevo"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}}, "set score.mc_rollouts >= 1"),
    ({"train_policy": {"method": "dpo"}}, "set filter.dpo_pairs=true"),
    ({"evaluate": {"best_of_n": [4]}}, "best_of_n=\\[\\]"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}, "score": {"mc_rollouts": 4, "reward_model": "orm"}},
     "set train_reward.orm=true"),
    ({"recipe": "coevo", "train_reward": {"enabled": True, "label_source": "mc_soft"},
      "score": {"mc_rollouts": 4, "mc_strategy": "first_error"}}, "set train_reward.label_source=mc_hard"),
    ({"score": {"mc_search_unsolved": True}}, "set score.mc_strategy=first_error"),
    ({"generate": {"search": {"max_tries": 2}}}, "generate.search is guided by the previous round's PRM"),
    ({"generate": {"search": {"max_tries": 0}}}, "generate.search.max_tries"),
    ({"filter": {"step_dpo_pairs": True}, "train_policy": {"method": "sft+dpo"}}, "set score.mc_strategy=first_error"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}, "filter": {"step_dpo_pairs": True},
      "score": {"mc_rollouts": 4, "mc_strategy": "first_error"}}, "set train_policy.method=sft\\+dpo"),
    ({"generate": {"search": {"redraw_temperature": -1}}}, "generate.search.redraw_temperature"),
    # The judge that never judged its own training data (issue 29, item 6).
    ({"filter": {"judge": "round", "min_step_score": 0.5}}, "filter.judge=round: this round's PRM judges its right "
                                                          "answers, which train_reward trains in the round"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}, "score": {"mc_rollouts": 4}, "filter": {"judge": "round"}},
     "against filter.min_step_score: set it"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}, "score": {"mc_rollouts": 4, "reward_model": "implicit"},
      "filter": {"judge": "round_and_previous", "min_step_score": 0.5}},
     "filter.judge=round_and_previous: this round's PRM judges its right answers, with the previous round's as a "
     "second opinion, which the score stage runs as score.reward_model=prm"),
    ({"filter": {"judge_max_drop": 0.3}}, "filter.judge_max_drop caps the share of right answers "
                                          "filter.min_step_score drops: set filter.min_step_score too"),
    ({"filter": {"min_step_score": 0.5, "judge_max_drop": 1.0}}, "filter.judge_max_drop: Input should be less than 1"),
    ({"filter": {"min_step_score": 0.5}}, "filter.min_step_score=0.5 drops right answers by their weakest step, "
                                         "and score.reward_model=none scores no steps"),
    ({"score": {"confidence_model": "judge/model"}}, "score.reward_model='none' does not read it: set "
                                                    "score.reward_model=confidence"),
    # MCTS (issue 30): each refusal names the setting.
    ({"generate": {"mcts": {"expansions": 0}}}, "generate.mcts.expansions: Input should be greater than or equal to 1"),
    ({"generate": {"mcts": {"simulations": 0}}}, "generate.mcts.simulations: Input should be greater than or equal"),
    ({"generate": {"mcts": {"token_budget": 100}}}, r"generate.mcts.token_budget \(100\) is less than one expansion "
                                                    r"\(expansions x max_step_tokens = 4 x 32 = 128\)"),
    ({"generate": {"mcts": {"rollouts": 0}}}, "generate.mcts has no value source: value=rollouts and rollouts=0"),
    ({"generate": {"mcts": {"value": "prm", "rollouts": 0}}}, "no value source: round 1 has no PRM yet"),
    ({"generate": {"mcts": {"value": "prm"}}}, "generate.mcts.value=prm values prefixes with the previous round's PRM"),
    ({"generate": {"mcts": {}, "until_correct": 1}}, "generate.mcts is a sampler of its own: set "
                                                    "generate.until_correct=null"),
    ({"evaluate": {"search": {}}}, "evaluate.search guides beam search and MCTS with the round's PRM"),
    ({"evaluate": {"search": {"budgets": [4, 0]}}}, r"evaluate.search.budgets must be distinct integers >= 1"),
    ({"evaluate": {"search": {"expansions": 0}}}, "evaluate.search.expansions: Input should be greater than or"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}, "score": {"mc_rollouts": 4},
      "evaluate": {"levels": [1, 2], "search": {"level": 3}}}, r"evaluate.search.level=3 is not among "
                                                               r"evaluate.levels=\[1, 2\]"),
    # Labels and pairs from the MCTS tree.
    ({"score": {"tree": {}}}, "score.tree labels steps from an MCTS tree: set generate.mcts .*, or score.tree.search"),
    ({"generate": {"mcts": {}}, "score": {"tree": {"search": {}}}}, "generate.mcts already grows this round's: set "
                                                                    "score.tree.search=null"),
    ({"score": {"tree": {"search": {"expansions": 0}}}}, "score.tree.search.expansions: Input should be greater"),
    ({"score": {"tree": {"search": {"rollouts": 0}}}}, "score.tree.search has no value source: value=rollouts and "
                                                       "rollouts=0; set score.tree.search.rollouts >= 1"),
    ({"score": {"tree": {"search": {"token_budget": 10}}}}, r"score.tree.search.token_budget \(10\) is less than one "
                                                            "expansion"),
    ({"score": {"tree": {"search": {"value": "prm"}}}}, "score.tree.search.value=prm values prefixes with the previous "
                                                        "round's PRM"),
    ({"recipe": "grpo", "generate": {"samples_per_problem": 4}, "train_policy": {"method": "grpo"},
      "score": {"tree": {"search": {}}}}, "does not use score.tree"),
    ({"score": {"tree": {"pair_margin": 1.5}}, "generate": {"mcts": {}}}, "score.tree.pair_margin: Input should be "
                                                                          "less than or equal to 1"),
    ({"recipe": "coevo", "train_reward": {"enabled": True, "label_source": "tree_hard"}, "generate": {"mcts": {}}},
     r"train_reward.label_source=tree_hard trains on the MCTS tree's labels: set score.tree"),
    ({"recipe": "coevo", "train_reward": {"enabled": True}, "generate": {"mcts": {}}, "score": {"tree": {}}},
     "train_reward.label_source=mc_hard needs Monte Carlo step labels to train on: set score.mc_rollouts >= 1 "
     r"\(or score.tree, with generate.mcts or score.tree.search, and label_source tree_hard or tree_soft\)"),
])
def test_coevo_settings_that_cannot_work_say_what_to_change(data, fix):
    with pytest.raises(ConfigError, match=fix):
        load_config_dict({"experiment": "x", **data})


def test_an_mcts_round_can_train_the_prm_and_dpo_on_its_tree_alone():
    cfg = load_config_dict({"experiment": "x", "recipe": "coevo", "generate": {"mcts": {}},
                            "score": {"tree": {"pair_margin": 0.5}},
                            "train_reward": {"enabled": True, "label_source": "tree_soft"},
                            "filter": {"step_dpo_pairs": True}, "train_policy": {"method": "sft+dpo"}})
    assert cfg.score.mc_rollouts == 0 and cfg.score.tree.pair_margin == 0.5 and cfg.score.tree.min_visits == 1
    # A round that samples without MCTS grows its trees in score.
    cfg = load_config_dict({"experiment": "x", "recipe": "coevo", "score": {"tree": {"search": {"simulations": 4}}},
                            "train_reward": {"enabled": True, "label_source": "tree_hard"}})
    assert cfg.generate.mcts is None and cfg.score.tree.search.simulations == 4 and cfg.score.tree.search.rollouts == 2
    # An unset section leaves the config hash as it was before the setting existed.
    assert "tree" not in load_config_dict({"experiment": "x"}).model_dump()["score"]
    assert "search" not in load_config_dict({"experiment": "x", "generate": {"mcts": {}}, "score": {"tree": {}}}
                                            ).model_dump()["score"]["tree"]


def test_the_implicit_prm_needs_no_reward_model_training():
    cfg = load_config_dict({"experiment": "x", "score": {"reward_model": "implicit"}, "evaluate": {"best_of_n": [4]}})
    assert cfg.recipe == "rft" and not cfg.train_reward.enabled and cfg.score.implicit_beta == 0.05


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment: x\ngenerate:\n  temperature: [0.8\n")
    with pytest.raises(ConfigError, match=r"malformed YAML in .*bad\.yaml at line \d+"):
        load_config(bad)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(REPO / "configs/arith.yaml", ["rounds"])


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")


@pytest.mark.parametrize("setting, value", [("hindsight", True), ("max_per_value", 4), ("variants", 2)])
def test_settings_that_read_code_tasks_are_for_an_environment_that_can_and_for_sft(setting, value):
    code = {"experiment": "x", "domain": {"name": "code"}, "policy": {"model": "m", "prompt_format": "chat"}}
    on = {"filter": {setting: value}}
    assert getattr(load_config_dict(code | on).filter, setting) == value
    assert setting not in load_config_dict(code).to_dict()["filter"]  # off: stored configs hash as before
    with pytest.raises(ConfigError, match=f"filter.{setting} .* and 'sql' cannot name them"):
        load_config_dict(code | {"domain": {"name": "sql"}} | on)
    with pytest.raises(ConfigError, match=f"filter.{setting} .* an environment's .* domain.name='arith' is not one"):
        load_config_dict({"experiment": "x"} | on)
    with pytest.raises(ConfigError, match=f"train_policy.method='grpo' does not .*filter.{setting}="):
        load_config_dict(code | on | {"recipe": "grpo", "train_policy": {"method": "grpo"}})


def test_an_agent_environment_refuses_what_its_loop_does_not_do_naming_the_settings():
    base = {"experiment": "x", "domain": {"name": "sql"}, "policy": {"model": "m", "prompt_format": "chat"}}
    assert load_config_dict(base).domain.name == "sql"
    with pytest.raises(ConfigError, match="sql.*is an agent environment.*policy.prompt_format=chat"):
        load_config_dict(base | {"policy": {"model": "m"}})
    coevo = {"recipe": "coevo", "score": {"reward_model": "prm", "mc_rollouts": 2}, "train_reward": {"enabled": True}}
    assert load_config_dict(base | coevo).train_reward.enabled  # a PRM on episodes: its turns are its steps
    assert load_config_dict(base | coevo | {"evaluate": {"best_of_n": [4]}}).evaluate.best_of_n == [4]
    implicit = {"score": {"reward_model": "implicit"}, "evaluate": {"best_of_n": [2]}}
    assert load_config_dict(base | implicit).score.reward_model == "implicit"  # the log-ratio over each turn's ids
    assert load_config_dict(base | {"score": {"reward_model": "env"}}).score.reward_model == "env"
    with pytest.raises(ConfigError, match="reward_model='env' reads the turn rewards an environment gives; "
                                          "domain.name='arith' is a text domain"):
        load_config_dict({"experiment": "x", "score": {"reward_model": "env"}})
    orm = {"score": {"reward_model": "orm", "mc_rollouts": 2}, "train_reward": {"enabled": True, "orm": True}}
    assert load_config_dict(base | coevo | orm).train_reward.orm  # the ORM reads an episode's transcript
    guided = {"generate": {"search": {"max_tries": 2}}}  # each turn drawn until the previous round's PRM accepts it
    assert load_config_dict(base | coevo | guided).generate.search.max_tries == 2
    waves = {"generate": {"until_correct": 1, "samples_per_problem": 4, "wave_size": 2}}  # episodes in waves
    assert load_config_dict(base | waves).generate.until_correct == 1
    assert load_config_dict(base | coevo | {"generate": waves["generate"] | guided["generate"]}).generate.search
    # MCTS over turns, valued by rollouts or by the previous round's PRM
    assert load_config_dict(base | {"generate": {"mcts": {"simulations": 4}}}).generate.mcts.simulations == 4
    assert load_config_dict(base | coevo | {"generate": {"mcts": {"value": "prm"}}}).generate.mcts.value == "prm"
    tree = {"generate": {"mcts": {}}, "score": {"tree": {"pair_margin": 0.25}}}
    assert load_config_dict(base | tree).score.tree.pair_margin == 0.25  # labels from generate's turn trees
    grown = {"score": {"tree": {"search": {"simulations": 4}}}}  # trees grown in score around sampled episodes
    assert load_config_dict(base | grown).score.tree.search.simulations == 4
    # The environment's step checker reads each episode's turns (check_episode).
    assert load_config_dict(base | {"filter": {"check_steps": True}}).filter.check_steps
    with pytest.raises(ConfigError, match=r"does not support score.reward_model=tests.toys:Judge yet"):
        load_config_dict(base | {"score": {"reward_model": "tests.toys:Judge"}})
    # Monte Carlo turn labels, at every turn or by binary search, and grpo's step credit on them.
    grpo = {"recipe": "grpo", "train_policy": {"method": "grpo", "grpo": {"credit": "step", "shaping_weight": 0.5}}}
    assert load_config_dict(base | grpo | {"score": {"mc_rollouts": 2}}).score.mc_rollouts == 2
    first_error = {"score": {"mc_rollouts": 2, "mc_strategy": "first_error"}}
    assert load_config_dict(base | first_error).score.mc_strategy == "first_error"
    # DPO pairs two episodes of a problem, and step pairs two episodes of a turn tree that part at sibling turns;
    # Monte Carlo turn labels keep no continuation to pair with.
    dpo = {"filter": {"dpo_pairs": True}, "train_policy": {"method": "sft+dpo"}}
    assert load_config_dict(base | dpo).train_policy.method == "sft+dpo"
    steps = {"filter": {"dpo_pairs": True, "step_dpo_pairs": True}}
    assert load_config_dict(base | dpo | steps | tree).filter.step_dpo_pairs
    with pytest.raises(ConfigError, match=r"takes an environment's pairs from its turn trees.*set score.tree \(with "
                                          "generate.mcts or score.tree.search"):
        load_config_dict(base | dpo | steps | first_error)
