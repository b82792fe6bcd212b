"""Spread against noise: how much of the differences between groups' means is real (empirical Bayes).

Used wherever the policy asks whether a figure differs from the others' by more than luck: a row that lags
its batch, a call's prompts against earlier calls'.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Moments:
    """Count, mean and summed squared deviation of values (Welford)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    @property
    def variance(self) -> float:
        """The sample variance (0 before two values)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0


def between(means: Moments, noise: float) -> float:
    """The variance of the groups' true means: their means' variance less ``noise``, each mean's own variance
    (may be <= 0: the groups are alike)."""
    return means.variance - noise


def shrink(value: float, centre: float, spread: float, noise: float) -> float:
    """``value`` pulled towards ``centre`` by how much of its distance ``noise`` (its own variance) explains
    against ``spread`` (the true values' variance): all the way when ``spread <= 0``."""
    if spread <= 0:
        return centre
    return centre + spread / (spread + noise) * (value - centre)
