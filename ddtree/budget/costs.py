"""Round costs learned from the rounds themselves: no profiling stall, and they follow load that changes.

Every round's own seconds feed one table (:class:`RoundCosts`), keyed by the context bucket
(powers of two, see :func:`~ddtree.budget.latency.context_bucket`) and the batch:

- ``verify[nodes]``: the target forward over a tree of ``nodes`` nodes per row;
- ``overhead``: the rest of a drafting round (draft, tree build, mask, commit, emit);
- ``plain``: a whole round that does not draft (one token per row);
- ``drafted``: a whole drafting round, its seconds and its committed tokens (all rows): their ratio is the
  measured rate of drafting that the policy compares with plain rounds';
- ``intervals``: how many rounds the policy waits before trying the option that is losing again (its
  retry schedule, shared so that a later generation does not start by re-trying it);
- ``neighbours``: when the policy next tries a budget next to the best one (:class:`Schedule`, shared for
  the same reason: a generation of 30-60 rounds that restarted it would spend a tenth of them exploring);
- ``reached``, ``predicted``: the policy's calibration of the drafter's path probabilities by depth (the
  pair's, not the machine's, but learned alongside and shared the same way);
- ``shifts``: how many lasting changes (the drift rule) the round seconds here have seen: a new one
  means the load moved, and the policy retries soon;
- ``visits``, ``tried``: rounds run at each key, and the visit at which a plain and a drafting round last ran
  there: the policy's retry intervals count a key's own rounds, so a generation that passes through many
  keys (rows finishing one by one, the context growing) retries no more often than one that stays in one;
- ``lagging``: by batch size, the share of a drafting round's mean tokens that the row which lags gets
  (:mod:`ddtree.budget.rows`), as the last call at that size measured it: the next call's price until its own
  drafting rounds tell.

Each entry is an :class:`Estimate`: an exponentially weighted mean that skips a lone outlier
(a paused consumer, a page fault) but moves to a lasting change (a competing process starts or
stops) after ``drift_after`` surprises on the same side; when one verify count moves so, the counts
at that key last measured before the change follow by the same ratio (a table priced half under one
load and half under another picks the wrong tree). The first key's tokens per drafting round start
from what the policy expected of its first tree, as one round's worth, so one unlucky round does
not decide against drafting. A key never measured is read from the
nearest measured one (context bucket and batch, at the same total node count ``batch * nodes``).
A table can be saved and loaded as JSON to seed a later run on the same machine and model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ddtree.budget.latency import context_bucket


class Estimate:
    """Seconds of one kind of round, robust to outliers, following drift."""

    def __init__(self, weight: float = 0.3, outlier: float = 1.6, drift_after: int = 3, stale_after: int = 8) -> None:
        self.weight, self.outlier, self.drift_after, self.stale_after = weight, outlier, drift_after, stale_after
        self.value: float | None = None
        self.count = 0
        self.stamp = -1  # the round it was last measured in
        self.changed_at = -1  # the round the last lasting change began in (its first surprise)
        self._surprises: list[float] = []
        self._first_surprise = -1
        self.averaging = False  # a plain mean of the first 1 / weight values (a seeded prior counts as one)
        self.expired = False  # the next value replaces this one outright (see :meth:`RoundCosts.expire`)

    def update(self, seconds: float, stamp: int) -> bool:
        """``stamp`` counts rounds: a value last measured over ``stale_after`` rounds ago is replaced outright
        (what it measured may be gone: an entry tried only on the exploration schedule must follow load).
        Returns whether the value moved to a lasting change (the drift rule)."""
        stale = stamp - self.stamp > self.stale_after or self.expired
        self.stamp, self.expired = stamp, False
        self.count += 1
        if self.value is None or stale:
            self.value = seconds
            self._surprises.clear()
            return False
        ratio = seconds / max(self.value, 1e-12)
        if ratio > self.outlier or ratio * self.outlier < 1.0:
            if self._surprises and (self._surprises[-1] > self.value) != (seconds > self.value):
                self._surprises.clear()  # a surprise on the other side: the run of one side is broken
            if not self._surprises:
                self._first_surprise = stamp
            self._surprises.append(seconds)
            if len(self._surprises) >= self.drift_after:  # a lasting change, not an outlier
                self.value = sorted(self._surprises)[len(self._surprises) // 2]
                self._surprises.clear()
                self.changed_at = self._first_surprise
                return True
            return False
        self._surprises.clear()
        weight = max(self.weight, 1.0 / self.count) if self.averaging else self.weight
        self.value += weight * (seconds - self.value)
        return False

    def to_dict(self) -> dict:
        return {"value": self.value, "count": self.count, "stamp": self.stamp}

    @classmethod
    def from_dict(cls, data: dict, **options: Any) -> Estimate:
        e = cls(**options)
        e.value, e.count, e.stamp = float(data["value"]), int(data["count"]), int(data.get("stamp", -1))
        return e


Key = tuple[int, int]  # (context bucket, batch)


@dataclass
class Schedule:
    """A backing-off schedule at one key: ``left`` drafting rounds until the next try, ``interval`` the wait
    after it, ``shifts`` the key's lasting changes of round seconds when it was last looked at."""

    interval: int = 2
    left: int = 2
    shifts: int = 0


@dataclass
class PromptSpread:
    """How far generations' own tokens per row (per drafting round) lie apart at one batch size, against how
    much one generation's rounds vary: the rounds' worth a new generation's prior deserves (empirical Bayes).
    Prompts a drafter follows alike make a strong prior (a few unlucky rounds are luck); prompts it follows
    very differently, a weak one (a generation's own rounds soon tell)."""

    generations: int = 0
    mean: float = 0.0  # of the generations' means (Welford)
    m2: float = 0.0
    within: float = 0.0  # summed: each generation's variance of a round's tokens per row
    noise: float = 0.0  # summed: each generation's variance over its rounds (its mean's own noise)

    def add(self, mean: float, variance: float, rounds: int) -> None:
        self.generations += 1
        delta = mean - self.mean
        self.mean += delta / self.generations
        self.m2 += delta * (mean - self.mean)
        self.within += variance
        self.noise += variance / max(1, rounds)

    def variances(self) -> tuple[float, float] | None:
        """``(within, between)``: a round's variance within a generation, and the variance of generations' true
        means (their means' variance less its noise; may be <= 0); ``None`` before three generations tell."""
        if self.generations < 3:
            return None
        return (self.within / self.generations,
                self.m2 / (self.generations - 1) - self.noise / self.generations)

    def prior_rounds(self, most: float) -> float | None:
        """The prior's weight in rounds, in ``[1, most]`` (``None`` before three generations tell): one where a
        round varies not at all (it tells everything), ``most`` where generations lie no further apart than
        their noise."""
        spread = self.variances()
        if spread is None:
            return None
        within, between = spread
        if within <= 0:
            return 1.0
        if between <= 0:
            return most
        return min(most, max(1.0, within / between))

    def unlike(self, mean: float, rounds: int) -> bool:
        """Whether a generation's own mean over ``rounds`` lies outside what these generations make likely (3
        standard deviations of a true mean's spread plus its own noise): its prompts are not like theirs."""
        spread = self.variances()
        if spread is None or rounds < 1:
            return False
        within, between = spread
        return (mean - self.mean) ** 2 > 9.0 * (max(between, 0.0) + within / rounds)


class RoundCosts:
    """Learned seconds of verify, overhead and plain rounds by context bucket, batch and node count.

    One table describes a model on a machine, so a generator keeps one and every generation on it
    shares what was learned (``AutoBudget`` holds the per-generation choices).
    """

    def __init__(self, weight: float = 0.3, outlier: float = 1.6, drift_after: int = 3, stale_after: int = 8) -> None:
        self.options: dict[str, Any] = {"weight": weight, "outlier": outlier, "drift_after": drift_after,
                                        "stale_after": stale_after}
        self.verify: dict[Key, dict[int, Estimate]] = {}
        self.overhead: dict[Key, Estimate] = {}
        self.plain: dict[Key, Estimate] = {}
        self.drafted: dict[Key, Estimate] = {}  # seconds of a drafting round
        self.tokens: dict[Key, Estimate] = {}  # committed tokens of a drafting round (a plain mean: no outliers)
        self.intervals: dict[Key, int] = {}
        self.neighbours: dict[Key, Schedule] = {}
        self.shifts: dict[Key, int] = {}
        self.visits: dict[Key, int] = {}
        self.tried: dict[tuple[Key, str], int] = {}  # (key, "plain" | "drafted") -> visit when last run there
        self.lagging: dict[int, float] = {}  # batch -> the lagging row's share of a drafting round's mean tokens
        self.spread: dict[int, PromptSpread] = {}  # batch -> generations' tokens per row, apart and within
        self.reached: torch.Tensor | None = None  # the policy's depth calibration sums (see AutoBudget)
        self.predicted: torch.Tensor | None = None
        self.rounds = 0  # rounds recorded: each entry's stamp says how long ago it was measured

    @staticmethod
    def key(batch: int, context: int) -> Key:
        return (context_bucket(context), int(batch))

    # ------------------------------------------------------------------ recording

    def record_tree(self, nodes: int, batch: int, context: int, round_seconds: float, verify_seconds: float,
                    tokens: int | None = None, expected: float | None = None) -> None:
        """A drafting round over ``nodes`` nodes per row: its verify forward and the rest of the round, and the
        tokens it committed over all rows (when given). ``expected``: the tokens the policy expected of the
        round before it ran; where no key has measured tokens yet, it is their prior (one round's worth), so
        that one unlucky first round does not settle the comparison with plain rounds."""
        self.rounds += 1
        stamp = self.rounds
        key = self.key(batch, context)
        table = self.verify.setdefault(key, {})
        entry = table.setdefault(int(nodes), Estimate(**self.options))
        before = entry.value
        moved = entry.update(verify_seconds, stamp)
        if moved and before:  # the load changed: counts last measured before it follow by the same ratio
            for other in table.values():
                if other is not entry and other.value is not None and other.stamp < entry.changed_at:
                    other.value *= cast(float, entry.value) / before
        rest = max(0.0, round_seconds - verify_seconds)
        moved |= self.overhead.setdefault(key, Estimate(**self.options)).update(rest, stamp)
        self._visit(key, "drafted")
        if tokens is not None:
            self.drafted.setdefault(key, Estimate(**self.options)).update(round_seconds, stamp)
            if key not in self.tokens:
                seed = self._seed_tokens(key)
                if seed.value is None and expected is not None:
                    seed.value, seed.count, seed.averaging = float(expected), 1, True
                self.tokens[key] = seed
            self.tokens[key].update(float(tokens), stamp)
        self.shifts[key] = self.shifts.get(key, 0) + int(moved)

    def row_tokens_prior(self, batch: int, context: int, expected: float | None = None,
                         most: float = 1.0) -> Estimate:
        """A generation's tokens per row per drafting round, before its first. Once three generations at this
        batch size tell (:class:`PromptSpread`), their mean, counted as the rounds their spread is worth (at
        most ``most``; later rounds then move it by ``1 / rounds`` at least, not faster than the prior is
        worth); before that the nearest key's figure per row (else ``expected``, the tokens the policy expected
        of its first tree, over all rows), counted as one round."""
        mean = _mean()
        spread = self.spread.get(int(batch))
        rounds = None if spread is None else spread.prior_rounds(most)
        near = self._nearest(self.tokens, self.key(batch, context))
        count = 1
        if spread is not None and rounds is not None:
            mean.value, count = spread.mean, max(1, round(rounds))
        elif near is not None:
            mean.value = cast(float, self.tokens[near].value) / near[1]
        elif expected is not None:
            mean.value = float(expected) / batch
        if mean.value is not None:
            mean.count, mean.averaging, mean.weight = count, True, min(mean.weight, 1.0 / count)
        return mean

    def _seed_tokens(self, key: Key) -> Estimate:
        """A new key's tokens per drafting round start from the nearest key's, per row: one round's count
        alone is too noisy to compare rates with."""
        mean = _mean()
        near = self._nearest(self.tokens, key)
        if near is not None:
            mean.value = cast(float, self.tokens[near].value) * key[1] / near[1]
        return mean

    def record_plain(self, batch: int, context: int, round_seconds: float) -> None:
        """A round that did not draft."""
        self.rounds += 1
        key = self.key(batch, context)
        moved = self.plain.setdefault(key, Estimate(**self.options)).update(round_seconds, self.rounds)
        self.shifts[key] = self.shifts.get(key, 0) + int(moved)
        self._visit(key, "plain")

    def _visit(self, key: Key, kind: str) -> None:
        self.visits[key] = self.visits.get(key, 0) + 1
        self.tried[(key, kind)] = self.visits[key]

    def expire(self, batch: int, context: int, kind: str) -> None:
        """The next ``kind`` round here (``"plain"`` or ``"drafted"``) replaces its seconds outright: they were
        measured under a load that has since gone (one round under the new one would be taken for an outlier)."""
        entry = (self.plain if kind == "plain" else self.drafted).get(self.key(batch, context))
        if entry is not None:
            entry.expired = True

    def samples(self, kind: str) -> int:
        """The most rounds behind a ``kind`` rate (``"plain"`` or ``"drafted"``) at any key: 1 while only the
        first such round of this table's life has run (which also paid first-call costs: kernels, shapes)."""
        entries = self.plain if kind == "plain" else self.drafted
        return max((e.count for e in entries.values()), default=0)

    def since(self, batch: int, context: int, kind: str) -> int:
        """Rounds run at this key since a ``kind`` round (``"plain"`` or ``"drafted"``) last ran here (all of
        them when none ever did)."""
        key = self.key(batch, context)
        return self.visits.get(key, 0) - self.tried.get((key, kind), 0)

    # ------------------------------------------------------------------ reading

    def verify_table(self, batch: int, context: int) -> tuple[dict[int, float], float]:
        """``{nodes: seconds}`` measured at this batch and context, else at the nearest measured key, and the
        factor that maps a node count here to the same total node count there (``batch / its batch``)."""
        key = self.key(batch, context)
        near = self._nearest(self.verify, key)
        if near is None:
            return {}, 1.0
        table = _values(self.verify[near])
        others = {k: v for k, v in self.verify.items() if k != near and k[1] == near[1]}
        other = self._nearest(others, near)
        if other is not None:  # node counts not measured in this bucket: the nearest bucket's, rescaled
            theirs = _values(self.verify[other])
            common = sorted(table[n] / theirs[n] for n in set(table) & set(theirs))
            ratio = common[len(common) // 2] if common else 1.0
            for n, v in theirs.items():
                table.setdefault(n, v * ratio)
        return table, key[1] / near[1]

    def verify_stamps(self, batch: int, context: int) -> dict[int, int]:
        """``{nodes: round}`` of the verify forwards measured at exactly this batch and context bucket."""
        return {n: e.stamp for n, e in self.verify.get(self.key(batch, context), {}).items()}

    def verify_changed(self, nodes: int, batch: int, context: int) -> int:
        """The round the last lasting change of this verify forward's seconds began in (-1: none seen): node
        counts measured before it were measured under another load."""
        entry = self.verify.get(self.key(batch, context), {}).get(int(nodes))
        return -1 if entry is None else entry.changed_at

    def verify_seconds(self, nodes: int, batch: int, context: int) -> float | None:
        """Interpolated in the node count; below the smallest measured count, its seconds; above the largest,
        extrapolated from the last two (never decreasing), or proportionally from a single one."""
        table, scale = self.verify_table(batch, context)
        return interpolate(table, nodes * scale)

    def verify_known(self, nodes: int, batch: int, context: int) -> bool:
        """Whether ``nodes`` lies within the measured node counts (interpolated, not extrapolated)."""
        table, scale = self.verify_table(batch, context)
        return bool(table) and min(table) <= nodes * scale <= max(table)

    def overhead_seconds(self, batch: int, context: int) -> float | None:
        near = self._nearest(self.overhead, self.key(batch, context))
        return None if near is None else self.overhead[near].value

    def plain_estimate(self, batch: int, context: int) -> Estimate | None:
        """The plain-round estimate at this exact key (``None`` when never measured here)."""
        return self.plain.get(self.key(batch, context))

    def plain_rate(self, batch: int, context: int) -> tuple[float, int] | None:
        """Measured tokens per second of plain rounds here (else from the nearest measured key's round seconds,
        see :meth:`plain_seconds`) and the round they were last measured in."""
        seconds = self.plain_seconds(batch, context)
        near = self._nearest(self.plain, self.key(batch, context))
        if seconds is None or near is None:
            return None
        return batch / max(seconds, 1e-12), self.plain[near].stamp

    def drafted_rate(self, batch: int, context: int, row_tokens: float | None = None) -> tuple[float, int] | None:
        """Measured tokens per second of drafting rounds here (else at the nearest measured key, the same
        ratio to that key's plain rate) and the round they were last measured in. ``row_tokens``: committed
        tokens per row of a drafting round to price instead of the table's (a generation's own: acceptance
        belongs to the prompts, the seconds to the machine)."""
        key = self.key(batch, context)
        near = self._nearest(self.drafted, key)
        if near is None or (row_tokens is None and near not in self.tokens):
            return None
        tokens = cast(float, self.tokens[near].value) if row_tokens is None else row_tokens * near[1]
        rate = tokens / max(cast(float, self.drafted[near].value), 1e-12)
        if near != key:
            here, there = self.plain_rate(batch, context), self.plain_rate(near[1], near[0])
            if here is None or there is None:
                return None
            rate *= here[0] / there[0]
        return rate, self.drafted[near].stamp

    def round_seconds(self, batch: int, context: int) -> tuple[float | None, float | None]:
        """Seconds of a plain round and of a drafting round here (each ``None`` until measured somewhere): a
        drafting round's are its tokens here over its rate here, so both follow the nearest key as the rates do."""
        key = self.key(batch, context)
        near, rate = self._nearest(self.tokens, key), self.drafted_rate(batch, context)
        if near is None or rate is None:
            return self.plain_seconds(batch, context), None
        tokens = cast(float, self.tokens[near].value) * key[1] / near[1]
        return self.plain_seconds(batch, context), tokens / max(rate[0], 1e-12)

    def plain_seconds(self, batch: int, context: int) -> float | None:
        """A plain round's seconds here, else at the nearest measured key as they are: a plain step at a small
        batch is bound by reading the weights, so its seconds barely grow with the rows, and a guess that errs
        towards plain is corrected by plain's first round here (one that errs against it would not run it)."""
        near = self._nearest(self.plain, self.key(batch, context))
        return None if near is None else cast(float, self.plain[near].value)

    @staticmethod
    def _nearest(entries: dict, key: Key) -> Key | None:
        """``key`` if measured, else the measured key closest in log2 context bucket and log2 batch."""
        if key in entries and _has_value(entries[key]):
            return key
        known = [k for k, v in entries.items() if _has_value(v)]
        if not known:
            return None
        return min(known, key=lambda k: (abs(math.log2(k[0] / key[0])) + abs(math.log2(k[1] / key[1])), k))

    # ------------------------------------------------------------------ seeding

    def to_dict(self) -> dict:
        def name(k: Key) -> str:
            return f"{k[0]}x{k[1]}"

        return {
            "verify": {name(k): {str(n): e.to_dict() for n, e in sorted(t.items())}
                       for k, t in sorted(self.verify.items())},
            "overhead": {name(k): e.to_dict() for k, e in sorted(self.overhead.items())},
            "plain": {name(k): e.to_dict() for k, e in sorted(self.plain.items())},
            "drafted": {name(k): e.to_dict() for k, e in sorted(self.drafted.items())},
            "tokens": {name(k): e.to_dict() for k, e in sorted(self.tokens.items())},
            "intervals": {name(k): n for k, n in sorted(self.intervals.items())},
            "neighbours": {name(k): asdict(s) for k, s in sorted(self.neighbours.items())},
            "shifts": {name(k): n for k, n in sorted(self.shifts.items())},
            "visits": {name(k): n for k, n in sorted(self.visits.items())},
            "tried": {f"{name(k)}:{kind}": n for (k, kind), n in sorted(self.tried.items())},
            "lagging": {str(b): share for b, share in sorted(self.lagging.items())},
            "spread": {str(b): asdict(p) for b, p in sorted(self.spread.items())},
            "calibration": None if self.reached is None or self.predicted is None else {
                "reached": self.reached.tolist(), "predicted": self.predicted.tolist()},
            "rounds": self.rounds,
        }

    @classmethod
    def from_dict(cls, data: dict, **options: Any) -> RoundCosts:
        costs = cls(**options)

        def key(text: str) -> Key:
            bucket, batch = text.split("x")
            return (int(bucket), int(batch))

        for k, table in data.get("verify", {}).items():
            costs.verify[key(k)] = {int(n): Estimate.from_dict(e, **costs.options) for n, e in table.items()}
        for part in ("overhead", "plain", "drafted"):
            for k, e in data.get(part, {}).items():
                getattr(costs, part)[key(k)] = Estimate.from_dict(e, **costs.options)
        for k, e in data.get("tokens", {}).items():
            mean = _mean()
            mean.value, mean.count, mean.stamp = float(e["value"]), int(e["count"]), int(e.get("stamp", -1))
            costs.tokens[key(k)] = mean
        costs.intervals = {key(k): int(n) for k, n in data.get("intervals", {}).items()}
        costs.neighbours = {key(k): Schedule(**{f: int(v) for f, v in s.items()})
                            for k, s in data.get("neighbours", {}).items()}
        costs.shifts = {key(k): int(n) for k, n in data.get("shifts", {}).items()}
        costs.visits = {key(k): int(n) for k, n in data.get("visits", {}).items()}
        costs.tried = {(key(k.split(":")[0]), k.split(":")[1]): int(n) for k, n in data.get("tried", {}).items()}
        costs.lagging = {int(b): float(share) for b, share in data.get("lagging", {}).items()}
        costs.spread = {int(b): PromptSpread(**{f: type(v)(p[f]) for f, v in asdict(PromptSpread()).items()})
                        for b, p in data.get("spread", {}).items()}
        calibration = data.get("calibration")
        if calibration:
            costs.reached = torch.tensor(calibration["reached"], dtype=torch.float64)
            costs.predicted = torch.tensor(calibration["predicted"], dtype=torch.float64)
        costs.rounds = int(data.get("rounds", 0))
        return costs

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (a seed for a later run of the same model on the same machine)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> RoundCosts:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read a round-cost table from {path}: {exc}; delete the file or save a new "
                             "one with RoundCosts.save") from exc
        return cls.from_dict(data, **options)

    def describe(self) -> dict:
        def name(k: Key) -> str:
            return f"{k[0]}x{k[1]}"

        def secs(e: Estimate) -> float | None:
            return None if e.value is None else round(e.value, 6)

        return {
            "kind": "learned",
            "rounds": self.rounds,
            "verify_seconds": {name(k): {str(n): secs(e) for n, e in sorted(t.items())}
                               for k, t in sorted(self.verify.items())},
            "overhead_seconds": {name(k): secs(e) for k, e in sorted(self.overhead.items())},
            "plain_seconds": {name(k): secs(e) for k, e in sorted(self.plain.items())},
            "drafted_seconds": {name(k): secs(e) for k, e in sorted(self.drafted.items())},
            "drafted_tokens": {name(k): secs(e) for k, e in sorted(self.tokens.items())},
            "retry_intervals": {name(k): n for k, n in sorted(self.intervals.items())},
            "lagging_row_share": {str(b): round(share, 4) for b, share in sorted(self.lagging.items())},
            "prompt_spread": {str(b): _spread(p) for b, p in sorted(self.spread.items())},
        }


def _spread(spread: PromptSpread) -> dict:
    variances = spread.variances()
    return {"generations": spread.generations, "mean": round(spread.mean, 4),
            **({} if variances is None else {"within": round(variances[0], 4), "between": round(variances[1], 4)})}


TOKENS_WEIGHT = 0.15
"""A tokens-per-round mean moves by at least this per round once it has that many behind it."""


def _mean() -> Estimate:
    """A moving mean of tokens per round: never an outlier (acceptance varies round to round), never stale
    (a drafter's acceptance does not go away with load)."""
    return Estimate(weight=TOKENS_WEIGHT, outlier=math.inf, drift_after=1, stale_after=1 << 62)


def _values(table: dict[int, Estimate]) -> dict[int, float]:
    return {n: e.value for n, e in table.items() if e.value is not None}


def _has_value(entry: Estimate | dict[int, Estimate]) -> bool:
    if isinstance(entry, dict):
        return any(e.value is not None for e in entry.values())
    return entry.value is not None


def interpolate(table: dict[int, float], nodes: float) -> float | None:
    """Seconds at ``nodes`` from measured ``{nodes: seconds}``: linear between points, flat below the
    smallest, the last two points' slope (at least 0) above the largest, proportional from a single point."""
    if not table:
        return None
    xs = sorted(table)
    if nodes in table:
        return table[int(nodes)]
    if nodes < xs[0]:
        return table[xs[0]]
    if nodes > xs[-1]:
        if len(xs) == 1:
            return table[xs[0]] * nodes / xs[0]
        a, b = xs[-2], xs[-1]
        slope = max(0.0, (table[b] - table[a]) / (b - a))
        return table[b] + slope * (nodes - b)
    i = next(i for i, x in enumerate(xs) if x > nodes)
    a, b = xs[i - 1], xs[i]
    return table[a] + (table[b] - table[a]) * (nodes - a) / (b - a)
