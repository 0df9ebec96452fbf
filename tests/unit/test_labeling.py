"""Step labels: Monte Carlo values on a hand-computed case, the real HF backend, and oracle rows.

    .venv/bin/python -m pytest tests/unit/test_labeling.py -q
"""

from __future__ import annotations

from components.domains.arith import ArithDomain
from components.domains.base import Problem
from components.labeling import mc_first_error_labels, mc_step_labels, mc_value, oracle_labels, prm_examples
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


def test_mc_first_error_labels_binary_search_hand_computed():
    p = "1+2+3+1+1\n"  # five steps of work, then the answer line: 8
    # A wrong trajectory: steps 0-1 right, step 2 wrong (3+3=7), then consistent with it.
    wrong = "1+2=3\n3+3=6\n6+1=8\n8+1=9\n#### 9\n".replace("3+3=6\n6+1=8", "3+3=7\n7+1=8")
    steps = ArithDomain.split_steps(wrong)  # 5 steps: the first bad one is index 1 (3+3=7)
    prefix = lambda i: p + "".join(s + "\n" for s in steps[:i + 1])
    script = {
        prefix(1): ["7+1=8\n8+1=9\n#### 9\n"] * 3,           # through 3+3=7: dead (no rollout gets 8)
        prefix(0): ["3+3=6\n6+1=7\n7+1=8\n#### 8\n", "#### 2\n", "#### 2\n"],  # alive (1 of 3)
        prefix(2): ["#### 1\n"] * 3,
    }
    backend = ScriptedBackend(script)
    right = "1+2=3\n3+3=6\n6+1=7\n7+1=8\n#### 8\n"
    items = [_item("wrong", wrong, p, "8"), _item("right", right, p, "8"), _item("one-step", "#### 3\n", p, "8")]
    rows, stats, pairs = mc_first_error_labels(ArithDomain(), backend, items, k=3, temperature=0.8, max_new_tokens=16,
                                            seed=0)
    hard = _by(rows, "mc_hard")
    assert not _by(rows, "mc_soft")  # hard labels only
    # Step pairs at each first dead step: the rollout that got through from the live prefix against the
    # trajectory's own way on; where the first step is dead, a right sample of the problem is the chosen side.
    assert pairs == [
        {"trajectory_id": "wrong", "step_index": 1, "prefix": "1+2=3\n", "chosen": "3+3=6\n6+1=7\n7+1=8\n#### 8\n",
         "rejected": "3+3=7\n7+1=8\n8+1=9\n#### 9\n", "chosen_from": "rollout", "source": "mc", "chosen_q": None,
         "rejected_q": None},
        {"trajectory_id": "one-step", "step_index": 0, "prefix": "", "chosen": right, "rejected": "#### 3\n",
         "chosen_from": "right", "source": "mc", "chosen_q": None, "rejected_q": None}]
    # Search over [0, 4]: mid 2 dead -> [0, 2]; mid 1 dead -> [0, 1]; mid 0 alive -> first bad step 1.
    assert [hard[("wrong", i)] for i in range(5)] == [(1.0, 3), (0.0, 3), (0.0, 3), (0.0, 0), (0.0, 0)]
    assert [c[0] for c in backend.calls] == [[prefix(2)], [prefix(1)], [prefix(0)]]
    # A right answer is its own witness: every step good, with no rollout; a wrong one-step answer is bad.
    assert [hard[("right", i)] for i in range(5)] == [(1.0, 0)] * 5
    assert hard[("one-step", 0)] == (0.0, 0)
    assert stats["rollouts"] == 9 and stats["unique_prefixes"] == 3 and stats["search_levels"] == 3
    assert stats["generated_tokens"] == sum(len(c) for conts in script.values() for c in conts)


def test_mc_first_error_labels_roll_a_shared_prefix_out_once():
    p = "1+2+3+1+1\n"
    a = "1+2=3\n3+3=7\n7+1=8\n8+1=9\n#### 9\n"  # 5 steps: probes prefix 2, then 1, then 0
    b = "1+2=3\n3+3=7\n#### 7\n"                  # 3 steps: probes prefix 1 (shared with a), then 0
    steps = ArithDomain.split_steps(a)
    prefix = lambda i: p + "".join(s + "\n" for s in steps[:i + 1])
    backend = ScriptedBackend({prefix(2): ["#### 1\n"] * 2, prefix(1): ["#### 1\n"] * 2,
                               prefix(0): ["3+3=6\n6+1=7\n7+1=8\n#### 8\n"] * 2})
    items = [_item("a", a, p, "8"), _item("b", b, p, "8")]
    rows, stats, _ = mc_first_error_labels(ArithDomain(), backend, items, k=2, temperature=0.8, max_new_tokens=16,
                                        seed=0)
    hard = _by(rows, "mc_hard")
    assert [hard[("b", i)][0] for i in range(3)] == [1.0, 0.0, 0.0]
    assert [hard[("a", i)][0] for i in range(5)] == [1.0, 0.0, 0.0, 0.0, 0.0]
    # Level 1: prefixes 2 (a) and 1 (b); level 2: prefix 1 (a) is known, prefix 0 (b) is new; level 3: nothing new.
    assert [sorted(c[0]) for c in backend.calls] == [sorted([prefix(2), prefix(1)]), [prefix(0)]]
    assert stats["unique_prefixes"] == 3 and stats["search_levels"] == 3


def test_mc_first_error_labels_do_not_search_a_problem_no_sample_solved():
    p = "1+2+3+1+1\n"
    wrong = "1+2=3\n3+3=7\n7+1=8\n8+1=9\n#### 9\n"
    steps = ArithDomain.split_steps(wrong)
    prefix = lambda i: p + "".join(s + "\n" for s in steps[:i + 1])
    backend = ScriptedBackend({prefix(2): ["#### 1\n"] * 2, prefix(1): ["#### 1\n"] * 2,
                               prefix(0): ["3+3=6\n6+1=7\n7+1=8\n#### 8\n"] * 2})
    dead = _item("dead", wrong, p, "8") | {"root_alive": False}
    alive = _item("alive", wrong, p, "8") | {"root_alive": True}
    rows, stats, _ = mc_first_error_labels(ArithDomain(), backend, [dead], k=2, temperature=0.8, max_new_tokens=16,
                                        seed=0)
    # No alive root, no search: the final step alone, whose value is the verified outcome.
    assert _by(rows, "mc_hard") == {("dead", 4): (0.0, 0)} and backend.calls == []
    assert stats["rollouts"] == 0 and stats["dead_root"] == 1
    rows, stats, _ = mc_first_error_labels(ArithDomain(), backend, [dead, alive], k=2, temperature=0.8,
                                        max_new_tokens=16, seed=0)
    hard = _by(rows, "mc_hard")
    assert [hard[("alive", i)][0] for i in range(5)] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [k for k in hard if k[0] == "dead"] == [("dead", 4)] and stats["search_levels"] == 3


def test_prm_examples_keep_partly_labelled_trajectories_with_none_steps():
    items = [{"trajectory_id": "a", "prompt": "p", "steps": ["x", "y", "z"]},
             {"trajectory_id": "b", "prompt": "q", "steps": ["x"]},
             {"trajectory_id": "c", "prompt": "r", "steps": ["x", "w"]}]
    labels = {"a": {2: {"mc_hard": 0.0}}, "c": {0: {"mc_hard": 1.0}, 1: {"mc_hard": 0.0}}}
    ex, dec = prm_examples(items, labels, source="mc_hard", prior_scores={"a": [0.1, 0.1, 0.1], "c": [0.9, 0.1]},
                           consensus=True)
    assert [(e["trajectory_id"], e["labels"]) for e in ex] == [("a", [None, None, False]), ("c", [True, False])]
    # b has no label at all; a's consensus cannot be judged on a partial labelling, so it is kept.
    assert [(d["trajectory_id"], d["reason"]) for d in dec] == [("a", "mc labels (final step only)"),
                                                                ("c", "mc labels")]


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
