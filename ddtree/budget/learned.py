"""What a generator's ``"auto"`` calls learn and hand on.

The cost table is shared live: every round of every call measures the same machine. The rest is a call's
own while it runs and handed to the next call when it ends (:meth:`Learned.hand_on`): the drafter's depth
calibration, tokens per row by key, the lagging row's share by batch, and the back-off schedules. A call
starts from a copy (:meth:`Learned.start`), so calls interleaved on one generator decide as each would alone.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddtree.budget.acceptance import Calibration, PromptSpread
from ddtree.budget.backoff import Backoff
from ddtree.budget.costs import Estimate, Key, RoundCosts, _name, key_of
from ddtree.budget.settings import Settings
from ddtree.budget.shrink import Moments


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
            b.plain_won = b.reference = b.held = None
        return own

    def hand_on(self, own: Carried, rounds: Moments | None = None, batch: int = 1) -> None:
        """A call ended: its figures seed the next; ``rounds`` (its tokens per row by drafting round, at
        ``batch``) joins the spread of calls."""
        spread, self.carried = self.carried.spread, copy.deepcopy(own)
        self.carried.spread = spread  # every call's, not only those this one saw
        if rounds is not None:
            spread.setdefault(batch, PromptSpread()).add(rounds)

    def to_dict(self) -> dict[str, Any]:
        c = self.carried
        return {"costs": self.costs.to_dict(),
                "spread": {str(b): asdict(p) for b, p in sorted(c.spread.items())},
                "calibration": {"reached": c.calibration.reached.tolist(),
                                "predicted": c.calibration.predicted.tolist()},
                "tokens": {_name(k): e.to_dict() for k, e in sorted(c.tokens.items())},
                "lagging": {str(b): s for b, s in sorted(c.lagging.items())},
                "retries": {_name(k): asdict(b) for k, b in sorted(c.retries.items())},
                "neighbours": {_name(k): asdict(b) for k, b in sorted(c.neighbours.items())}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], settings: Settings | None = None) -> Learned:
        s = settings or Settings()
        learned = cls(s)
        learned.costs = RoundCosts.from_dict(data["costs"], s)
        cal = data["calibration"]
        learned.carried = Carried(
            Calibration(torch.tensor(cal["reached"], dtype=torch.float64),
                        torch.tensor(cal["predicted"], dtype=torch.float64)),
            {key_of(k): Estimate(s.tokens_weight).load(e) for k, e in data["tokens"].items()},
            {int(b): float(v) for b, v in data["lagging"].items()},
            {key_of(k): Backoff(**b) for k, b in data["retries"].items()},
            {key_of(k): Backoff(**b) for k, b in data["neighbours"].items()},
            {int(b): PromptSpread(Moments(**p["means"]), p["within"], p["noise"]) for b, p in data["spread"].items()})
        return learned

    def save(self, path: str | Path) -> None:
        """Write as JSON, atomically (readers see the old file or the new one): a seed for a later run of the
        same model on the same machine."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path, settings: Settings | None = None) -> Learned:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), settings)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read learned budget costs from {path}: {exc}; delete the file or save a new "
                             "one with Learned.save") from exc
