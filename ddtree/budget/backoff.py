"""One back-off schedule for everything the policy tries that it is not doing: the losing option (plain
or drafting) and the neighbours of the best budget. A try that confirms the choice doubles the wait; a
change (the cost table saw the load move, the winner changed) starts it again at ``first_interval``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddtree.budget.settings import Settings

Seconds = tuple[float | None, float | None]  # (plain round, drafting round)


@dataclass
class Backoff:
    """``left`` rounds until the next try, ``interval`` the wait after it, ``shifts`` the cost table's lasting
    changes at this key when last looked at. As a retry schedule it also counts the key's rounds
    (``visits``) and the visit at which each option last ran (``plain_at``, ``drafted_at``), the winner
    (``plain_won``) and plain's rate when it last moved (``reference``)."""

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
        self.plain_at, self.drafted_at = (self.visits, self.drafted_at) if plain else (self.plain_at, self.visits)

    def since(self, plain: bool) -> int:
        """Rounds at this key since the option last ran here."""
        return self.visits - (self.plain_at if plain else self.drafted_at)

    def retry_interval(self, plain: float, drafted: float, shifts: int, s: Settings, seconds: Seconds) -> int:
        """The wait before the loser's retry (rates in tokens per second): back to the first when the cost table
        shifted or a winning plain rate moved by ``load_moved``; spaced anew when the winner changed."""
        plain_wins = plain >= drafted
        if self.plain_won is None:
            self.plain_won, self.shifts, self.reference = plain_wins, shifts, plain
        moved, flipped = plain_wins and load_moved(self.reference, plain, s), self.plain_won != plain_wins
        if self.moved(shifts) or moved:
            self.interval = s.first_interval
        elif flipped:
            self.interval = spaced(s.first_interval, plain, drafted, s, *seconds)
        self.reference, self.plain_won = plain if moved or flipped else self.reference, plain_wins
        self.interval = self.interval or spaced(s.first_interval, plain, drafted, s, *seconds)
        return self.interval

    def retried(self, plain: float, drafted: float, plain_won: bool, fresh: bool, shifts: int, s: Settings,
                seconds: Seconds) -> bool:
        """After a retry (``plain_won``: the winner before it): the wait doubles while the winner holds (not on a
        call's ``fresh`` first try of its own prompts), starts again when the other wins. Returns whether plain
        took over on a rate the load moved: drafting's figure is from another load, to be measured again."""
        interval, reference = self.interval or s.first_interval, plain if self.reference is None else self.reference
        plain_wins = plain >= drafted
        if plain_wins != plain_won:
            interval = s.first_interval
        elif not fresh:
            interval = 2 * interval
        stale = plain_wins and not plain_won and load_moved(reference, plain, s)
        self.interval = interval if stale else spaced(interval, plain, drafted, s, *seconds)
        self.plain_won, self.reference = plain_wins, plain
        self.moved(shifts)
        return stale


def load_moved(reference: float | None, plain: float, s: Settings) -> bool:
    """Plain's rate is one token per row per round, so a move of it by ``load_moved`` is the load's."""
    return reference is not None and not reference / s.load_moved <= plain <= reference * s.load_moved


def spaced(interval: int, rate: float, other: float, s: Settings,
           seconds: float | None = None, other_seconds: float | None = None) -> int:
    """At least ``interval`` (at most ``retry_every``), and enough rounds that one try of the loser costs at most
    ``retry_cost`` of them: the loser's rate loss times its round's length over the winner's, over the cost."""
    loss, length = 1.0 - min(rate, other) / max(rate, other, 1e-12), 1.0
    if seconds is not None and other_seconds is not None and min(seconds, other_seconds) > 0:
        length = other_seconds / seconds if rate >= other else seconds / other_seconds
    return int(min(s.retry_every, max(interval, math.ceil(loss * length / s.retry_cost - 1e-9))))
