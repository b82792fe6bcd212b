"""Every constant of ``tree_budget="auto"``, in one frozen dataclass, each with why it has its value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """What :class:`~ddtree.budget.policy.AutoBudget` may change per instance (``AutoBudget(**overrides)``)."""

    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    """Budgets priced each round: doublings, so a hill-climb step is one neighbour and the table stays small."""
    start: int = 4
    """Node total of the first tree, shared by the rows: a verify costs about the batch's node count."""
    weight: float = 0.3
    """How far one round moves a seconds estimate: a few rounds follow a change, one noisy round does not."""
    outlier: float = 1.6
    """A round this many times off its estimate is a surprise (a paused process), not a measurement."""
    drift_after: int = 3
    """Surprises in a row on one side that make a lasting change (load came or went), not outliers."""
    stale_after: int = 8
    """Rounds after which an estimate is replaced outright: what it measured may be gone."""
    tokens_weight: float = 0.15
    """A tokens-per-round mean moves by at least this: acceptance varies round to round, more than seconds do."""
    prior_rounds: float = 1.0
    """The depth calibration's prior, in rounds at ratio 1: the drafter's own probabilities until rounds tell."""
    forget: float = 0.97
    """Per-round decay of the depth calibration: about 30 rounds of memory, so it follows a change of prompts."""
    first_interval: int = 2
    """Rounds before the first (or a restarted) try of what the policy is not doing: soon, but not every round."""
    explore_every: int = 16
    """Longest wait between tries of a neighbour of the best budget: a change of load is still found."""
    retry_every: int = 128
    """Longest wait between retries of the losing option (plain or drafting)."""
    retry_cost: float = 0.01
    """A retry waits long enough that it costs at most this share of the rounds' time."""
    acceptance_prior: float = 16.0
    """Most rounds earlier calls' acceptance may count as: a call's own rounds soon outweigh it."""
    load_moved: float = 1.25
    """A winning plain rate moved by this factor means the load moved: the loser is retried soon."""
    min_generations: int = 3
    """Calls behind a spread before it weighs a prior: two means say nothing of their spread's spread."""
    unlike_sigmas: float = 3.0
    """A call whose own mean lies this many standard deviations off earlier calls' drops their prior."""
    unlike_after: int = 3
    """A call's own drafting rounds before its mean is judged against earlier calls' (fewer are mostly luck)."""
    min_rounds: int = 4
    """Drafting rounds before a call's own figures tell (its lagging row, its place in the spread)."""
    context_floor: int = 64
    """Smallest context bucket: short contexts cost alike."""

    def __post_init__(self) -> None:
        if not self.candidates or any(int(c) < 1 for c in self.candidates):
            raise ValueError(f"candidates must be non-empty tree budgets >= 1 (a plain step is always a choice), "
                             f"got {self.candidates!r}")
        for name in ("explore_every", "retry_every"):
            if getattr(self, name) < self.first_interval:
                raise ValueError(f"{name} must be >= {self.first_interval} rounds, got {getattr(self, name)!r}")
