"""PRM-guided step-level sampling for the `generate` stage (coevo from round 2 on).

    scorer = PRMScorer("workdir/arith-coevo/r1/train_reward/a1/prm")
    samples, stats = prm_step_search(ArithDomain(), get_backend("hf", policy_path), scorer.score_steps,
                                     ["3+4-2\\n"], n=2, max_tries=4, threshold=0.5, temperature=0.8,
                                     top_p=1.0, max_new_tokens=96, seed=0)

Each sample is built one step (up to the domain's step separator) at a time. A candidate step is drawn from the policy and the
previous round's PRM scores it in context; it is kept when P(good) >= `threshold`, otherwise the step
is drawn again, up to `max_tries`, and the best-scored draw is kept. This is the cheapest form of the
value-guided step search in ReST-MCTS* (Zhang et al. 2024, https://arxiv.org/abs/2406.03816) and
rStar-Math (Guan et al. 2025, https://arxiv.org/abs/2501.04519): a wrong step is caught where it is
made, and only that step is paid for again, instead of a whole new sample.

Every drawn token counts: `stats["generated_tokens"]` is the accepted tokens plus the discarded
draws' (`stats["discarded_tokens"]`), and the stage reports both so the round's budget includes them.
A sample ends at its answer line (`domain.extract_answer`), at EOS (an empty step), or when it has
used `max_new_tokens`. Same inputs and seed, same samples: each (step, try) call has its own seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.domains.base import Domain
from components.models.backends import GenerationBackend, Sample
from components.seeding import seed_stream

@dataclass
class _State:
    prompt: str
    sep: str  # the domain's step separator: a step ends there
    steps: list[str] = field(default_factory=list)
    tokens: int = 0
    done: bool = False
    finish: str = "stop"

    @property
    def text(self) -> str:
        return "".join(s + self.sep for s in self.steps)


def prm_step_search(domain: Domain, backend: GenerationBackend,
                    score_steps: Callable[[list[str], list[list[str]]], list[list[float]]], prompts: list[str], *,
                    n: int, max_tries: int, threshold: float, temperature: float, top_p: float, max_new_tokens: int,
                    seed: int, max_steps: int = 32, redraw_temperature: float | None = None,
                    progress: Callable[[str], None] | None = None) -> tuple[list[list[Sample]], dict[str, Any]]:
    """`n` PRM-guided samples per prompt (see the module docstring), and what the search cost. A step the PRM
    rejects is redrawn at `redraw_temperature` (default: `temperature`): hotter, to explore where the PRM
    flagged a mistake rather than repeat it."""
    if max_tries < 1:
        raise ValueError(f"prm_step_search: max_tries must be >= 1, got {max_tries}")
    states = [_State(p, domain.step_separator) for p in prompts for _ in range(n)]
    stats = {"steps": 0, "draws": 0, "redraws": 0, "accepted_below_threshold": 0, "discarded_tokens": 0}
    for step in range(max_steps):
        active = [s for s in states if not s.done]
        if not active:
            break
        best: dict[int, tuple[float, Sample]] = {}
        drawn: dict[int, int] = {}  # tokens of every draw of this step, kept or not
        pending = list(range(len(active)))
        for attempt in range(max_tries):
            if not pending:
                break
            t = temperature if attempt == 0 or redraw_temperature is None else redraw_temperature
            outs = backend.generate([active[j].prompt + active[j].text for j in pending], n=1, temperature=t,
                                    top_p=top_p, max_new_tokens=max(1, max_new_tokens - min(active[j].tokens
                                                                                             for j in pending)),
                                    seed=seed_stream(seed, step, attempt), stop=[domain.step_separator])
            cands = [o[0] for o in outs]
            stats["draws"] += len(cands)
            stats["redraws"] += len(cands) if attempt else 0
            # An empty draw is EOS (or a blank line): nothing to judge, the sample ends there.
            judged = [(j, c) for j, c in zip(pending, cands) if c.text.strip()]
            scores = score_steps([active[j].prompt for j, _ in judged],
                                 [active[j].steps + [c.text.strip()] for j, c in judged]) if judged else []
            value = {j: sc[-1] for (j, _), sc in zip(judged, scores)}
            still = []
            for j, c in zip(pending, cands):
                v = value.get(j, 1.0)
                drawn[j] = drawn.get(j, 0) + c.num_tokens
                if j not in best or v > best[j][0]:
                    best[j] = (v, c)
                if v < threshold and attempt + 1 < max_tries:
                    still.append(j)
            pending = still
        for j, (v, c) in best.items():
            s = active[j]
            stats["steps"] += 1
            stats["discarded_tokens"] += drawn[j] - c.num_tokens
            stats["accepted_below_threshold"] += int(v < threshold)
            s.tokens += c.num_tokens
            step_text = c.text.strip()
            if not step_text:
                s.done = True
                continue
            s.steps.append(step_text)
            if domain.extract_answer(s.text) is not None:
                s.done = True
            elif c.finish_reason == "length" or s.tokens >= max_new_tokens:
                s.done, s.finish = True, "length"
        if progress:
            progress(f"step {step + 1}/{max_steps}: {sum(not s.done for s in states)} of {len(states)} samples open")
    for s in states:
        if not s.done:
            s.finish = "length"
    samples = [Sample(s.text, s.tokens, s.finish) for s in states]
    stats["accepted_tokens"] = sum(s.tokens for s in states)
    stats["generated_tokens"] = stats["accepted_tokens"] + stats["discarded_tokens"]
    return [samples[i * n:(i + 1) * n] for i in range(len(prompts))], stats
