"""Curriculum: draw problems near the edge of learnability (pass rate neither near 0 nor near 1)."""

from __future__ import annotations


def pick_levels(pass_rates: dict[int, float], low: float, high: float, max_levels: int,
                solved: dict[int, float] | None = None) -> tuple[list[int], str]:
    """Levels whose pass rate lies in [low, high], hardest first, at most `max_levels`.

    If every level is mastered or hopeless, fall back to the easiest unmastered level, so a round
    always has something to learn from.

    >>> pick_levels({1: 1.0, 2: 0.97, 3: 0.5, 4: 0.1, 5: 0.01}, 0.03, 0.95, 3)
    ([3, 4], 'pass rate in [0.03, 0.95]: L3=0.50, L4=0.10')
    >>> pick_levels({1: 1.0, 2: 0.0}, 0.03, 0.95, 3)
    ([2], 'fallback: no level in [0.03, 0.95]; easiest unmastered level 2')

    `solved` ({level: share of the last round's sampled problems that a sample got right}) keeps a level the
    rounds are climbing above the floor when its held-out rate falls below it: one held-out task of 30 turning
    wrong does not drop it while the samples still solve it. The ceiling stays on the held-out rate.

    >>> pick_levels({2: 0.57, 3: 0.53, 4: 0.0}, 0.01, 0.9, 2, solved={3: 1.0, 4: 2 / 24})
    ([3, 4], 'pass rate in [0.01, 0.9]: L3=0.53, L4=0.00 (its samples solved 0.08)')
    >>> pick_levels({2: 0.57, 3: 0.53, 4: 0.0}, 0.01, 0.9, 2, solved={3: 1.0, 4: 0.0})
    ([2, 3], 'pass rate in [0.01, 0.9]: L2=0.57, L3=0.53')
    """
    solved = solved or {}

    def climbing(lv: int) -> bool:  # below the floor held out, above it in the last round's samples
        return pass_rates[lv] < low <= solved.get(lv, 0.0)

    inside = sorted((lv for lv, r in pass_rates.items() if (low <= r or climbing(lv)) and r <= high),
                    reverse=True)[:max_levels]
    if inside:
        inside.sort()
        desc = ", ".join(f"L{lv}={pass_rates[lv]:.2f}" + (f" (its samples solved {solved[lv]:.2f})"
                                                            if climbing(lv) else "") for lv in inside)
        return inside, f"pass rate in [{low}, {high}]: {desc}"
    unmastered = sorted(lv for lv, r in pass_rates.items() if r < high)
    if unmastered:
        return [unmastered[0]], f"fallback: no level in [{low}, {high}]; easiest unmastered level {unmastered[0]}"
    hardest = max(pass_rates)
    return [hardest], f"fallback: every level mastered; hardest level {hardest}"
