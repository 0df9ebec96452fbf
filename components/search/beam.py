"""Beam search over steps, guided by a value (a PRM's, at evaluation): the search of Snell et al. 2024.

    beams, spent = beam_search(prompts, expand, value, width=4, expansions=4, max_depth=16)
    beams[0][0]  # Beam(prefix, score, terminal): the best finished solution of the first prompt

Each prompt keeps up to `width` live prefixes. Each iteration, one `expand` call draws `expansions` candidate
steps for every live prefix of every prompt, and one `value` call scores the new prefixes. A candidate that ends
the solution is finished with its score (the `width` best finished are kept); of the others, the `width` best
by score, less those finished, stay live. A prompt stops when
`width` solutions have finished, nothing is live, or the live prefixes are `max_depth` steps deep (they are then
finished as they stand). Ties go to the earlier candidate, so the search is deterministic given its callbacks.

The budget counts generated tokens, as MCTS's does: every candidate's, duplicates included, and whatever the value
source reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from components.search.mcts import Candidate


@dataclass(frozen=True)
class Beam:
    prefix: str
    score: float
    terminal: bool
    depth: int


def beam_search(prompts: list[str],
                expand: Callable[[list[tuple[str, str]], int], list[list[Candidate]]],
                value: Callable[[list[tuple[str, str]]], tuple[list[float], int]], *,
                width: int, expansions: int, max_depth: int) -> tuple[list[list[Beam]], int]:
    """Each prompt's finished beams, best score first, and the tokens generated (module docstring)."""
    for name, v in (("width", width), ("expansions", expansions), ("max_depth", max_depth)):
        if v < 1:
            raise ValueError(f"beam.{name} must be >= 1, got {v}")
    live: list[list[Beam]] = [[Beam("", 0.0, False, 0)] for _ in prompts]
    done: list[list[Beam]] = [[] for _ in prompts]
    spent = 0
    while True:
        grow = [(i, b) for i, beams in enumerate(live) for b in beams
                if len(done[i]) < width and b.depth < max_depth]
        for i, beams in enumerate(live):  # as deep as allowed: finished as they stand
            for b in beams:
                if b.depth >= max_depth and len(done[i]) < width:
                    done[i].append(b)
            done[i].sort(key=lambda x: -x.score)
        if not grow:
            break
        proposals = expand([(prompts[i], b.prefix) for i, b in grow], expansions)
        if len(proposals) != len(grow):
            raise ValueError(f"beam: expand returned {len(proposals)} lists of candidates for {len(grow)} prefixes")
        new: list[tuple[int, Beam]] = []
        for (i, b), cands in zip(grow, proposals):
            spent += sum(c.tokens for c in cands)
            if not cands:  # the policy ended the solution here
                new.append((i, Beam(b.prefix, b.score, True, b.depth)))
            new += [(i, Beam(b.prefix + c.text, 0.0, c.terminal, b.depth + 1)) for c in cands]
        values, tokens = value([(prompts[i], b.prefix) for i, b in new]) if new else ([], 0)
        if len(values) != len(new):
            raise ValueError(f"beam: value returned {len(values)} values for {len(new)} prefixes")
        spent += tokens
        live = [[] for _ in prompts]
        for (i, b), v in zip(new, values):
            if math.isnan(v):
                raise ValueError(f"beam: value NaN for a prefix of {prompts[i]!r}")
            scored = Beam(b.prefix, float(v), b.terminal, b.depth)
            (done[i] if b.terminal else live[i]).append(scored)
        for i in range(len(prompts)):
            done[i] = sorted(done[i], key=lambda x: -x.score)[:width]  # stable: the earlier on ties
            order = sorted(range(len(live[i])), key=lambda k: (-live[i][k].score, k))
            live[i] = [live[i][k] for k in order[:max(width - len(done[i]), 0)]]
    return done, spent
