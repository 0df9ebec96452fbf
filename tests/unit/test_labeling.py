"""Step labels: Monte Carlo values on a hand-computed case, the real HF backend, and oracle rows.

    .venv/bin/python -m pytest tests/unit/test_labeling.py -q
"""

from __future__ import annotations

from components.domains.arith import ArithDomain
from components.domains.base import Problem
from components.labeling import mc_step_labels, mc_value, oracle_labels
from components.models.backends import HFBackend, Sample
from components.models.tiny import TinyLlamaConfig, create_tiny_llama


class ScriptedBackend:
    """A test double of the `GenerationBackend` interface: fixed continuations per prompt, calls recorded."""

    def __init__(self, script: dict[str, list[str]]):
        self.script, self.calls = script, []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed):
        self.calls.append((list(prompts), n))
        return [[Sample(t, len(t), "stop") for t in self.script[p][:n]] for p in prompts]


def _item(tid: str, completion: str, prompt: str = "3+4-2\n", answer: str = "5") -> dict:
    return {"trajectory_id": tid, "problem_id": Problem.make("arith", 2, prompt, answer).problem_id,
            "prompt": prompt, "steps": ArithDomain.split_steps(completion), "answer_ref": answer}


def _by(rows: list[dict], source: str) -> dict[tuple[str, int], tuple[float, int]]:
    return {(r["trajectory_id"], r["step_index"]): (r["value"], r["num_rollouts"])
            for r in rows if r["source"] == source}


def test_mc_value():
    assert mc_value([True, True, False, False]) == (0.5, 1.0)
    assert mc_value([1.0, 1.0, 1.0]) == (1.0, 1.0)
    assert mc_value([False] * 4) == (0.0, 0.0)


def test_mc_step_labels_hand_computed():
    script = {
        # Good first step: 2 of 4 continuations reach 5.
        "3+4-2\n3+4=7\n": ["7-2=5\n#### 5\n", "7-2=4\n#### 4\n", "7-2=5\n#### 5\n", "x"],
        # Wrong first step: one lucky continuation of four.
        "3+4-2\n3+4=8\n": ["8-2=6\n#### 6\n", "8-2=5\n#### 5\n", "#### 6\n", "#### 6\n"],
        "3+4-2\n3+4=7\n7-2=5\n": ["#### 5\n", "#### 5\n", "#### 5\n", "#### 5\n"],
        "3+4-2\n3+4=8\n8-2=6\n": ["#### 6\n", "#### 6\n", "#### 6\n", "#### 6\n"],
    }
    backend = ScriptedBackend(script)
    items = [_item("good", "3+4=7\n7-2=5\n#### 5\n"), _item("bad", "3+4=8\n8-2=6\n#### 6\n"),
             _item("same-start", "3+4=7\n7-2=5\n#### 5\n")]
    rows, stats = mc_step_labels(ArithDomain(), backend, items, k=4, temperature=0.8, max_new_tokens=16, seed=0)

    soft, hard = _by(rows, "mc_soft"), _by(rows, "mc_hard")
    assert soft[("good", 0)] == (0.5, 4) and hard[("good", 0)] == (1.0, 4)
    assert soft[("good", 1)] == (1.0, 4) and hard[("good", 1)] == (1.0, 4)
    assert soft[("good", 2)] == (1.0, 0) and hard[("good", 2)] == (1.0, 0)  # final step: the verifier, no rollouts
    assert soft[("bad", 0)] == (0.25, 4) and hard[("bad", 0)] == (1.0, 4)
    assert soft[("bad", 1)] == (0.0, 4) and hard[("bad", 1)] == (0.0, 4)
    assert soft[("bad", 2)] == (0.0, 0) and hard[("bad", 2)] == (0.0, 0)
    assert soft[("same-start", 0)] == soft[("good", 0)]
    assert len(rows) == 2 * 3 * 3
    # One backend call for every prefix of every trajectory; the shared prefixes are rolled out once.
    assert len(backend.calls) == 1 and backend.calls[0][1] == 4 and len(backend.calls[0][0]) == 4
    assert stats["rollouts"] == 16 and stats["unique_prefixes"] == 4
    assert stats["generated_tokens"] == sum(len(c) for conts in script.values() for c in conts)


def test_mc_step_labels_with_the_hf_backend(tmp_path):
    model = create_tiny_llama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                              tmp_path / "m", seed=0)
    d = ArithDomain()
    problems = d.sample_problems(level=2, n=3, seed=0)
    items = [_item(f"t{i}", d.reference_solution(p), p.prompt, p.answer) for i, p in enumerate(problems)]
    backend = HFBackend(str(model), batch_size=64, device="cpu", progress=False)
    rows, stats = mc_step_labels(d, backend, items, k=2, temperature=1.0, max_new_tokens=8, seed=0)
    again, _ = mc_step_labels(d, backend, items, k=2, temperature=1.0, max_new_tokens=8, seed=0)
    assert rows == again
    assert len(rows) == 2 * sum(len(it["steps"]) for it in items)
    assert stats["rollouts"] == 2 * 2 * 3 and 0 < stats["generated_tokens"] <= stats["rollouts"] * 8
    assert {r["value"] for r in rows if r["num_rollouts"] == 0} == {1.0}  # gold trajectories end right
    assert all(0.0 <= r["value"] <= 1.0 for r in rows)


def test_oracle_labels_match_the_domain():
    d = ArithDomain()
    items = [_item("a", "3+4=8\n7-2=5\n#### 6\n"), _item("b", "3+4=7\n7-2=5\n#### 5\n"), _item("c", "3+4=7\n")]
    problem = Problem.make("arith", 2, "3+4-2\n", "5")
    rows = oracle_labels(d, {problem.problem_id: problem}, items)
    for it in items:
        expected = [1.0 if ok else 0.0 for ok in d.oracle_step_labels(problem, "\n".join(it["steps"]) + "\n")]
        assert [r["value"] for r in rows if r["trajectory_id"] == it["trajectory_id"]] == expected
    assert [r["value"] for r in rows if r["trajectory_id"] == "a"] == [0.0, 1.0, 0.0]
    assert {r["source"] for r in rows} == {"oracle"} and {r["num_rollouts"] for r in rows} == {0}
