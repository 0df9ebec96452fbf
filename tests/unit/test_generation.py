"""Rejection sampling in waves (`generate.until_correct`, DART-Math): who is drawn for, ids, seeds, tokens.

    .venv/bin/python -m pytest tests/unit/test_generation.py -q
"""

from __future__ import annotations

import pytest

from components.config import ConfigError, load_config
from components.domains.arith import ArithDomain
from components.generation import generate, generate_until_correct
from components.models.backends import HFBackend, Sample
from components.seeding import seed_stream
from components.models.tiny import TinyLlamaConfig, create_tiny_llama

KW = dict(experiment="e", round=1, purpose="train", policy_model_id="m", temperature=0.8, top_p=1.0,
          max_new_tokens=32)


class Script:
    """A test double of `GenerationBackend`: per prompt, the next completions in order; records each call."""

    def __init__(self, script: dict[str, list[str]]):
        self.script, self.calls = {k: list(v) for k, v in script.items()}, []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, stop=None):
        self.calls.append((list(prompts), n, seed))
        return [[Sample(t, len(t), "stop") for t in (self.script[p].pop(0) for _ in range(n))] for p in prompts]


def _problems(d: ArithDomain, n: int = 3):
    return d.sample_problems(2, n, seed=0)


def test_only_problems_short_of_right_answers_are_drawn_again():
    d = ArithDomain()
    a, b, c = _problems(d)
    wrong = "1=1\n#### 99999"
    right = {p.prompt: f"#### {p.answer}" for p in (a, b, c)}
    backend = Script({
        a.prompt: [right[a.prompt]],                      # solved in wave 0: one draw
        b.prompt: [wrong, wrong, right[b.prompt]],        # solved in wave 2
        c.prompt: [wrong, wrong, wrong, wrong],           # never: all 4 draws
    })
    batch, stats = generate_until_correct(d, backend, [a, b, c], verifier=d.verify, want=1, wave_size=1, n=4,
                                          seed=7, **KW)
    drawn = {p.problem_id: sorted(t["sample_index"] for t in batch.trajectories if t["problem_id"] == p.problem_id)
             for p in (a, b, c)}
    assert drawn == {a.problem_id: [0], b.problem_id: [0, 1, 2], c.problem_id: [0, 1, 2, 3]}
    assert [len(ps) for ps, _, _ in backend.calls] == [3, 2, 2, 1]
    # Wave 0 keeps the plain draw's seed; later waves get their own.
    assert [s for _, _, s in backend.calls] == [7, seed_stream(7, 1), seed_stream(7, 2), seed_stream(7, 3)]
    assert stats["waves"] == 4 and stats["unmet"] == 1
    assert stats["wave0_problems"] == 3 and stats["wave3_problems"] == 1
    assert batch.num_tokens == sum(stats[f"wave{w}_tokens"] for w in range(4))
    assert len(batch.problems) == 3  # every problem is recorded, drawn for once or four times
    assert len({t["trajectory_id"] for t in batch.trajectories}) == 8


def test_want_two_right_and_waves_of_two():
    d = ArithDomain()
    a, b = _problems(d, 2)
    ra, rb, wrong = f"#### {a.answer}", f"#### {b.answer}", "#### 99999"
    backend = Script({a.prompt: [ra, wrong, ra, ra], b.prompt: [rb, rb]})
    batch, stats = generate_until_correct(d, backend, [a, b], verifier=d.verify, want=2, wave_size=2, n=5,
                                          seed=0, **KW)
    # a: 1 right after wave 0, 3 after wave 1 (stops); b: 2 right at once. The last wave would be 1 draw (n=5).
    assert [(len(ps), n) for ps, n, _ in backend.calls] == [(2, 2), (1, 2)]
    assert sorted(t["sample_index"] for t in batch.trajectories if t["problem_id"] == a.problem_id) == [0, 1, 2, 3]
    assert stats["unmet"] == 0


def test_the_first_wave_is_the_plain_draw_with_the_real_backend(tmp_path):
    """Same ids, same texts, same seeds as `generate` for wave 0; the whole thing reruns byte for byte."""
    model = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                              tmp_path / "m", seed=0)
    backend = HFBackend(str(model), batch_size=8, device="cpu", progress=False)
    d = ArithDomain()
    problems = _problems(d, 4)
    plain = generate(d, backend, problems, n=1, seed=3, **KW)
    never_right = lambda completions, refs: [0.0] * len(completions)  # noqa: E731: every problem gets all draws
    batch, stats = generate_until_correct(d, backend, problems, verifier=never_right, want=1, wave_size=1, n=3,
                                          seed=3, **KW)
    first = [t for t in batch.trajectories if t["sample_index"] == 0]
    assert first == plain.trajectories
    assert stats["waves"] == 3 and len(batch.trajectories) == 12
    again, _ = generate_until_correct(d, backend, problems, verifier=never_right, want=1, wave_size=1, n=3,
                                      seed=3, **KW)
    assert again.trajectories == batch.trajectories and again.steps == batch.steps


def test_a_broken_verifier_fails_loudly_as_in_the_verify_stage():
    from components.verification import VerifierError

    d = ArithDomain()
    (a,) = _problems(d, 1)
    with pytest.raises(VerifierError, match="returned 0 results for 1 completions"):
        generate_until_correct(d, Script({a.prompt: ["#### 1"]}), [a], verifier=lambda c, r: [], want=1,
                               wave_size=1, n=2, seed=0, **KW)


def test_config_rejects_a_target_no_draw_can_meet(repo):
    with pytest.raises(ConfigError, match=r"generate.until_correct \(5\) can never be met with samples_per_problem=4"):
        load_config(repo / "configs" / "arith-coevo.yaml", ["generate.until_correct=5"])
    with pytest.raises(ConfigError, match=r"generate.wave_size \(8\) exceeds samples_per_problem \(4\)"):
        load_config(repo / "configs" / "arith-coevo.yaml", ["generate.until_correct=1", "generate.wave_size=8"])
