"""recipe grpo's pieces: group advantages, the config's refusals, and TRL's GRPO loss on stored rollouts.

    .venv/bin/python -m pytest tests/unit/test_grpo.py -q

The trainer runs on a real tiny model, on rollouts sampled from it: the test measures, with its own forward
pass, that the update raised the log-probability of the rollouts with positive advantages against the ones
with negative advantages, and that the advantages TRL trained on are the stored ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from components.config import load_config, load_config_dict
from components.domains.arith import ArithDomain
from components.models.backends import HFBackend
from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from components.rl.advantages import group_advantages
from components.training.grpo import GRPOParams, check_rollouts, train_grpo

DOMAIN = ArithDomain()
SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192)
GRPO = {"recipe": "grpo", "train_policy": {"method": "grpo"}, "generate": {"samples_per_problem": 4, "top_p": 1.0}}


def _cfg(**sections):
    body = {"experiment": "g", **GRPO}
    for k, v in sections.items():
        body[k] = body.get(k, {}) | v if isinstance(v, dict) else v
    return load_config_dict(body)


def test_micro_grpo_config_loads(repo):
    cfg = load_config(repo / "configs" / "micro-grpo.yaml")
    assert cfg.recipe == "grpo" and cfg.train_policy.method == "grpo" and cfg.generate.samples_per_problem == 8


@pytest.mark.parametrize("sections, says", [
    ({"generate": {"samples_per_problem": 1}}, "generate.samples_per_problem >= 2"),
    ({"train_policy": {"method": "grpo", "grpo": {"beta": 0.04}}}, "train_policy.grpo.reference"),
    ({"generate": {"samples_per_problem": 4, "top_p": 0.9}}, "generate.top_p=1.0"),
    ({"train_policy": {"method": "grpo", "init": "base"}}, "train_policy.init=previous"),
    ({"recipe": "rft"}, "set recipe=grpo"),
    ({"train_policy": {"method": "sft"}}, "train_policy.method=grpo"),
    ({"train_policy": {"method": "grpo", "grpo": {"shaping_weight": 0.5}}}, "score.reward_model=implicit"),
    ({"train_policy": {"method": "grpo", "grpo": {"credit": "step"}}}, "train_policy.grpo.shaping_weight > 0"),
    ({"train_policy": {"method": "grpo", "grpo": {"credit": "step", "shaping_weight": 0.5}}},
     "credit=step with score.mc_rollouts > 0"),
    ({"train_policy": {"method": "grpo", "grpo": {"credit": "step", "shaping_weight": 0.5}},
      "score": {"reward_model": "orm", "mc_rollouts": 2}, "train_reward": {"enabled": True, "orm": True}},
     "an ORM scores whole rollouts"),
    ({"train_policy": {"method": "grpo", "grpo": {"ptx_weight": -1}}}, "train_policy.grpo.ptx_weight: Input should be "
                                                                       "greater than or equal to 0"),
    ({"train_policy": {"method": "grpo", "grpo": {"ptx_pool": "right_answers"}}},
     "train_policy.grpo.ptx_pool=right_answers trains on nothing at ptx_weight=0"),
    ({"filter": {"min_step_score": 0.5}, "score": {"reward_model": "implicit"}},
     "ptx_pool=demonstrations imitates none"),
    ({"filter": {"min_step_score": 0.5},
      "train_policy": {"method": "grpo", "grpo": {"ptx_weight": 1, "ptx_pool": "right_answers"}}},
     "score.reward_model=none scores no steps"),
    ({"train_policy": {"method": "grpo", "grpo": {"unsound_reward": "outcome"}}},
     "filter.check_steps=false checks nothing"),
    ({"filter": {"check_steps": True}, "train_policy": {"method": "grpo", "grpo": {"unsound_reward": "outcome"}}},
     "ptx_pool=demonstrations imitates no right answer"),
])
def test_config_refuses_what_grpo_cannot_train(sections, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.").replace("(", r"\(")):
        _cfg(**sections)


def test_rfts_settings_that_grpo_never_reads_are_named(repo):
    """A grpo config keeps rft's settings where an override switched its recipe; the flow warns of those moved from
    their defaults, each with what grpo reads instead, and of nothing in the micro grpo config."""
    from components.recipes import get_recipe

    assert get_recipe("grpo").unused(load_config(repo / "configs" / "micro-grpo.yaml")) == []
    cfg = _cfg(train_policy={"method": "grpo", "learning_rate": 1e-5}, filter={"drop_mc_bad_steps": True,
                                                                              "dedup": True})
    assert get_recipe("grpo").unused(cfg) == ["train_policy.learning_rate=1e-05 (grpo reads "
                                              "train_policy.grpo.learning_rate)", "filter.drop_mc_bad_steps=True"]
    assert get_recipe("rft").unused(cfg) == []
    # and the other way: rft and coevo name grpo's own settings
    rft = load_config(repo / "configs" / "micro.yaml", ["train_policy.grpo.learning_rate=1e-4"])
    assert get_recipe("rft").unused(rft) == ["train_policy.grpo.learning_rate=0.0001 (recipe grpo reads it)"]
    assert get_recipe("coevo").unused(rft) == get_recipe("rft").unused(rft)
    assert get_recipe("rft").unused(load_config(repo / "configs" / "micro.yaml")) == []


def test_beta_with_a_reference_loads():
    cfg = _cfg(train_policy={"method": "grpo", "grpo": {"beta": 0.04, "reference": "initial"}})
    assert cfg.train_policy.grpo.beta == 0.04


def test_a_trained_prm_shapes_each_step_and_trains_in_the_round():
    """With train_reward.enabled, grpo's rounds train a PRM on their Monte Carlo labels (after score, before the
    filter), which scores the next round's steps; without it, the stage is not in the round."""
    from components.recipes import get_recipe

    cfg = _cfg(score={"reward_model": "prm", "mc_rollouts": 2}, train_reward={"enabled": True},
               train_policy={"method": "grpo", "grpo": {"credit": "step", "shaping_weight": 0.5}})
    grpo = get_recipe("grpo")
    assert grpo.round_stages(1, cfg) == ["generate", "verify", "score", "train_reward", "filter", "train_policy",
                                         "evaluate"]
    assert "train_reward" not in grpo.round_stages(1, _cfg())
    assert "train_reward" in grpo.round_stages(1)  # every stage the recipe can run, for the forms
    # Monte Carlo values alone (no reward model) may shape steps, never the whole rollout
    mc = _cfg(score={"mc_rollouts": 2}, train_policy={"method": "grpo", "grpo": {"credit": "step", "shaping_weight": 1}})
    assert mc.train_policy.grpo.credit == "step" and "credit" in mc.to_dict()["train_policy"]["grpo"]


def test_step_credit_follows_deepseekmath_process_supervision():
    """Each step's reward is normalised over every step reward in its group; a token's advantage is its rollout's
    plus the weight times the normalised rewards of its step and the steps after it. A group whose outcomes are
    all equal trains where its step rewards differ."""
    from components.rl.advantages import process_varied_groups, step_advantages

    rollouts = [{"trajectory_id": t, "group_id": g, "outcome": o}
                for t, g, o in (("a", "p", 1.0), ("b", "p", 0.0), ("c", "q", 0.0), ("d", "q", 0.0), ("e", "r", 0.0),
                                ("f", "r", 0.0))]
    process = {"a": [0.9, 0.8], "b": [0.9, 0.1], "c": [0.6, 0.2], "d": [0.6], "e": [0.5], "f": [0.5]}
    varied = process_varied_groups(rollouts, process)
    assert varied == {"p", "q"}
    rows = group_advantages(rollouts, process_varied=varied)
    kept = {r["group_id"]: (r["kept"], r["reason"]) for r in rows}
    assert kept == {"p": (True, "rewards differ"), "q": (True, "process rewards differ"),
                    "r": (False, "every reward is 0: no signal")}
    steps = {(r["trajectory_id"], r["turn_index"]): r for r in step_advantages(rows, process, 0.5)}
    q = [0.6, 0.2, 0.6]
    mean, std = sum(q) / 3, math.sqrt(sum((v - sum(q) / 3) ** 2 for v in q) / 2)
    z = {k: (v - mean) / (std + 1e-4) for k, v in (("c0", 0.6), ("c1", 0.2))}
    assert steps[("c", 1)]["process_return"] == pytest.approx(z["c1"])
    assert steps[("c", 0)]["process_return"] == pytest.approx(z["c0"] + z["c1"])
    assert steps[("c", 0)]["advantage"] == pytest.approx(0 + 0.5 * (z["c0"] + z["c1"]))
    assert steps[("c", 0)]["process"] == 0.6 and steps[("a", 1)]["advantage"] > steps[("b", 1)]["advantage"]
    assert all(steps[("e", 0)][k] == 0 for k in ("process_return", "advantage"))  # equal step rewards: no signal
    with pytest.raises(ValueError, match=r"rollout a: a step reward is nan"):
        step_advantages(rows, {"a": [float("nan")]}, 0.5)


def test_step_advantages_land_on_the_tokens_that_spell_each_step(tmp_path):
    """On a real byte-level BPE tokenizer, from ids as a model would sample them: every token of a step carries that
    step's advantage, a token that joins a step's newline to the next step's text carries the next's, and the
    EOS the last step's."""
    from components.models.standin import SIZES, domain_texts, train_tokenizer
    from components.training.grpo import step_token_advantages

    tok = train_tokenizer(domain_texts("arith", n_per_level=60), SIZES["tiny"])
    completion = "7 + 5 = 12\n12 * 3 = 36\n#### 36"
    ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    steps = DOMAIN.split_steps(completion)
    assert len(steps) == 3
    adv = step_token_advantages(lambda x: tok.decode(x, skip_special_tokens=True), ids, steps, [1.0, -1.0, 0.5])
    assert len(adv) == len(ids) and adv[-1] == 0.5
    spans = [range(completion.index(s), completion.index(s) + len(s)) for s in steps]
    before = ""
    for i, a in enumerate(adv[:-1]):
        text = tok.decode(ids[:i + 1], skip_special_tokens=True)
        k = [1.0, -1.0, 0.5].index(a)
        # every visible character this token adds lies in the text of the step whose advantage it carries
        assert all(j in spans[k] for j in range(len(before), len(text)) if not text[j].isspace()), (i, text)
        before = text
    assert before == completion and adv.count(1.0) > 1 and adv.count(-1.0) > 1
    with pytest.raises(ValueError, match=r"step 1 \('9 \* 3 = 27'\) is not in the text"):
        step_token_advantages(lambda x: tok.decode(x, skip_special_tokens=True), ids, ["7 + 5 = 12", "9 * 3 = 27",
                                                                                       "#### 36"], [0.0] * 3)


def test_a_config_without_grpo_hashes_as_before():
    """The grpo section and filter.max_groups are left out of the config's content at their defaults."""
    cfg = load_config_dict({"experiment": "x"})
    assert "grpo" not in cfg.to_dict()["train_policy"] and "max_groups" not in cfg.to_dict()["filter"]


def test_advantages_follow_trl_and_refuse_bad_rewards():
    rows = [{"trajectory_id": f"{g}{i}", "group_id": g, "outcome": r}
            for g, rewards in (("a", [1, 0, 0, 0]), ("b", [1, 1, 1, 1]), ("c", [0, 1, 1, 0])) for i, r in enumerate(rewards)]
    out = {r["trajectory_id"]: r for r in group_advantages(rows)}
    std = math.sqrt(0.25 * 4 / 3 * 0.75)  # sample std of [1, 0, 0, 0]
    assert out["a0"]["advantage"] == pytest.approx(0.75 / (std + 1e-4))
    assert out["b0"]["advantage"] == 0 and not out["b0"]["kept"] and "no signal" in out["b0"]["reason"]
    assert out["a0"]["group_mean"] == 0.25 and out["a0"]["group_size"] == 4
    none = {r["trajectory_id"]: r["advantage"] for r in group_advantages(rows, scale="none")}
    assert none["a0"] == 0.75 and none["c0"] == -0.5
    capped = group_advantages(rows, max_groups=1, seed=3)
    assert sum(r["kept"] for r in capped) == 4 and any("max_groups=1" in r["reason"] for r in capped)
    with pytest.raises(ValueError, match=r"rollout a1: its outcome reward is nan"):
        group_advantages([rows[0], {**rows[1], "outcome": float("nan")}])


def test_rollouts_are_checked_by_name():
    r = {"group_id": "g", "prompt_ids": [1], "completion_ids": [2, 3], "reward": 1.0, "advantage": 0.5}
    with pytest.raises(ValueError, match="group g has 1 rollouts, expected num_generations=2"):
        check_rollouts([r | {"trajectory_id": "a"}], 2)
    with pytest.raises(ValueError, match="rollout a has 3 advantages for 2 completion tokens"):
        check_rollouts([r | {"trajectory_id": "a", "advantage": [1.0, 1.0, 1.0]}], 1)
    with pytest.raises(ValueError, match=r"rollout a is missing \['reward'\]"):
        check_rollouts([{k: v for k, v in r.items() if k != "reward"} | {"trajectory_id": "a"}], 1)
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        GRPOParams(num_generations=1)


def _sampled(init: str, problems: int, n: int) -> list[tuple[dict, int]]:
    """n rollouts per problem (arith level 2) sampled from the model at `init`, each with its index in its group."""
    backend = HFBackend(init, batch_size=64, progress=False)
    chosen = DOMAIN.sample_problems(2, problems, seed=0)
    prompt_ids = backend.prompts.encode([p.prompt for p in chosen])
    samples = backend.generate_ids(prompt_ids, n=n, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0)
    return [({"trajectory_id": f"{p.problem_id}-{j}", "group_id": p.problem_id, "prompt_ids": ids,
              "completion_ids": list(s.token_ids)}, j)
            for p, ids, group in zip(chosen, prompt_ids, samples, strict=True) for j, s in enumerate(group)]


def test_trl_trains_on_the_stored_advantages(tmp_path, one_torch_thread):
    """Rollouts sampled from a tiny model, half of each group rewarded (by their index, so that each group has a
    signal): after the update, the rollouts with positive advantages gained log-probability against the others,
    and TRL's advantages equal the stored ones."""
    init = str(create_tiny_llama(SMALL, tmp_path / "init", seed=0))
    rollouts = [r | {"outcome": float(j % 2 == 0)} for r, j in _sampled(init, 8, 4)]
    adv = {a["trajectory_id"]: a for a in group_advantages(rollouts)}
    for r in rollouts:
        r |= {"reward": adv[r["trajectory_id"]]["reward"], "advantage": adv[r["trajectory_id"]]["advantage"]}
    metrics, rows = train_grpo(init, None, rollouts, str(tmp_path / "out"),
                               GRPOParams(num_generations=4, groups_per_step=2, num_iterations=2, learning_rate=3e-3,
                                          use_cpu=True))
    assert metrics["steps"] == 8 and metrics["rollouts"] == 32 and metrics["groups"] == 8
    assert metrics["advantage_gap"] < 1e-5
    assert metrics["staleness_max"] == 7 and metrics["staleness_mean"] == 3.5
    assert 0 <= metrics["clip_ratio"] <= 1 and metrics["entropy"] > 0
    moved = {r["trajectory_id"]: (r["new_logprob"] - r["old_logprob"]) / r["tokens"] for r in rows}
    up = [moved[t] for t, a in adv.items() if a["advantage"] > 0]
    down = [moved[t] for t, a in adv.items() if a["advantage"] < 0]
    gap = sum(up) / len(up) - sum(down) / len(down)
    print(f"log-probability per token: positive advantages {sum(up) / len(up):+.3f}, negative {sum(down) / len(down):+.3f}")
    assert gap > 0.05, (up, down)
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_beta_pulls_towards_the_reference_it_names(tmp_path, one_torch_thread):
    """beta > 0: TRL's KL is measured against the reference given. The policy as its own reference starts at KL 0;
    another model (a different random init) is far from it."""
    init = str(create_tiny_llama(SMALL, tmp_path / "init", seed=0))
    other = str(create_tiny_llama(SMALL, tmp_path / "other", seed=1))
    rollouts = [r | {"reward": float(j % 2), "advantage": 1.0 if j % 2 else -1.0} for r, j in _sampled(init, 4, 4)]
    kl = {}
    for name, ref in (("self", init), ("other", other)):
        metrics, _ = train_grpo(init, ref, rollouts, str(tmp_path / name),
                                GRPOParams(num_generations=4, groups_per_step=2, beta=0.04, learning_rate=1e-3,
                                           use_cpu=True))
        kl[name] = metrics["kl"]
    assert 0 <= kl["self"] < kl["other"] / 5, kl


def test_per_token_advantages_and_an_env_mask_train(tmp_path, one_torch_thread):
    """A (batch, tokens) advantage, as an episode whose turns differ gets, trains; the log-probabilities count the
    tokens the env_mask marks as sampled, and no others."""
    init = str(create_tiny_llama(SMALL, tmp_path / "init", seed=0))
    rollouts = []
    for r, j in _sampled(init, 2, 2):
        n = len(r["completion_ids"])
        mask = [1] * (n // 2) + [0] * (n - n // 2)  # the second half stands for an observation
        rollouts.append(r | {"env_mask": mask, "reward": float(j), "advantage": [1.0 if j else -1.0] * n})
    metrics, rows = train_grpo(init, None, rollouts, str(tmp_path / "out"),
                               GRPOParams(num_generations=2, groups_per_step=1, learning_rate=1e-3, use_cpu=True,
                                          lr_scheduler="cosine"))
    assert metrics["steps"] == 2 and math.isnan(metrics["advantage_gap"])  # no scalar advantage to compare
    # cosine over the round's 2 steps: the second trains at half the rate (and the schedule ends at 0 after it)
    assert metrics["final_learning_rate"] == pytest.approx(5e-4)
    assert [r["tokens"] for r in rows] == [sum(r["env_mask"]) for r in rollouts]


def test_ptx_adds_the_demonstrations_nll_and_nothing_else_moves_without_it(tmp_path, one_torch_thread):
    """PPO-ptx: with every advantage 0 the policy gradient is 0, so at ptx_weight 0 the weights stay as they were,
    and at ptx_weight 1 the demonstrations' NLL falls (its mean over the forward passes is reported) while the
    rollouts' log-probabilities move only through it."""
    from components.training.grpo import text_ptx_examples

    init = str(create_tiny_llama(SMALL, tmp_path / "init", seed=0))
    rollouts = [r | {"reward": float(j % 2), "advantage": 0.0} for r, j in _sampled(init, 4, 2)]
    demos = [{"prompt": p.prompt, "completion": DOMAIN.reference_solution(p)}
             for p in DOMAIN.sample_problems(1, 16, seed=3)]
    encoder = HFBackend(init, batch_size=16, progress=False).prompts
    ptx = text_ptx_examples(encoder, demos)
    assert all(e["labels"][-1] == encoder.eos_ids[0] and e["labels"][0] == -100 for e in ptx)

    def demo_nll(model_dir: str) -> float:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            return sum(m(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss.item()
                       for e in ptx) / len(ptx)

    params = dict(num_generations=2, groups_per_step=2, num_iterations=2, learning_rate=3e-3, use_cpu=True)
    off, rows_off = train_grpo(init, None, rollouts, str(tmp_path / "off"), GRPOParams(**params), ptx_examples=ptx)
    on, rows_on = train_grpo(init, None, rollouts, str(tmp_path / "on"),
                             GRPOParams(**params, ptx_weight=1.0, ptx_batch_size=4), ptx_examples=ptx)
    assert "ptx_loss" not in off and on["ptx_examples"] == 16 and on["steps"] == off["steps"] == 4
    assert all(r["new_logprob"] == pytest.approx(r["old_logprob"], abs=1e-4) for r in rows_off)
    before, after = demo_nll(init), demo_nll(str(tmp_path / "on"))
    print(f"demonstrations' NLL per token: {before:.3f} before, {after:.3f} after ptx (mean in training "
          f"{on['ptx_loss']:.3f})")
    assert demo_nll(str(tmp_path / "off")) == pytest.approx(before, abs=1e-4)
    assert after < before - 0.3 and after < on["ptx_loss"] < before + 1e-3
    with pytest.raises(ValueError, match="ptx_weight > 0 needs ptx examples"):
        train_grpo(init, None, rollouts, str(tmp_path / "none"), GRPOParams(**params, ptx_weight=1.0))
    with pytest.raises(ValueError, match="ptx_weight must be a finite number >= 0"):
        GRPOParams(num_generations=2, ptx_weight=float("nan"))
