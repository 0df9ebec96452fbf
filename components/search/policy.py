"""MCTS with a real policy: K candidate steps from a generation backend, rollouts (or a PRM) for the value,
the domain's verifier at the end.

    trees, samples, stats = mcts_sample(ArithDomain(), HFBackend(path), problems, MCTSConfig(simulations=8),
                                        temperature=0.8, top_p=1.0, max_step_tokens=24, max_new_tokens=96,
                                        rollouts=2, seed=0)

A step is what the policy writes up to the domain's step separator. The K draws for a leaf come from one
backend call for all the leaves of a simulation (every tree's), and identical draws are one child whose
prior is how many of the K drew it: the policy's own probability, estimated, where the backends return no
log-probabilities. A child ends the solution where it holds the answer line, is empty (EOS), or ran out of
`max_step_tokens`; `MCTSConfig.max_depth` bounds the steps. Rollouts complete a prefix in up to
`max_new_tokens`. Each backend call gets its own seed (`seed_stream(seed, call)`), so the same inputs and
seed give the same trees.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from components.domains.base import Domain, Problem
from components.models.backends import GenerationBackend, Sample
from components.search.mcts import Candidate, MCTSConfig, Tree, mcts_search
from components.seeding import seed_stream


class _Calls:
    """A counter of backend calls: each call's seed."""

    def __init__(self, seed: int):
        self.seed, self.n = seed, 0

    def next(self) -> int:
        self.n += 1
        return seed_stream(self.seed, self.n)


def backend_expander(domain: Domain, backend: GenerationBackend, calls: _Calls, *, temperature: float, top_p: float,
                     max_step_tokens: int) -> Callable[[list[tuple[str, str]], int], list[list[Candidate]]]:
    sep = domain.step_separator

    def expand(pairs: list[tuple[str, str]], k: int) -> list[list[Candidate]]:
        outs = backend.generate([p + prefix for p, prefix in pairs], n=k, temperature=temperature, top_p=top_p,
                                max_new_tokens=max_step_tokens, seed=calls.next(), stop=[sep])
        result = []
        for (_, prefix), draws in zip(pairs, outs):
            by_text: dict[str, list[Sample]] = {}
            for d in draws:
                by_text.setdefault(d.text.strip(), []).append(d)
            cands = []
            for text, same in by_text.items():
                step = text + sep if text else ""
                tokens = sum(d.num_tokens for d in same)  # every draw is paid for, duplicates too
                ends = (not text or domain.extract_answer(prefix + step) is not None or
                        any(d.finish_reason == "length" for d in same))
                cands.append(Candidate(step, 0.0, tokens, ends, weight=float(len(same))))
            result.append(cands)
        return result

    return expand


def rollout_value(domain: Domain, backend: GenerationBackend, calls: _Calls, answers: dict[str, str], *,
                  rollouts: int, temperature: float, top_p: float, max_new_tokens: int,
                  completions: dict[tuple[str, str], tuple[Sample, float]] | None = None,
                  ) -> Callable[[list[tuple[str, str]]], tuple[list[float], int]]:
    """A prefix's value: the share of `rollouts` completions from it that the verifier accepts. Where
    `completions` is given, each (prompt, prefix) keeps its best rollout there (the first right one, else the
    first) with its reward: a whole solution the search has paid for."""
    def value(pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
        outs = backend.generate([p + prefix for p, prefix in pairs], n=rollouts, temperature=temperature,
                                top_p=top_p, max_new_tokens=max_new_tokens, seed=calls.next())
        values, tokens = [], 0
        for (p, prefix), done in zip(pairs, outs):
            scores = [s or 0.0 for s in domain.verify([prefix + d.text for d in done], [answers[p]] * len(done))]
            values.append(sum(scores) / len(done))
            tokens += sum(d.num_tokens for d in done)
            if completions is not None:
                best = max(range(len(done)), key=lambda i: (scores[i], -i))
                completions[(p, prefix)] = (done[best], scores[best])
        return values, tokens

    return value


def prm_value(domain: Domain, score_steps: Callable[[list[str], list[list[str]]], list[list[float]]],
              ) -> Callable[[list[tuple[str, str]]], tuple[list[float], int]]:
    """A prefix's value: a PRM's P(good) of its last step, in the context of the steps before it (no tokens)."""
    def value(pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
        steps = [domain.split_steps(prefix) for _, prefix in pairs]
        scores = score_steps([p for p, _ in pairs], steps)
        return [min(max(float(sc[-1]), 0.0), 1.0) if sc else 0.5 for sc in scores], 0

    return value


def mcts_sample(domain: Domain, backend: GenerationBackend, problems: list[Problem], cfg: MCTSConfig, *,
                temperature: float, top_p: float, max_step_tokens: int, max_new_tokens: int, seed: int,
                rollouts: int = 2,
                value: Callable[[list[tuple[str, str]]], tuple[list[float], int]] | None = None,
                progress: Callable[[int, int], None] | None = None,
                completions: dict[tuple[str, str], tuple[Sample, float]] | None = None,
                trees: list[Tree] | None = None,
                ) -> tuple[list[Tree], list[Sample], dict[str, Any]]:
    """One tree per problem; each problem's answer is its tree's best leaf (`Tree.best_leaf`), as a Sample whose
    tokens are the whole search's for that tree. `value` (a PRM's, say) replaces the rollouts; `completions`
    collects the rollouts' best per prefix (`rollout_value`); `trees`, where given, are the problems' trees to
    search on (seeded with solutions already drawn: `Tree.seed`)."""
    answers = {p.prompt: p.answer for p in problems}
    if len(answers) != len(problems):
        raise ValueError("mcts_sample: two problems share a prompt; search each prompt once")
    calls = _Calls(seed)
    expand = backend_expander(domain, backend, calls, temperature=temperature, top_p=top_p,
                              max_step_tokens=max_step_tokens)
    value = value or rollout_value(domain, backend, calls, answers, rollouts=rollouts, temperature=temperature,
                                   top_p=top_p, max_new_tokens=max_new_tokens, completions=completions)

    def reward(pairs: list[tuple[str, str]]) -> list[float]:
        return [float(r or 0.0) for r in domain.verify([s for _, s in pairs], [answers[p] for p, _ in pairs])]

    trees, spent = mcts_search([p.prompt for p in problems], expand, value, reward, cfg, progress, trees)
    samples = []
    for t in trees:
        leaf = t.best_leaf()
        text = t.prefix(leaf.node_id)
        samples.append(Sample(text, sum(n.tokens for n in t.nodes), "stop" if leaf.terminal else "length"))
    stats = {"generated_tokens": spent, "backend_calls": calls.n, "nodes": sum(len(t.nodes) for t in trees),
             "solved": sum(int(t.best_leaf().reward == 1.0) for t in trees)}
    return trees, samples, stats
