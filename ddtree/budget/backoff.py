"""One back-off schedule for everything the policy tries that it is not doing: the losing option (plain
or drafting) and the neighbours of the best budget. A try that confirms the choice doubles the wait; a
change (the cost table saw the load move, the winner changed) starts it again at ``first_interval``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddtree.budget.settings import Settings


@dataclass
class Backoff:
    """``left`` rounds until the next try, ``interval`` the wait after it, ``shifts`` the cost table's lasting
    changes at this key when last looked at. As a retry schedule it also counts the key's rounds
    (``visits``) and the visit at which each option last ran (``plain_at``, ``drafted_at``), the winner and
    and plain's rate when it last moved (``reference``)."""

    interval: int = 2
    left: int = 2
    shifts: int = 0
    visits: int = 0
    plain_at: int = 0
    drafted_at: int = 0
    plain_won: bool | None = None
    reference: float | None = None

    def tick(self) -> bool:
        """Count a round; whether a try is due."""
        self.left -= 1
        return self.left <= 0

    def restart(self, first: int) -> None:
        self.interval, self.left = first, min(self.left, first)

    def tried(self, interval: int) -> None:
        self.interval = self.left = interval

    def moved(self, shifts: int) -> bool:
        """Whether the cost table's shift count changed since the last look (and look now)."""
        moved, self.shifts = shifts != self.shifts, shifts
        return moved

    def ran(self, plain: bool) -> None:
        """A round ran at this key (a plain one or a drafting one)."""
        self.visits += 1
        if plain:
            self.plain_at = self.visits
        else:
            self.drafted_at = self.visits

    def since(self, plain: bool) -> int:
        """Rounds at this key since the option last ran here."""
        return self.visits - (self.plain_at if plain else self.drafted_at)


def spaced(interval: int, rate: float, other: float, s: Settings,
           seconds: float | None = None, other_seconds: float | None = None) -> int:
    """At least ``interval`` (at most ``retry_every``), and enough rounds that one try of the loser costs at most
    ``retry_cost`` of them: the loser's rate loss times its round's length over the winner's, over the cost."""
    loss = 1.0 - min(rate, other) / max(rate, other, 1e-12)
    length = 1.0
    if seconds is not None and other_seconds is not None and min(seconds, other_seconds) > 0:
        winner, loser = (seconds, other_seconds) if rate >= other else (other_seconds, seconds)
        length = loser / winner
    return int(min(s.retry_every, max(interval, math.ceil(loss * length / s.retry_cost - 1e-9))))
