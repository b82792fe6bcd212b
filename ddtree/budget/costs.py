"""The cost table: seconds of rounds by kind, node count, batch and context bucket, learned from the rounds.

Kinds: ``verify`` (the target forward over ``nodes`` nodes per row), ``overhead`` (the rest of a drafting
round), ``plain`` (a whole round that does not draft) and ``drafted`` (a whole drafting round of the policy's
own choice), one :class:`Estimate` each. A key never measured reads the nearest measured one (context bucket
and batch; verify at the same total node count). ``shifts`` counts each key's lasting changes (the drift rule):
an event the policy's schedules watch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ddtree.budget.settings import Settings

Key = tuple[int, int]  # (context bucket, batch)
KINDS = ("overhead", "plain", "drafted")


class Estimate:
    """A running mean robust to outliers: a lone surprise (over ``outlier`` times off) is skipped, ``drift_after``
    in a row on one side are a lasting change (the value moves to their median); a value last updated over
    ``stale_after`` rounds ago, or marked ``expired``, is replaced outright by the next one."""

    def __init__(self, weight: float, outlier: float = math.inf, drift_after: int = 1,
                 stale_after: int = 1 << 62) -> None:
        self.weight, self.outlier, self.drift_after, self.stale_after = weight, outlier, drift_after, stale_after
        self.value: float | None = None
        self.count, self.stamp, self.changed_at = 0, -1, -1  # stamp: last measured; changed_at: last change began
        self.averaging = self.expired = False  # averaging: a plain mean of the first 1 / weight values
        self._surprises: list[float] = []
        self._first_surprise = -1

    @classmethod
    def seconds(cls, s: Settings) -> Estimate:
        return cls(s.weight, s.outlier, s.drift_after, s.stale_after)

    def update(self, value: float, stamp: int) -> bool:
        """Take one measurement at round ``stamp``; whether the value moved to a lasting change."""
        stale = stamp - self.stamp > self.stale_after or self.expired
        self.stamp, self.expired, self.count = stamp, False, self.count + 1
        if self.value is None or stale:
            self.value = value
            self._surprises.clear()
            return False
        ratio = value / max(self.value, 1e-12)
        if not 1.0 / self.outlier <= ratio <= self.outlier:
            if self._surprises and (self._surprises[-1] > self.value) != (value > self.value):
                self._surprises.clear()  # a surprise on the other side: the run is broken
            if not self._surprises:
                self._first_surprise = stamp
            self._surprises.append(value)
            if len(self._surprises) < self.drift_after:
                return False
            self.value, self.changed_at = sorted(self._surprises)[len(self._surprises) // 2], self._first_surprise
            self._surprises.clear()
            return True
        self._surprises.clear()
        self.value += (max(self.weight, 1.0 / self.count) if self.averaging else self.weight) * (value - self.value)
        return False


def context_bucket(context: int, minimum: int = 64) -> int:
    """The power of two (at least ``minimum``) a context length is priced at."""
    return max(minimum, 1 << max(0, int(context)).bit_length())


def interpolate(table: dict[int, float], nodes: float) -> float | None:
    """Seconds at ``nodes`` from measured ``{nodes: seconds}``: linear between points, flat below the
    smallest, the last two points' slope (at least 0) above the largest, proportional from a single point."""
    if not table:
        return None
    xs = sorted(table)
    if nodes <= xs[0]:
        return table[xs[0]]
    if len(xs) == 1:
        return table[xs[0]] * nodes / xs[0]
    b = next((x for x in xs if x >= nodes), xs[-1])
    a = xs[xs.index(b) - 1]
    slope = (table[b] - table[a]) / (b - a)
    return table[b] + max(0.0, slope) * (nodes - b) if nodes > b else table[a] + slope * (nodes - a)


class RoundCosts:
    """Learned seconds of verify, overhead, plain and drafting rounds; one per model on a machine (a generator
    keeps one and every call shares it)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.verify: dict[Key, dict[int, Estimate]] = {}
        self.overhead: dict[Key, Estimate] = {}
        self.plain: dict[Key, Estimate] = {}
        self.drafted: dict[Key, Estimate] = {}
        self.shifts: dict[Key, int] = {}
        self.visits: dict[Key, int] = {}  # rounds recorded at each key: staleness counts a key's own rounds
        self.rounds = 0

    def key(self, batch: int, context: int) -> Key:
        return (context_bucket(context, self.settings.context_floor), int(batch))

    def _record(self, table: dict[Key, Estimate], key: Key, seconds: float, stamp: int) -> bool:
        return table.setdefault(key, Estimate.seconds(self.settings)).update(seconds, stamp)

    def _stamp(self, key: Key) -> int:
        self.rounds += 1
        self.visits[key] = self.visits.get(key, 0) + 1
        return self.visits[key]

    def record_tree(self, nodes: int, batch: int, context: int, round_seconds: float, verify_seconds: float,
                    chosen: bool = True) -> None:
        """A drafting round over ``nodes`` nodes per row; ``chosen``: the policy's own choice (not a try of a
        neighbour), whose round seconds price drafting against plain rounds."""
        key = self.key(batch, context)
        stamp, table = self._stamp(key), self.verify.setdefault(key, {})
        entry = table.setdefault(int(nodes), Estimate.seconds(self.settings))
        before = entry.value
        moved = entry.update(verify_seconds, stamp)
        if moved and before and entry.value is not None:  # counts measured before the change follow it
            for other in table.values():
                if other is not entry and other.value is not None and other.stamp < entry.changed_at:
                    other.value *= entry.value / before
        moved |= self._record(self.overhead, key, max(0.0, round_seconds - verify_seconds), stamp)
        if chosen:
            self._record(self.drafted, key, round_seconds, stamp)
        self.shifts[key] = self.shifts.get(key, 0) + int(moved)

    def record_plain(self, batch: int, context: int, round_seconds: float) -> None:
        key = self.key(batch, context)
        self.shifts[key] = self.shifts.get(key, 0) + int(self._record(self.plain, key, round_seconds,
                                                                      self._stamp(key)))

    def expire(self, batch: int, context: int, plain: bool) -> None:
        """The next round of this kind here replaces its seconds outright (one round under a new load would be
        taken for an outlier)."""
        entry = (self.plain if plain else self.drafted).get(self.key(batch, context))
        if entry is not None:
            entry.expired = True

    def samples(self, plain: bool) -> int:
        """The most rounds behind a kind's seconds at any key (1: only the first, which paid first-call costs)."""
        return max((e.count for e in (self.plain if plain else self.drafted).values()), default=0)

    def verify_seconds(self, nodes: int, batch: int, context: int) -> tuple[float | None, bool]:
        """Seconds of a verify over ``nodes`` nodes per row, interpolated at the nearest measured key (at the same
        total node count), and whether they count as measured: at most the largest measured count (below the
        smallest, its seconds once two counts show the slope)."""
        near = nearest(self.verify, self.key(batch, context))
        if near is None:
            return None, False
        table = {n: e.value for n, e in self.verify[near].items() if e.value is not None}
        x = nodes * batch / near[1]
        return interpolate(table, x), x <= max(table) and (len(table) > 1 or x >= min(table))

    def verify_stamps(self, batch: int, context: int) -> dict[int, int]:
        """``{nodes: round}`` of the verify forwards measured at exactly this key."""
        return {n: e.stamp for n, e in self.verify.get(self.key(batch, context), {}).items()}

    def seconds(self, kind: str, batch: int, context: int) -> float | None:
        """A round's (``plain``, ``drafted``) or a drafting round's ``overhead`` seconds here, else at the nearest
        key as they are (a guess that errs is corrected by the kind's first round here)."""
        table: dict[Key, Estimate] = getattr(self, kind)
        near = nearest(table, self.key(batch, context))
        return None if near is None else table[near].value

    def describe(self) -> dict[str, Any]:
        def secs(table: dict[Any, Estimate]) -> dict[str, float | None]:
            return {_label(k): None if e.value is None else round(e.value, 6) for k, e in sorted(table.items())}

        return {"rounds": self.rounds, "verify_seconds": {_label(k): secs(t) for k, t in sorted(self.verify.items())},
                **{f"{kind}_seconds": secs(getattr(self, kind)) for kind in KINDS}}


def _label(key: Key | int) -> str:
    return f"{key[0]}x{key[1]}" if isinstance(key, tuple) else str(key)


def nearest(measured: Iterable[Key], key: Key) -> Key | None:
    """``key`` if measured, else the measured key closest in log2 context bucket and log2 batch."""
    known = list(measured)
    if key in known or not known:
        return key if known else None
    return min(known, key=lambda k: (abs(math.log2(k[0] / key[0])) + abs(math.log2(k[1] / key[1])), k))
