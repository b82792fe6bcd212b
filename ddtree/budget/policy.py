"""Budget policies: ``FixedBudget(n)``, and ``AutoBudget`` (``tree_budget="auto"``), glue over the cost table,
the acceptance model, the back-off schedules and the decision (one module each), its constants in ``Settings``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ddtree.budget.acceptance import COST_MODEL, CallTokens, Moments, RowProgress, TreePricer
from ddtree.budget.backoff import Backoff, spaced
from ddtree.budget.costs import nearest
from ddtree.budget.decide import EXPLORE, FIRST, FIXED, RETRY, Decision, decide, plain_or_draft
from ddtree.budget.learned import Learned
from ddtree.budget.settings import Settings
from ddtree.core.builders import TreeBuilder, best_first
from ddtree.core.tree import DraftTree
from ddtree.drafters.base import Proposal


class BudgetPolicy:
    """Chooses the tree budget each round; one instance serves one call. The round's calls, in order:

    - before drafting, :meth:`prepare`; while :attr:`skip_draft` is then true the round is one plain step;
    - with the proposal, :meth:`choose` (the budget) and :meth:`tree` (the tree for it, if the policy grew it);
    - after the round, :meth:`observe` (each row's accepted count, root included, and the verify's seconds),
      and :meth:`finish` once every row has stopped.

    :attr:`reason` says why the round's budget was chosen (it lands in ``out.stats.reasons``). Subclass it to
    inherit the defaults of everything but :meth:`choose`.
    """

    skip_draft: bool = False
    reason: str = "policy"

    def prepare(self, context_len: int, batch: int) -> None:
        return None

    def choose(self, proposal: Proposal, context_len: int) -> int:
        # the one method a policy must define: there is no default budget to fall back on
        raise NotImplementedError(f"{type(self).__name__} must define choose(proposal, context_len) -> budget")

    def tree(self, proposal: Proposal, roots: torch.Tensor, budget: int, builder: TreeBuilder) -> DraftTree | None:
        """The tree ``builder`` would grow from ``proposal`` under ``budget``, when :meth:`choose` grew it."""
        return None

    def deepest(self, context_len: int, batch: int) -> int | None:
        """The largest budget :meth:`choose` can return this round (``None``: any), asked before drafting: a
        best-first tree of ``n`` nodes is at most ``n`` deep, so the drafter need not score deeper positions."""
        return None

    def observe(self, accepted: Sequence[int], verify_seconds: float, context_len: int) -> None:
        return None

    def finish(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"policy": type(self).__name__}


class FixedBudget(BudgetPolicy):
    """The same budget every round."""

    reason = FIXED

    def __init__(self, budget: int) -> None:
        check_budget(budget)
        self.budget = budget

    def choose(self, proposal: Proposal, context_len: int) -> int:
        return self.budget

    def deepest(self, context_len: int, batch: int) -> int | None:
        return self.budget

    def describe(self) -> dict[str, Any]:
        return {"policy": "fixed", "budget": self.budget}


POLICY_PARTS = ("skip_draft", "reason", "prepare", "choose", "tree", "observe", "finish", "describe")


def check_budget(budget: object) -> None:
    """A budget is an int >= 0, ``"auto"`` or a :class:`BudgetPolicy`."""
    if isinstance(budget, str) and budget == "auto":
        return
    if hasattr(budget, "choose"):
        missing = [m for m in POLICY_PARTS if not hasattr(budget, m)]
        if missing:
            raise TypeError(f"{type(budget).__name__} is not a BudgetPolicy: it lacks {', '.join(missing)}; "
                            "subclass ddtree.BudgetPolicy to inherit their defaults")
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"tree_budget must be an int >= 0 (draft nodes per round; 0 = no drafting), 'auto' "
                         f"or a BudgetPolicy, got {budget!r}")


@dataclass
class _Round:
    """The round in flight, booked into the costs at the next :meth:`AutoBudget.prepare` (``fresh``: a retry of
    drafting for prompts this call never drafted; ``predicted``: the chosen tree's ``p_d`` per row)."""

    plain: bool
    batch: int
    context: int
    nodes: int = 1
    retry: bool = False
    fresh: bool = False
    explored: bool = False
    expected: float | None = None
    predicted: list[list[float]] | None = None
    verify: float | None = None
    tokens: int = 0


class AutoBudget(BudgetPolicy):
    """``tree_budget="auto"``: a plain step, or the budget of highest expected committed tokens per second.

    ``clock`` is read once per round, in :meth:`prepare` (inject a fake one to test); where it counts work
    (:func:`~ddtree.runtime.timing.work_clock`), ``wall_clock`` rescales the verify's wall seconds.
    ``overrides``: :class:`Settings` fields.
    """

    def __init__(self, builder: TreeBuilder = best_first, learned: Learned | None = None,
                 clock: Callable[[], float] = time.perf_counter, wall_clock: Callable[[], float] | None = None,
                 settings: Settings | None = None, **overrides: Any) -> None:
        unknown = set(overrides) - {f.name for f in fields(Settings)}
        if unknown:
            raise TypeError(f"AutoBudget got unknown settings {sorted(unknown)}; see ddtree.budget.settings.Settings")
        if "candidates" in overrides:
            overrides["candidates"] = tuple(sorted({int(c) for c in overrides["candidates"]}))
        self.settings = s = replace(settings or Settings(), **overrides)
        self.learned = learned if learned is not None else Learned(s)
        self.costs, self.carried = self.learned.costs, self.learned.start()
        self.clock, self.wall_clock, self.builder = clock, wall_clock, builder
        self.candidates = sorted(s.candidates)
        self.pricer = TreePricer(builder, self.candidates)
        self.rounds = 0
        self.choices: Counter[int] = Counter()
        self.reasons: Counter[str] = Counter()
        self.last: dict[str, Any] = {}
        self.best: int | None = None
        self._pending: _Round | None = None
        self._start: tuple[float, float | None] | None = None
        self.tokens = CallTokens(s, self.carried.spread, self.carried.tokens)
        self._rows = RowProgress(s.min_rounds)

    @classmethod
    def for_generator(cls, generator: Any, **options: Any) -> AutoBudget:
        """A policy for one call on ``generator``: its builder and what its earlier calls learned."""
        return cls(builder=generator.builder, learned=generator.learned, **options)

    @property
    def plain_rounds(self) -> int:
        return self.choices[0]

    @property
    def explorations(self) -> int:
        """Rounds that tried what the policy is not doing: the loser's retries and neighbours of the best."""
        return self.reasons[RETRY] + self.reasons[EXPLORE]

    # ------------------------------------------------------------------ before drafting

    def prepare(self, context_len: int, batch: int) -> None:
        """Book the round that just ended, then decide whether this one drafts."""
        now = self.clock()
        wall = None if self.wall_clock is None else self.wall_clock()
        self._book(now, wall)
        self._start, s, key = (now, wall), self.settings, self.costs.key(batch, context_len)
        plain, drafted, seconds = self._rates(batch, context_len)
        due = fresh = False
        if plain is not None and drafted is not None:
            retries = self.carried.retries.setdefault(key, Backoff(interval=0))
            interval = retries.retry_interval(plain, drafted, self.costs.shifts.get(key, 0), s, seconds)
            plain_wins = plain >= drafted
            if self.costs.samples(not plain_wins) < 2:  # the first round of a kind also paid first-call costs
                interval = s.first_interval
            if plain_wins and self.tokens.estimate is None:  # prompts never drafted: one retry, spaced by loss
                once = spaced(s.first_interval, plain, drafted, s, *seconds)
                fresh, interval = once < interval, min(interval, once)
            due = retries.since(not plain_wins) >= interval
            if due:
                self.costs.expire(batch, context_len, not plain_wins)  # the loser's one fresh look
        decision = plain_or_draft(plain, drafted, due)
        self.skip_draft, self.reason = decision.budget == 0, decision.reason
        self._pending = _Round(self.skip_draft, batch, context_len, retry=due, fresh=fresh)
        if self.skip_draft:
            self._note(0, decision.reason)

    def _rates(self, batch: int, context: int) -> tuple[float | None, float | None, tuple[float | None, float | None]]:
        """Plain's and drafting's tokens per second here (``None``: not known yet), and their rounds' seconds.
        Drafting is priced at this call's tokens per row (else earlier calls') and, at batch > 1, by the row
        that lags: a call lasts until its last row is done."""
        plain, drafted = self.costs.seconds("plain", batch, context), self.costs.seconds("drafted", batch, context)
        row, lag = self.tokens.value(self.costs.key(batch, context)), self._lagging(batch)
        return (None if plain is None else batch / max(plain, 1e-12),
                None if drafted is None or row is None else row * batch / max(drafted, 1e-12) * lag, (plain, drafted))

    def _lagging(self, batch: int) -> float:
        """The lagging row's share at ``batch``, else at the nearest batch measured (a batch that just lost a
        row lags as it did: priced by the mean, its first round would draft on a price no row reaches); 1.0 for
        one row or where no batch is measured."""
        shares = self.carried.lagging
        if batch < 2 or not shares:
            return 1.0
        near = nearest([(1, b) for b in shares], (1, batch))  # the cost table's rule: nearest in log2 batch
        return shares[near[1]] if near is not None else 1.0

    # ------------------------------------------------------------------ with the proposal

    def _measured(self, batch: int, context: int) -> dict[int, float]:
        """A drafting round's seconds at each budget whose verify counts as measured here."""
        measured = {}
        for n in self.candidates:
            verify, known = self.costs.verify_seconds(n + 1, batch, context)
            overhead = self.costs.seconds("overhead", batch, context)
            if known and verify is not None and overhead is not None:
                measured[n] = overhead + verify
        return measured

    def _top(self, measured: dict[int, float], batch: int, explore: bool) -> tuple[int, int]:
        """The start budget (the nodes the rows share) and the largest budget priced: the largest measured, or
        the start, and one candidate more on a round that explores."""
        s = self.settings
        fits = [c for c in self.candidates if c <= max(1, s.start // max(1, batch))]
        start = fits[-1] if fits else self.candidates[0]
        top = max(measured or [start])
        return start, next((c for c in self.candidates if c > top), top) if explore else top

    def deepest(self, context_len: int, batch: int) -> int | None:
        """:meth:`choose` prices budgets up to :meth:`_top`'s (an exploring round's at most), and picks one of
        them; a builder other than best-first may build deeper than its budget."""
        if self.builder is not best_first:
            return None
        return self._top(self._measured(batch, context_len), batch, explore=True)[1]

    def choose(self, proposal: Proposal, context_len: int) -> int:
        s, batch = self.settings, proposal.logprobs.shape[0]
        key = self.costs.key(batch, context_len)
        measured = self._measured(batch, context_len)
        schedule = self.carried.neighbours.setdefault(key, Backoff(s.first_interval, s.first_interval))
        pending = self._pending if self._pending is not None else _Round(False, batch, context_len)
        explore = not pending.retry and bool(measured) and schedule.tick()
        start, top = self._top(measured, batch, explore)
        factors = self.carried.calibration.factors(proposal.logprobs.shape[1], s.prior_rounds)
        price = self.pricer.price(proposal, top, factors)  # the policy's one host read
        expected = {n: sum(row[i] for row in price.expected) for i, n in enumerate(self.candidates) if n <= top}
        near = {n: self._neighbour(n, batch, context_len) for n in measured} if explore else None
        decision = decide({n: t for n, t in measured.items() if n <= top}, expected, start, near)
        self.best = decision.best if decision.best is not None else self.best
        if decision.best is not None and self._restart(schedule, decision.best, batch, context_len):
            schedule.restart(s.first_interval)
        if explore and decision.best is not None:
            interval = min(2 * schedule.interval, s.explore_every)
            if decision.reason == EXPLORE and decision.budget in measured:  # a try priced below the best waits
                rate = {n: expected[n] / measured[n] for n in (decision.best, decision.budget)}
                interval = spaced(interval, rate[decision.best], rate[decision.budget], s)
            schedule.tried(interval)
        reason, chosen = RETRY if pending.retry else decision.reason, self.candidates.index(decision.budget)
        pending.nodes, pending.expected = decision.budget + 1, expected.get(decision.budget)
        pending.predicted = [row[chosen] for row in price.reach]
        pending.explored = decision.reason == EXPLORE
        self._pending, self.reason = pending, reason
        self._note(decision.budget, reason)
        self.last = {"context": context_len, "batch": batch, "chosen": decision.budget, "reason": reason,
                     "expected_tokens": {n: round(e, 4) for n, e in expected.items()},
                     "round_seconds": {n: round(t, 6) for n, t in measured.items()},
                     "row_expected_tokens": [round(row[chosen], 4) for row in price.expected]}
        return decision.budget

    def tree(self, proposal: Proposal, roots: torch.Tensor, budget: int, builder: TreeBuilder) -> DraftTree | None:
        return self.pricer.tree(proposal, roots, budget, builder)

    def _neighbour(self, best: int, batch: int, context: int) -> int:
        """A hill-climb step from ``best``: a neighbour never measured here (upwards first), else the one
        measured longest ago."""
        i = self.candidates.index(best)
        near = self.candidates[i + 1:i + 2] + self.candidates[max(0, i - 1):i]
        stamps = self.costs.verify_stamps(batch, context)
        fresh = [n for n in near if n + 1 not in stamps]
        return fresh[0] if fresh else min(near, key=lambda n: (stamps.get(n + 1, -1), n), default=best)

    def _restart(self, schedule: Backoff, best: int, batch: int, context: int) -> bool:
        """The neighbour schedule starts again when the costs here shifted or the best has a neighbour never
        measured (the climb goes on); a best flipping between measured budgets keeps it."""
        moved = schedule.moved(self.costs.shifts.get(self.costs.key(batch, context), 0))
        return moved or self._neighbour(best, batch, context) + 1 not in self.costs.verify_stamps(batch, context)

    # ------------------------------------------------------------------ after the round

    def observe(self, accepted: Sequence[int], verify_seconds: float, context_len: int) -> None:
        """Calibrate the drafter against each row's accepted count; keep the verify seconds for the costs
        (booked at the next :meth:`prepare`, when the round's end is known)."""
        pending = self._pending
        if pending is None:
            return
        pending.verify, pending.tokens = verify_seconds, sum(int(a) for a in accepted)
        self.rounds += 1
        if pending.plain or pending.predicted is None:
            return
        if len(accepted) != len(pending.predicted):
            raise ValueError(f"observe got {len(accepted)} accepted counts for a round of "
                             f"{len(pending.predicted)} rows: pass one count per active row, in row order")
        self._rows.add(accepted)
        share = self._rows.lagging(len(accepted))
        if share is not None and len(accepted) > 1:
            self.carried.lagging[len(accepted)] = share
        self.carried.calibration.add(pending.predicted, accepted, self.settings.forget)

    def _book(self, now: float, wall: float | None) -> None:
        """The round since the last :meth:`prepare` into the costs (its verify rescaled from wall time when
        ``clock`` counts something else), and its tokens into this call's acceptance."""
        pending, self._pending = self._pending, None
        if pending is None or pending.verify is None or self._start is None:
            return
        (then, wall_then), (batch, context) = self._start, (pending.batch, pending.context)
        seconds, verify = now - then, pending.verify
        if wall is not None and wall_then is not None and wall > wall_then:
            verify = min(seconds, verify * seconds / (wall - wall_then))
        key = self.costs.key(batch, context)
        if pending.plain:
            self.costs.record_plain(batch, context, seconds)
            self.tokens.idle += 1
        else:
            self.costs.record_tree(pending.nodes, batch, context, seconds, verify, chosen=not pending.explored)
            if not pending.explored:  # a try of a neighbour prices its verify, not drafting's rate
                expected = None if pending.expected is None else pending.expected / batch
                self.tokens.add(key, pending.tokens / batch, expected, self.rounds)
        retries = self.carried.retries.setdefault(key, Backoff(interval=0))
        retries.ran(pending.plain)
        if pending.retry and retries.plain_won is not None:
            plain, drafted, seconds_here = self._rates(batch, context)
            if plain is not None and drafted is not None and retries.retried(
                    plain, drafted, retries.plain_won, pending.fresh, self.costs.shifts.get(key, 0), self.settings,
                    seconds_here):
                self.costs.expire(batch, context, plain=False)

    def finish(self) -> None:
        """Hand this call's figures on to the generator's next call (its own mean joins the spread of calls
        once it drafted ``min_rounds`` rounds)."""
        own = self.tokens.own
        self.learned.hand_on(self.carried, own if own.count >= self.settings.min_rounds else None, self.tokens.batch)
        self.tokens.own = Moments()

    # ------------------------------------------------------------------ reporting

    def _note(self, budget: int, reason: str) -> None:
        self.choices[budget] += 1
        self.reasons[reason] += 1

    def describe(self) -> dict[str, Any]:
        cal, context, batch = self.carried.calibration, self.last.get("context", 0), self.last.get("batch", 1)
        plain = self.costs.seconds("plain", batch, context)
        return {"policy": "auto", "cost_model": COST_MODEL, "candidates": list(self.candidates),
                "rounds": self.rounds, "plain_rounds": self.plain_rounds, "explorations": self.explorations,
                "choices": {str(k): v for k, v in sorted(self.choices.items())}, "reasons": dict(self.reasons),
                "plain_round_seconds": None if plain is None else round(plain, 6),
                "depth_calibration": [round(c, 4) for c in cal.factors(len(cal.reached), self.settings.prior_rounds)],
                "lagging_row_share": {str(b): round(v, 4) for b, v in sorted(self.carried.lagging.items())},
                "costs": self.costs.describe(), "last_round": self.last, "state": self.explain()}

    def explain(self) -> list[str]:
        """The state in a few lines: the last choice and why, the rates it weighed, when the next tries come."""
        context, batch = self.last.get("context", 0), self.last.get("batch", 1)
        key, (plain, drafted, _) = self.costs.key(batch, context), self._rates(batch, context)
        lines = [f"{self.rounds} rounds ({self.plain_rounds} plain) by reason {dict(self.reasons)}; last tree: "
                 f"budget {self.last.get('chosen')} ({self.last.get('reason')}) at batch {batch}, context {key[0]}"]
        if plain is not None and drafted is not None:
            lines.append(f"plain {plain:.1f} tokens/s against drafting {drafted:.1f} tokens/s")
        retry, near = self.carried.retries.get(key), self.carried.neighbours.get(key)
        if retry is not None and retry.plain_won is not None:
            wait = max(0, retry.interval - retry.since(not retry.plain_won))
            lines.append(f"{'drafting' if retry.plain_won else 'plain'} is retried in {wait} rounds")
        if near is not None and self.best is not None:
            lines.append(f"best budget {self.best}; a neighbour is tried in {max(0, near.left)} drafting rounds")
        return lines


__all__ = ["AutoBudget", "BudgetPolicy", "Decision", "FIRST", "FixedBudget", "Settings", "check_budget"]
