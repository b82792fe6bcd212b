"""Every constant of ``tree_budget="auto"``, in one frozen dataclass, each with why it has its value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """What :class:`~ddtree.budget.policy.AutoBudget` may change per instance (``AutoBudget(**overrides)``)."""

    # Budgets priced each round: doublings, so a hill-climb step is one neighbour and the table stays small.
    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    start: int = 4  # node total of the first tree, shared by the rows: a verify costs about the batch's nodes
    weight: float = 0.3  # how far a round moves a seconds estimate: a few rounds follow a change, one does not
    outlier: float = 1.6  # a round this many times off its estimate is a surprise (a paused process)
    drift_after: int = 3  # surprises in a row on one side that are a lasting change of load, not outliers
    stale_after: int = 8  # a key's rounds after which an estimate is replaced outright: what it measured may be gone
    tokens_weight: float = 0.15  # least move of a tokens mean: acceptance varies round to round more than seconds
    prior_rounds: float = 1.0  # the depth calibration's prior, rounds at ratio 1: the drafter's own probabilities
    forget: float = 0.97  # per-round decay of the depth calibration and of a poor stretch's tokens mean: ~30
    # rounds of memory, they follow the text
    first_interval: int = 2  # rounds before a first (or restarted) try of what the policy is not doing
    explore_every: int = 16  # longest wait between tries of a neighbour of the best: a change is still found
    retry_every: int = 128  # longest wait between retries of the losing option (plain or drafting)
    retry_cost: float = 0.01  # a retry waits long enough that it costs at most this share of the rounds' time
    acceptance_prior: float = 16.0  # most rounds earlier calls' acceptance counts as: a call's own soon outweigh it
    load_moved: float = 1.25  # a winning plain rate moved by this factor: the load moved, retry the loser soon
    min_generations: int = 3  # calls behind a spread before it weighs a prior: two means tell no spread
    unlike_sigmas: float = 3.0  # a call this many standard deviations off earlier calls' mean drops their prior
    unlike_after: int = 3  # a call's own drafting rounds before its mean is judged (fewer are mostly luck)
    min_rounds: int = 4  # drafting rounds before a call's own figures tell (its lagging row, its place in the spread)
    context_floor: int = 64  # smallest context bucket: short contexts cost alike

    def __post_init__(self) -> None:
        if not self.candidates or any(int(c) < 1 for c in self.candidates):
            raise ValueError(f"candidates must be non-empty tree budgets >= 1 (a plain step is always a choice), "
                             f"got {self.candidates!r}")
        for name in ("explore_every", "retry_every"):
            if getattr(self, name) < self.first_interval:
                raise ValueError(f"{name} must be >= {self.first_interval} rounds, got {getattr(self, name)!r}")
