"""Accuracy against compute: greedy, maj@N, PRM best-of-N, PRM beam search and MCTS on the same held-out
problems, each point at the generated tokens per problem it spent.

    points = compute_curve(domain, backend, problems, samples, correct, prm_min, score_steps, budgets=[2, 4, 8],
                           methods=("beam", "mcts"), expansions=4, max_step_tokens=32, max_depth=16, c_puct=1.5,
                           temperature=0.8, max_new_tokens=96, seed=0)

At budget N: maj@N and best-of-N read the first N of the evaluation's samples (their tokens are the point's x);
beam search keeps N beams; MCTS gets the tokens that N samples spent, so it sits beside them at equal tokens. A
search whose best solution has not ended when it stops (its budget or depth spent) completes it greedily, and
those tokens count too.
The searches never see the answer: a PRM values their prefixes and judges their finished solutions (the
verifier would use the gold answer, which a held-out search must not). The answer each returns is then verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from components.domains.base import Domain, Problem
from components.models.backends import GenerationBackend
from components.search.beam import beam_search
from components.search.mcts import MCTSConfig, mcts_search
from components.search.policy import _Calls, backend_expander, prm_value
from components.seeding import seed_stream

MCTS_SIMULATIONS = 256  # a cap only: the token budget stops the search first


class TextSearches:
    """The searches' callbacks on a text domain, fresh per budget (`at(k)`): K candidate steps from the backend,
    the PRM's value of a prefix, and `finish`, which completes each prefix that did not end greedily and verifies
    it."""

    def __init__(self, domain: Domain, backend: GenerationBackend, problems: list[Problem],
                 score_steps: Callable[[list[str], list[list[str]]], list[list[float]]], *, temperature: float,
                 max_step_tokens: int, max_new_tokens: int, seed: int):
        self.domain, self.backend, self.seed = domain, backend, seed
        self.answers = {p.prompt: p.answer for p in problems}
        self.temperature, self.max_step_tokens, self.max_new_tokens = temperature, max_step_tokens, max_new_tokens
        self.value = prm_value(domain, score_steps)

    def at(self, k: int) -> TextSearches:
        self.calls = _Calls(seed_stream(self.seed, 1000 + k))
        self.expand = backend_expander(self.domain, self.backend, self.calls, temperature=self.temperature,
                                       top_p=1.0, max_step_tokens=self.max_step_tokens)
        return self

    def finish(self, keys: list[tuple[str, str]], ended: list[bool]) -> tuple[list[bool], int]:
        """Each (prompt, prefix) that did not end completed greedily (a search cut by its budget still answers),
        then each verified against its problem's answer; and the tokens the completions took."""
        done, spent = [prefix for _, prefix in keys], 0
        todo = [i for i, e in enumerate(ended) if not e]
        if todo:
            outs = self.backend.generate([keys[i][0] + keys[i][1] for i in todo], n=1, temperature=0.0, top_p=1.0,
                                         max_new_tokens=self.max_new_tokens, seed=self.calls.next())
            for i, o in zip(todo, outs):
                done[i] += o[0].text
            spent = sum(o[0].num_tokens for o in outs)
        scores = self.domain.verify(done, [self.answers[p] for p, _ in keys])  # one call for all, as `verify` takes
        return [s == 1.0 for s in scores], spent


def compute_curve(domain: Domain, backend: GenerationBackend, problems: list[Problem],
                  samples: dict[str, list[dict[str, Any]]], correct: dict[str, bool], prm_min: dict[str, float] | None,
                  score_steps: Callable[[list[str], list[list[str]]], list[list[float]]] | None, *,
                  budgets: Sequence[int], methods: Sequence[str], expansions: int, max_step_tokens: int,
                  max_depth: int, c_puct: float, temperature: float, max_new_tokens: int, seed: int,
                  progress: Callable[[str], None] | None = None, searches: Any = None) -> list[dict[str, Any]]:
    """Points {method, budget, tokens (per problem), accuracy, n}. `samples[problem_id]` are the evaluation's
    trajectories of a problem, greedy first (sample_index 0); `prm_min` their PRM scores (the weakest step's), for
    best-of-N; `score_steps` the PRM that guides beam search and MCTS (None: no searches). `searches` replaces the
    text domain's callbacks (`TextSearches`) with another's of the same shape: an environment's turns
    (`episodes.EpisodeSearches`)."""
    from components import reward_eval as re_

    say = progress or (lambda _msg: None)
    groups = [sorted(samples[p.problem_id], key=lambda t: t["sample_index"]) for p in problems]
    if any(not g or g[0]["sample_index"] != 0 for g in groups):
        raise ValueError("compute_curve: every problem needs its greedy answer (sample_index 0)")
    n = len(problems)
    points = [{"method": "greedy", "budget": 1, "tokens": sum(g[0]["num_tokens"] for g in groups) / n,
               "accuracy": sum(correct[g[0]["trajectory_id"]] for g in groups) / n, "n": n}]
    sampled = [g[1:] for g in groups]
    tokens_at: dict[int, float] = {}
    for b in budgets:
        tokens_at[b] = sum(t["num_tokens"] for g in sampled for t in g[:b]) / n
        ok = [[correct[t["trajectory_id"]] for t in g] for g in sampled]
        points.append({"method": "maj", "budget": b, "tokens": tokens_at[b], "n": n, "accuracy": re_.majority_at_n(
            [[(t["answer"], o) for t, o in zip(g, k)] for g, k in zip(sampled, ok)], b)})
        if prm_min is not None:
            points.append({"method": "prm_bon", "budget": b, "tokens": tokens_at[b], "n": n, "accuracy": re_.best_of_n(
                [[(prm_min[t["trajectory_id"]], o) for t, o in zip(g, k)] for g, k in zip(sampled, ok)], b)})
    if score_steps is None or not methods:
        return points
    prompts = [p.prompt for p in problems]
    searches = searches or TextSearches(domain, backend, problems, score_steps, temperature=temperature,
                                        max_step_tokens=max_step_tokens, max_new_tokens=max_new_tokens, seed=seed)
    for k, b in enumerate(budgets):
        s = searches.at(k)
        if "beam" in methods:
            beams, spent = beam_search(prompts, s.expand, s.value, width=b, expansions=expansions,
                                       max_depth=max_depth)
            right, more = s.finish([(p, bs[0].prefix if bs else "") for p, bs in zip(prompts, beams)],
                                   [bool(bs) and bs[0].terminal for bs in beams])
            spent += more
            points.append({"method": "beam", "budget": b, "tokens": spent / n, "accuracy": sum(right) / n, "n": n})
            say(f"beam width {b}: {spent / n:.0f} tokens per problem, accuracy {points[-1]['accuracy']:.3f}")
        if "mcts" in methods:
            cfg = MCTSConfig(simulations=MCTS_SIMULATIONS, expansions=expansions, c_puct=c_puct, max_depth=max_depth,
                             token_budget=max(int(tokens_at[b] * n), 1))
            trees, spent = mcts_search(prompts, s.expand, s.value, lambda pairs: s.value(pairs)[0], cfg)
            leaves = [t.best_leaf() for t in trees]
            right, more = s.finish([(t.prompt, t.prefix(x.node_id)) for t, x in zip(trees, leaves)],
                                   [x.terminal for x in leaves])
            spent += more
            points.append({"method": "mcts", "budget": b, "tokens": spent / n, "accuracy": sum(right) / n, "n": n})
            say(f"mcts at {tokens_at[b]:.0f} tokens per problem: {spent / n:.0f} spent, accuracy "
                f"{points[-1]['accuracy']:.3f}")
    return points


def curve_rows(points: list[dict[str, Any]], *, experiment: str, round: int, model_id: str, level: int,
               ) -> list[dict[str, Any]]:
    """The points as `evaluations` rows: `curve_<method>_at_<N>` (accuracy) and `..._tokens` (per problem)."""
    rows = []
    for p in points:
        name = f"curve_{p['method']}_at_{p['budget']}"
        rows += [{"experiment_id": experiment, "round": round, "model_id": model_id, "level": level, "metric": name,
                  "value": float(p["accuracy"]), "n": p["n"]},
                 {"experiment_id": experiment, "round": round, "model_id": model_id, "level": level,
                  "metric": f"{name}_tokens", "value": float(p["tokens"]), "n": p["n"]}]
    return rows


def curve_points(evaluations: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """`evaluations` rows back as points, per round: the inverse of `curve_rows`."""
    import re

    pat = re.compile(r"curve_(?P<method>[a-z_]+?)_at_(?P<budget>\d+)(?P<tokens>_tokens)?$")
    found: dict[tuple[int, str, int], dict[str, Any]] = {}
    for e in evaluations:
        m = pat.match(e["metric"])
        if not m:
            continue
        key = (int(e["round"]), m["method"], int(m["budget"]))
        pt = found.setdefault(key, {"method": m["method"], "budget": int(m["budget"]), "level": int(e["level"]),
                                    "n": e["n"]})
        pt["tokens" if m["tokens"] else "accuracy"] = float(e["value"])
    out: dict[int, list[dict[str, Any]]] = {}
    for (rnd, _, _), pt in sorted(found.items()):
        out.setdefault(rnd, []).append(pt)
    return out
