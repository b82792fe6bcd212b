"""Which row of a batch lags: a call lasts until its last row is done, so drafting at batch > 1 is worth what
the row that finishes last gains from it."""

from __future__ import annotations

from collections.abc import Sequence


class RowProgress:
    """Each active row's tokens over the drafting rounds since the batch last lost a row (plain rounds move every
    row alike, so they leave the rows' order as it is), to price drafting by the row that lags.

    The lagging row (least tokens) is partly a row the drafter follows less and partly one that was unlucky;
    only the first kind will lag again. Its rate is its mean shrunk towards the batch's by how much of the
    spread between the rows' means their round-to-round noise explains (an empirical-Bayes estimate), so rows
    alike give the batch's mean."""

    def __init__(self, min_rounds: int = 4) -> None:
        self.min_rounds = max(2, min_rounds)
        self.sums: list[float] = []
        self.squares: list[float] = []
        self.rounds = 0

    def add(self, accepted: Sequence[int]) -> None:
        """One drafting round's accepted counts, one per active row in row order. Another number of rows (one
        finished; which one is not known here) starts the sums again."""
        counts = [float(a) for a in accepted]
        if len(counts) != len(self.sums):
            self.sums, self.squares, self.rounds = [0.0] * len(counts), [0.0] * len(counts), 0
        self.sums = [s + c for s, c in zip(self.sums, counts)]
        self.squares = [q + c * c for q, c in zip(self.squares, counts)]
        self.rounds += 1

    def lagging(self, batch: int) -> float | None:
        """The lagging row's expected tokens per drafting round over the batch's mean: 1.0 for one row, ``None``
        while fewer than ``min_rounds`` drafting rounds of these ``batch`` rows have run (too few to tell a
        slow row from an unlucky one)."""
        if batch < 2:
            return 1.0
        t, rows = self.rounds, len(self.sums)
        if rows != batch or t < self.min_rounds:
            return None
        means = [s / t for s in self.sums]
        mean = sum(means) / rows
        if mean <= 0:
            return 1.0
        noise = sum(q - s * s / t for s, q in zip(self.sums, self.squares)) / (rows * (t - 1))  # one round's
        between = max(0.0, sum((m - mean) ** 2 for m in means) / (rows - 1) - noise / t)
        if between <= 0:
            return 1.0
        shrunk = mean + between / (between + noise / t) * (min(means) - mean)
        return max(0.0, min(1.0, shrunk / mean))
