"""PRM-guided step sampling: the keep/redraw rule on a scripted case, token accounting, and the real HF backend.

    .venv/bin/python -m pytest tests/unit/test_search.py -q
"""

from __future__ import annotations

import pytest

from components.domains.arith import ArithDomain
from components.models.backends import HFBackend, Sample
from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from components.search import prm_step_search


class StepScript:
    """A test double of `GenerationBackend`: per prompt, the next step for each successive call."""

    def __init__(self, script: dict[str, list[str]]):
        self.script, self.calls, self.temperatures = {k: list(v) for k, v in script.items()}, [], []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, stop=None):
        assert n == 1 and stop == ["\n"]
        self.calls.append((list(prompts), seed))
        self.temperatures.append(temperature)
        # The stop string is cut from the text but its token counts, as the real backends do.
        return [[Sample(t, len(t) + 1, "stop")] for t in (self.script[p].pop(0) for p in prompts)]


def test_a_wrong_step_is_redrawn_and_every_draw_is_paid_for():
    p = "3+4-2\n"
    backend = StepScript({
        p: ["3+4=8", "3+4=7"],                       # first draw wrong, redrawn
        p + "3+4=7\n": ["7-2=4", "7-2=6", "7-2=3"],  # three wrong draws: the best-scored (first) is kept
        p + "3+4=7\n7-2=4\n": ["#### 4"],
    })
    scores = {"3+4=8": 0.2, "3+4=7": 0.9, "7-2=4": 0.4, "7-2=6": 0.3, "7-2=3": 0.1, "#### 4": 0.95}
    samples, stats = prm_step_search(
        ArithDomain(), backend, lambda prompts, steps: [[scores[s[-1]]] for s in steps], [p], n=1, max_tries=3,
        threshold=0.5, temperature=0.8, top_p=1.0, max_new_tokens=64, seed=0)
    assert samples == [[Sample("3+4=7\n7-2=4\n#### 4\n", 6 + 6 + 7, "stop")]]
    assert stats["draws"] == 6 and stats["redraws"] == 3 and stats["accepted_below_threshold"] == 1
    assert stats["discarded_tokens"] == 6 + 6 + 6  # 3+4=8, 7-2=6, 7-2=3 (each with its newline)
    assert stats["generated_tokens"] == stats["accepted_tokens"] + stats["discarded_tokens"] == 37
    # Each (step, try) call has its own seed; the answer line ends the sample (no further call).
    assert len(backend.calls) == 6 and len({seed for _, seed in backend.calls}) == 6


def test_a_flagged_step_is_redrawn_at_the_redraw_temperature():
    p = "3+4-2\n"
    backend = StepScript({p: ["3+4=8", "3+4=7"], p + "3+4=7\n": ["7-2=5"], p + "3+4=7\n7-2=5\n": ["#### 5"]})
    scores = {"3+4=8": 0.2, "3+4=7": 0.9, "7-2=5": 0.9, "#### 5": 0.9}
    samples, _ = prm_step_search(ArithDomain(), backend, lambda ps, ss: [[scores[s[-1]]] for s in ss], [p], n=1,
                                 max_tries=2, threshold=0.5, temperature=0.8, top_p=1.0, max_new_tokens=64, seed=0,
                                 redraw_temperature=1.3)
    assert samples[0][0].text == "3+4=7\n7-2=5\n#### 5\n"
    assert backend.temperatures == [0.8, 1.3, 0.8, 0.8]  # only the redraw of the flagged first step is hotter


def test_search_stops_at_the_token_budget():
    p = "3+4-2\n"
    backend = StepScript({p: ["3+4=7"], p + "3+4=7\n": ["7-2=5"]})
    samples, _ = prm_step_search(ArithDomain(), backend, lambda ps, ss: [[0.9] for _ in ss], [p], n=1,
                                 max_tries=2, threshold=0.5, temperature=0.8, top_p=1.0, max_new_tokens=10, seed=0)
    assert samples[0][0].text == "3+4=7\n7-2=5\n" and samples[0][0].finish_reason == "length"


def test_search_with_the_hf_backend_is_reproducible(tmp_path):
    model = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                              tmp_path / "m", seed=0)
    backend = HFBackend(str(model), batch_size=8, device="cpu", progress=False)
    d = ArithDomain()
    prompts = [q.prompt for q in d.sample_problems(level=2, n=3, seed=0)]
    seen = []

    def score(ps, ss):  # deterministic in the step text: favours steps containing '='
        seen.append(len(ps))
        return [[0.8 if "=" in s[-1] else 0.2] for s in ss]

    kw = dict(n=2, max_tries=3, threshold=0.5, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=3, max_steps=4)
    a, sa = prm_step_search(d, backend, score, prompts, **kw)
    b, sb = prm_step_search(d, backend, score, prompts, **kw)
    assert a == b and sa == sb
    assert [len(x) for x in a] == [2, 2, 2] and seen
    assert all(s.num_tokens <= 24 + 24 for per in a for s in per)
    assert sa["generated_tokens"] == sum(s.num_tokens for per in a for s in per) + sa["discarded_tokens"]


def test_max_tries_must_be_positive():
    with pytest.raises(ValueError, match="max_tries"):
        prm_step_search(ArithDomain(), StepScript({}), lambda p, s: [], ["1+1\n"], n=1, max_tries=0, threshold=0.5,
                        temperature=0.8, top_p=1.0, max_new_tokens=8, seed=0)
