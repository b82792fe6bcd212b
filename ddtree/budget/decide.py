"""The decision: from priced candidates to a budget and the reason for it. Pure functions, no state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FIRST = "first measurement"  # nothing measured here yet: measure the cheap option first
BEST = "best rate"  # the highest expected committed tokens per second among measured options
EXPLORE = "explore"  # a neighbour of the best budget, on its back-off schedule
RETRY = "retry"  # the losing option (plain or drafting), on its back-off schedule
FIXED = "fixed"  # a fixed budget
REASONS = (FIRST, BEST, EXPLORE, RETRY, FIXED)


@dataclass(frozen=True)
class Decision:
    """``budget`` draft nodes (0: a plain step), ``reason`` one of :data:`REASONS`, and the best measured
    budget (``None`` when none is measured)."""

    budget: int
    reason: str
    best: int | None = None


def plain_or_draft(plain: float | None, drafted: float | None, retry_due: bool) -> Decision:
    """Before drafting: ``budget`` 0 for a plain step, 1 for drafting (its size chosen with the proposal), from
    the measured rates (tokens per second; ``None``: never measured) and whether the loser's retry is due."""
    if plain is None:
        return Decision(0, FIRST)
    if drafted is None:
        return Decision(1, FIRST)
    plain_wins = plain >= drafted
    return Decision(int(plain_wins == retry_due), RETRY if retry_due else BEST)


def decide(seconds: Mapping[int, float], expected: Mapping[int, float], start: int,
           explore: Mapping[int, int] | None = None) -> Decision:
    """The budget of highest ``expected[n] / seconds[n]`` among the measured candidates (``seconds``; ties to
    the smaller), or ``explore[best]`` when a try of a neighbour is due, or ``start`` when none is measured."""
    rates = {n: expected[n] / s for n, s in seconds.items() if n in expected}
    if not rates:
        return Decision(start, FIRST)
    best = max(rates, key=lambda n: (rates[n], -n))
    if explore is not None and explore.get(best, best) != best:
        return Decision(explore[best], EXPLORE, best)
    return Decision(best, BEST, best)
