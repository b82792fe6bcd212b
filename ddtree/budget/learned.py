"""What a generator's ``"auto"`` calls learn and hand on.

The cost table is shared live: every round of every call measures the same machine. The rest is a call's
own while it runs and handed to the next call when it ends (:meth:`Learned.hand_on`): the drafter's depth
calibration, tokens per row by key, the lagging row's share by batch, and the back-off schedules. A call
starts from a copy (:meth:`Learned.start`), so calls interleaved on one generator decide as each would alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ddtree.budget.acceptance import Calibration, Moments, PromptSpread
from ddtree.budget.backoff import Backoff
from ddtree.budget.costs import Estimate, Key, RoundCosts
from ddtree.budget.settings import Settings


@dataclass
class Carried:
    """One call's priors and schedules (see the module docstring)."""

    calibration: Calibration = field(default_factory=Calibration)
    tokens: dict[Key, Estimate] = field(default_factory=dict)  # committed tokens per row of a drafting round
    lagging: dict[int, float] = field(default_factory=dict)  # batch -> the lagging row's share of the mean
    retries: dict[Key, Backoff] = field(default_factory=dict)  # when the losing option is tried again
    neighbours: dict[Key, Backoff] = field(default_factory=dict)  # when a neighbour of the best is tried
    spread: dict[int, PromptSpread] = field(default_factory=dict)  # batch -> calls' tokens per row, apart


class Learned:
    """The cost table and what the last call handed on."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.costs = RoundCosts(settings)
        self.carried = Carried()

    def start(self) -> Carried:
        """A call's own copy; the per-call parts of the retry schedules (what it has seen) start blank."""
        own = copy.deepcopy(self.carried)
        for b in own.retries.values():
            b.plain_won = b.reference = None
        return own

    def hand_on(self, own: Carried, rounds: Moments | None = None, batch: int = 1) -> None:
        """A call ended: its figures seed the next; ``rounds`` (its tokens per row by drafting round, at
        ``batch``) joins the spread of calls."""
        spread, self.carried = self.carried.spread, copy.deepcopy(own)
        self.carried.spread = spread  # every call's, not only those this one saw
        if rounds is not None:
            spread.setdefault(batch, PromptSpread()).add(rounds)
