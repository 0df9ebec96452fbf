"""Reward models on tiny from-scratch Llamas: PRM and ORM trained for real, the implicit PRM and the sampler's
confidence.

    .venv/bin/python -m pytest tests/unit/test_rewards.py -q

The backbone is random, so it cannot do arithmetic within a test's budget: the errors to find are
ones a few hundred steps can learn (malformed steps, missing answers). That still fails any
misplaced label, misread position or padding bug, which is what these tests are for.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from components.domains.arith import ArithDomain
from components.domains.base import Problem
from components.models.tiny import TinyLlamaConfig, create_tiny_llama, load_policy
from components.rewards.implicit import implicit_step_rewards
from components.rewards.orm import ORMParams, ORMScorer, train_orm
from components.rewards.prm import (INITIAL_CALIBRATION, PRMParams, PRMScorer, _likelihood_step_logits, _step_of_token,
                                    aggregate, prm_head, tokenize_steps, train_prm)

DOMAIN = ArithDomain()
SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192)


def _problems(seed: int, n: int) -> list[Problem]:
    return [p for level in (2, 3) for p in DOMAIN.sample_problems(level, n, seed)]


def _malformed(p: Problem, rng: random.Random) -> list[str]:
    """The gold steps with one step broken the way an undertrained policy breaks them."""
    steps = DOMAIN.split_steps(DOMAIN.reference_solution(p))
    k = rng.randrange(len(steps))
    steps[k] = rng.choice([steps[k].rpartition("=")[0] + "=", steps[k].replace("=", "==", 1), steps[k] + "+"])
    return steps


def _prm_examples(seed: int, n: int) -> list[dict]:
    rng, out = random.Random(seed), []
    for p in _problems(seed, n):
        for steps in (DOMAIN.split_steps(DOMAIN.reference_solution(p)), _malformed(p, rng)):
            out.append({"prompt": p.prompt, "completions": steps,
                        "labels": DOMAIN.oracle_step_labels(p, "\n".join(steps) + "\n")})
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small train as fast on one thread, and one thread does not collapse (7x measured)
    when other processes contend for the two cores, as two spinning OpenMP threads do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return str(create_tiny_llama(SMALL, tmp_path_factory.mktemp("backbone"), seed=0))


@pytest.fixture(scope="module")
def prm(backbone, tmp_path_factory):
    out = tmp_path_factory.mktemp("prm")
    metrics = train_prm(backbone, _prm_examples(0, 300), str(out), PRMParams(max_steps=150, batch_size=32,
                                                                              learning_rate=3e-3))
    return str(out), metrics


def test_prm_format_labels_the_separator_of_each_step(backbone):
    tok = load_policy(backbone)[1]
    ids, ends = tokenize_steps(tok, "3+4-2\n", ["3+4=7", "7-2=5", "#### 5"])
    assert tok.decode(ids) == "3+4-2\n3+4=7\n7-2=5\n#### 5\n"
    assert [tok.decode(ids[: e + 1]).splitlines()[-1] for e in ends] == ["3+4=7", "7-2=5", "#### 5"]
    assert all(tok.decode([ids[e]]) == "\n" for e in ends)


def test_prm_learns_step_labels(prm):
    path, metrics = prm
    assert metrics["steps"] == 150 and metrics["final_loss"] < metrics["first_loss"] / 4
    test = [e for e in _prm_examples(99, 40) if not all(e["labels"])]
    scores = PRMScorer(path).score_steps([e["prompt"] for e in test], [e["completions"] for e in test])
    assert [len(s) for s in scores] == [len(e["completions"]) for e in test]
    pairs = [(p < 0.5, not ok) for e, s in zip(test, scores) for p, ok in zip(s, e["labels"])]
    tp = sum(pred and bad for pred, bad in pairs)
    f1_bad = 2 * tp / (sum(pred for pred, _ in pairs) + sum(bad for _, bad in pairs))
    assert f1_bad >= 0.9, f"F1 on bad steps {f1_bad:.3f}"  # predicting "all good" scores 0, coin flips ~0.3


def test_prm_checkpoint_is_safetensors_only(prm):
    files = {p.name for p in Path(prm[0]).iterdir()}
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]


def test_prm_scores_do_not_depend_on_batching(prm):
    test = _prm_examples(7, 6)
    prompts, steps = [e["prompt"] for e in test], [e["completions"] for e in test]
    scorer = PRMScorer(prm[0])
    batched = scorer.score_steps(prompts + ["1+1\n"], steps + [[]], batch_size=16)
    assert batched[-1] == []
    for i, (p, s) in enumerate(zip(prompts, steps)):
        assert batched[i] == pytest.approx(scorer.score_steps([p], [s])[0], abs=1e-5)
    assert aggregate(batched[0])["min"] == min(batched[0])


def test_prm_warm_start_keeps_what_it_learned(prm, backbone, tmp_path):
    metrics = train_prm(backbone, _prm_examples(1, 20), str(tmp_path / "prm2"),
                        PRMParams(max_steps=2, batch_size=16, logging_steps=1, learning_rate=1e-4),
                        init_from_prm=prm[0])
    assert metrics["init"] == "prm" and metrics["first_loss"] < 0.1  # a fresh head starts near 0.4


def test_prm_unlabelled_steps_train_nothing(backbone, tmp_path):
    """A None label (first_error's unsearched steps) is -100: neither counted nor in the loss."""
    ex = _prm_examples(3, 4)
    partial = [e | {"labels": [None] * (len(e["labels"]) - 1) + [e["labels"][-1]]} for e in ex]
    kw = dict(max_steps=1, batch_size=len(ex), logging_steps=1, learning_rate=1e-9)
    m = train_prm(backbone, partial, str(tmp_path / "p"), PRMParams(**kw))
    assert m["labelled_steps"] == len(ex) and m["good_fraction"] == sum(e["labels"][-1] for e in ex) / len(ex)
    full = train_prm(backbone, ex, str(tmp_path / "f"), PRMParams(**kw))
    assert full["labelled_steps"] == sum(len(e["labels"]) for e in ex) and full["first_loss"] != m["first_loss"]


def _fact_examples(offsets: tuple[int, ...], seed: int) -> list[dict]:
    """Every level-1 fact as a right solution and a wrong one (the result off by one of `offsets`)."""
    rng, out = random.Random(seed), []
    for prompt, answer in sorted({(p.prompt, p.answer) for p in DOMAIN.sample_problems(1, 2000, 0)}):
        wrong = str(int(answer) + rng.choice(offsets))
        for result, ok in ((answer, True), (wrong, False)):
            out.append({"prompt": prompt, "completions": [f"{prompt.strip()}={result}", f"#### {result}"],
                        "labels": [ok, ok]})
    return out


@pytest.fixture(scope="module")
def likelihood_prm(backbone, tmp_path_factory):
    """A likelihood PRM trained on the level-1 facts with wrong results off by one: its LM loss learns the
    right results, which is what it must read to reject results off by 2 or 3 it never saw."""
    out = tmp_path_factory.mktemp("likelihood_prm")
    metrics = train_prm(backbone, _fact_examples((-1, 1), 0), str(out),
                        PRMParams(max_steps=600, batch_size=32, learning_rate=3e-3, head="likelihood", lm_weight=1.0))
    return str(out), metrics


def test_likelihood_step_score_is_the_least_likely_token_of_its_prefix():
    """Hand-computed: tokens 0..4 = prompt [0], step 0 = tokens 1-2, step 1 = tokens 3-4; token j's
    log-probability is read at position j-1; a step takes the minimum over its tokens and those before it."""
    ids = torch.tensor([[1, 2, 3, 2, 1], [1, 2, 3, 2, 1]])
    logits = torch.zeros(2, 5, 4)  # uniform: p = 1/4 everywhere, except where set below
    logits[:, 0, 2] = math.log(3 * 7)    # p(token 1 = 2) = 21/24 = 0.875
    logits[:, 1, 3] = math.log(3 * 1)    # p(token 2 = 3) = 3/6 = 0.5
    logits[:, 2, 2] = math.log(3 * 3)    # p(token 3 = 2) = 9/12 = 0.75
    logits[0, 3, 1] = math.log(3 * 7)    # row 0: p(token 4 = 1) = 0.875; row 1 keeps 0.25
    seg = torch.tensor([_step_of_token(1, [2, 4], 5)] * 2)
    assert seg[0].tolist() == [-1, 0, 0, 1, 1] and _step_of_token(1, [2, 4], 4) == [-1, 0, 0, 1]
    z = _likelihood_step_logits(torch.tensor([2.0, 1.0]), logits, ids, seg, n_steps=2)
    assert z[0].tolist() == pytest.approx([2 * math.log(0.5) + 1] * 2, abs=1e-5)  # step 1's own min is 0.75
    assert z[1].tolist() == pytest.approx([2 * math.log(0.5) + 1, 2 * math.log(0.25) + 1], abs=1e-5)


def test_likelihood_prm_rejects_wrong_results_it_never_saw(likelihood_prm):
    path, metrics = likelihood_prm
    assert metrics["steps"] == 600 and metrics["final_loss"] < metrics["first_loss"] / 10  # step BCE + LM loss
    test = _fact_examples((-3, -2, 2, 3), 1)
    scores = PRMScorer(path).score_steps([e["prompt"] for e in test], [e["completions"] for e in test])
    assert [len(s) for s in scores] == [len(e["completions"]) for e in test]
    pairs = [(p < 0.5, not ok) for e, s in zip(test, scores) for p, ok in zip(s, e["labels"])]
    tp = sum(pred and bad for pred, bad in pairs)
    f1_bad = 2 * tp / (sum(pred for pred, _ in pairs) + sum(bad for _, bad in pairs))
    assert f1_bad >= 0.9, f"F1 on bad steps {f1_bad:.3f}"  # all-bad scores 0.67, all-good 0


def test_likelihood_prm_is_a_causal_lm_checkpoint_with_its_calibration(likelihood_prm, prm):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path, metrics = likelihood_prm
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["prm_head"] == "likelihood" and prm_head(path) == "likelihood" and prm_head(prm[0]) == "classifier"
    assert config["prm_calibration"] == [metrics["calibration_scale"], metrics["calibration_bias"]]
    assert config["prm_calibration"] != list(INITIAL_CALIBRATION)  # learned, not left at the start
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "calibration" in k]
    assert not [p.name for p in Path(path).iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    AutoModelForCausalLM.from_pretrained(path)  # loads as the plain LM it is


def test_likelihood_prm_scores_do_not_depend_on_batching(likelihood_prm):
    test = _prm_examples(7, 6)  # 2 to 4 steps each: rows of a batch with fewer steps than others
    prompts, steps = [e["prompt"] for e in test], [e["completions"] for e in test]
    scorer = PRMScorer(likelihood_prm[0])
    batched = scorer.score_steps(prompts + ["1+1\n"], steps + [[]], batch_size=16)
    assert batched[-1] == [] and [len(b) for b in batched[:-1]] == [len(s) for s in steps]
    for i, (p, s) in enumerate(zip(prompts, steps)):
        assert batched[i] == pytest.approx(scorer.score_steps([p], [s])[0], abs=1e-5)


def test_likelihood_prm_warm_start_and_head_mismatch(likelihood_prm, prm, backbone, tmp_path):
    metrics = train_prm(backbone, _prm_examples(1, 20), str(tmp_path / "again"),
                        PRMParams(max_steps=2, batch_size=16, logging_steps=1, learning_rate=1e-5, head="likelihood"),
                        init_from_prm=likelihood_prm[0])
    assert metrics["init"] == "prm" and metrics["calibration_scale"] == pytest.approx(
        likelihood_prm[1]["calibration_scale"], abs=1e-3)  # starts from the stored calibration
    with pytest.raises(ValueError, match=r"is a 'classifier' PRM; it cannot warm-start a 'likelihood' one"):
        train_prm(backbone, _prm_examples(1, 4), str(tmp_path / "x"), PRMParams(max_steps=1, head="likelihood"),
                  init_from_prm=prm[0])
    with pytest.raises(ValueError, match=r"lm_weight needs head='likelihood'"):
        train_prm(backbone, _prm_examples(1, 4), str(tmp_path / "y"), PRMParams(max_steps=1, lm_weight=1.0))


def _orm_examples(seed: int, n: int) -> list[dict]:
    out = []
    for p in _problems(seed, n):
        gold = DOMAIN.reference_solution(p)
        lines = gold.splitlines()
        # Wrong outcomes a small policy produces: stopped before answering, or a garbled answer line.
        for c, ok in [(gold, True), ("\n".join(lines[:-1]) + "\n", False), (gold.replace("####", "###"), False)]:
            assert DOMAIN.verify([c], [p.answer]) == [1.0 if ok else 0.0]
            out.append({"prompt": p.prompt, "completion": c, "label": ok})
    return out


def test_orm_ranks_correct_above_incorrect(backbone, tmp_path):
    metrics = train_orm(backbone, _orm_examples(0, 300), str(tmp_path / "orm"),
                        ORMParams(max_steps=60, batch_size=32, learning_rate=3e-3))
    assert metrics["pairs"] == 2 * 600 and metrics["steps"] == 60
    test = _orm_examples(99, 40)
    scores = ORMScorer(str(tmp_path / "orm")).score_completions([e["prompt"] for e in test], [e["completion"] for e in test])
    wins = [scores[i] > scores[j] for i in range(0, len(test), 3) for j in (i + 1, i + 2)]
    assert sum(wins) / len(wins) >= 0.9, f"pair accuracy {sum(wins) / len(wins):.3f}"
    assert not [p.name for p in (tmp_path / "orm").iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]


def _log_ratio(policy: str, reference: str, text_ids: list[int], start: int) -> float:
    """Unbatched, unpadded sum of log pi - log pi_ref over tokens [start:]: the reference computation."""
    ids = torch.tensor([text_ids])
    lp = [torch.log_softmax(load_policy(m)[0](input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])
          for m in (policy, reference)]
    return float((lp[0] - lp[1])[start - 1:].sum())


def test_implicit_rewards(backbone, tmp_path):
    other = str(create_tiny_llama(SMALL, tmp_path / "other", seed=1))
    problems = _problems(3, 4)
    prompts = [p.prompt for p in problems]
    steps = [DOMAIN.split_steps(DOMAIN.reference_solution(p)) for p in problems]

    same = implicit_step_rewards(backbone, backbone, prompts, steps)
    assert [len(s) for s in same] == [len(s) for s in steps]
    assert all(r == 0.0 for s in same for r in s)

    beta = 0.05
    diff = implicit_step_rewards(other, backbone, prompts, steps, beta=beta, batch_size=3)
    assert all(abs(r) > 1e-4 for s in diff for r in s)
    tok = load_policy(backbone)[1]
    with torch.inference_mode():
        for p, s, r in zip(prompts, steps, diff):
            ids, _ = tokenize_steps(tok, p, s)
            start = len(tok(p, add_special_tokens=False)["input_ids"])
            assert math.isclose(sum(r), beta * _log_ratio(other, backbone, ids, start), abs_tol=1e-4)


def test_sampler_confidence_is_each_steps_least_likely_token(backbone):
    """score.reward_model=confidence: each step scores exp of the lowest log-probability among its own tokens (its
    separator included) under the policy, the prompt and the steps before it read; batching and padding change
    nothing, and a trajectory without steps gets none."""
    from components.rewards import load_reward_model

    problems = _problems(5, 3)
    prompts = [p.prompt for p in problems]
    steps = [DOMAIN.split_steps(DOMAIN.reference_solution(p)) for p in problems]
    steps[1] = steps[1][:1]  # rows of one batch with fewer steps than others
    rm = load_reward_model("confidence", backbone, separator=DOMAIN.step_separator)
    assert (rm.name, rm.granularity) == ("confidence", "step")
    scores = rm.score([*prompts, "1+1\n"], ["", "", "", ""], [*steps, []], batch_size=2)
    assert scores[-1] == [] and scores[:-1] == rm.score(prompts, ["", "", ""], steps)
    model, tok = load_policy(backbone)
    for p, s, got in zip(prompts, steps, scores):
        ids, ends = tokenize_steps(tok, p, s)
        x = torch.tensor([ids])
        with torch.inference_mode():
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
        start = len(tok(p, add_special_tokens=False)["input_ids"])
        want = []
        for end in ends:
            want.append(math.exp(float(lp[start - 1:end].min())))
            start = end + 1
        assert got == pytest.approx(want, rel=1e-4) and len(got) == len(s)
        assert all(0 < v <= 1 for v in got)
