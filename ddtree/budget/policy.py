"""Budget policies: how many draft nodes each round's tree gets, or none.

``FixedBudget(n)`` gives every round ``n``; ``AutoBudget`` (``tree_budget="auto"``) picks,
round by round, a plain step or the tree budget whose expected committed tokens per second
is highest, from round costs it measures as it goes (:mod:`ddtree.budget.costs`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from ddtree.budget.costs import TOKENS_WEIGHT, Estimate, PromptSpread, RoundCosts, Schedule
from ddtree.budget.latency import COST_MODEL, LatencyModel
from ddtree.budget.profile import load_profile, save_profile
from ddtree.budget.rows import RowProgress
from ddtree.core.builders import TreeBuilder, best_first
from ddtree.core.tree import DraftTree

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BudgetPolicy(Protocol):
    """Chooses the tree budget each round. One instance serves one generation (it may learn as it goes).

    ``prepare`` runs before a round, outside the round's draft and verify stages;
    while ``skip_draft`` is true the round decodes one plain step without drafting.
    ``choose`` sees the round's draft log-probs ``[B, D, V]``; ``observe`` sees, after
    the round emitted, each row's accepted count (host ints the round read anyway) and
    the verify forward's seconds; ``describe`` is what the generation's stats report;
    ``finish`` runs once when every row has stopped. Subclass it to inherit the defaults of
    ``prepare``, ``skip_draft``, ``observe``, ``describe`` and ``finish``.
    """

    skip_draft: bool = False

    def prepare(self, context_len: int, batch: int) -> None:
        return None

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        ...

    def observe(self, accepted: Sequence[int], verify_seconds: float, context_len: int) -> None:
        return None

    def describe(self) -> dict:
        return {"policy": type(self).__name__}

    def finish(self) -> None:
        """The generation ended (every row stopped): a policy that keeps anything beyond it saves it here."""
        return None


class FixedBudget(BudgetPolicy):
    """The same budget every round."""

    def __init__(self, budget: int) -> None:
        check_budget(budget)
        self.budget = budget

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        return self.budget

    def describe(self) -> dict:
        return {"policy": "fixed", "budget": self.budget}


POLICY_PARTS = ("skip_draft", "prepare", "choose", "observe", "describe")


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
        raise ValueError(
            f"tree_budget must be an int >= 0 (draft nodes per round; 0 = no drafting), 'auto' "
            f"or a BudgetPolicy, got {budget!r}"
        )


class AutoBudget(BudgetPolicy):
    """The ``BudgetPolicy`` behind ``tree_budget="auto"``: a plain step, or the tree budget of highest
    expected committed tokens per second; the cost model is in :mod:`ddtree.budget.latency`'s docstring.

    Costs are learned from every round's own seconds (:class:`RoundCosts`, shared by the generator's
    generations) unless a ``latency`` model is given, which then prices verify forwards (times a
    learned ``scale``). ``clock`` is read once per round, in ``prepare``: inject a fake one to test
    deterministically. It may count something other than wall time (:func:`work_clock`: this process's CPU
    time, which other processes on the machine do not inflate); ``wall_clock`` then gives the wall time the
    round's verify seconds are in, so they are rescaled to ``clock``'s units by the round's own ratio.
    Whether a round drafts at all is decided in :meth:`prepare` from measured rates (plain rounds against
    drafting rounds, the loser retried on a backing-off schedule); drafting is priced at the generation's own
    tokens per row, from a prior that earlier generations weigh (:attr:`row_tokens`, at most
    ``acceptance_prior`` rounds). Among tree
    budgets, only those measured at this batch and context (or priced by ``latency``) are chosen; a
    neighbour of the best is tried after 2 drafting rounds, then 4, 8, ... up to ``explore_every`` (the key's
    own drafting rounds, a schedule shared by the generator's generations like the costs), back to 2 when the
    round seconds shift or the best has a neighbour never measured (longer where the neighbour is priced well
    below the best, so that a try costs at most ``retry_cost`` of the rounds' time).

    ``profile``: a JSON file (:mod:`ddtree.budget.profile`; :func:`~ddtree.budget.profile.default_profile`
    names one per machine and model pair in the ddtree cache) whose saved costs seed the policy when no
    ``costs`` are given, and to which the costs are written when a generation ends.

    At batch > 1 one budget serves every row: the verify is one forward over ``[B, nodes]``, so a row given
    a smaller tree would save nothing unless the whole batch's width shrank. The batch's budget maximises
    ``sum over rows of E[tokens | n]`` over the verify's seconds at ``B x (n + 1)`` nodes; a row whose
    tree does not pay brings about 1 token (the bonus a plain step brings too), so it adds nothing to the
    case for a bigger tree while still costing its share of the wider verify. Separate per-row shapes
    would need a ragged verify.
    """

    def __init__(
        self,
        latency: LatencyModel | None = None,
        builder: TreeBuilder = best_first,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        overhead_seconds: float | None = None,
        prior_rounds: float = 1.0,
        forget: float = 0.97,
        ema: float = 0.2,
        costs: RoundCosts | None = None,
        start: int = 4,
        explore_every: int = 16,
        retry_every: int = 128,
        retry_cost: float = 0.01,
        acceptance_prior: float = 16.0,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] | None = None,
        profile: str | Path | None = None,
    ) -> None:
        if not candidates or any(int(c) < 1 for c in candidates):
            raise ValueError(f"candidates must be non-empty tree budgets >= 1 (a plain step is always a choice), "
                             f"got {candidates!r}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 rounds, got {explore_every!r}")
        if retry_every < 2:
            raise ValueError(f"retry_every must be >= 2 rounds, got {retry_every!r}")
        self.latency = latency
        self.profile = None if profile is None else Path(profile)
        if costs is None and self.profile is not None:
            costs = load_profile(self.profile)
        self.costs = costs if costs is not None else RoundCosts()
        self.clock = clock
        self.wall_clock = wall_clock
        self.builder = builder
        self.candidates = sorted({int(c) for c in candidates})
        self.start = min(self.candidates, key=lambda c: (abs(c - start), c))
        self.fixed_overhead = overhead_seconds
        self.prior_rounds = prior_rounds
        self.forget = forget
        self.ema = ema
        self.explore_every = explore_every
        self.retry_every = retry_every
        self.retry_cost = retry_cost
        self.acceptance_prior = acceptance_prior
        self.scale = 1.0  # observed verify seconds over the latency model's (when one is given)
        self.rounds = 0
        self.plain_rounds = 0
        self.explorations = 0
        self.choices: dict[int, int] = {}
        self.last: dict = {}
        self.batch = 1
        self.skip_draft = False
        self.best: int | None = None  # the best measured tree budget at the last choice
        self._expected: dict[int, float] = {}  # E[tokens | n] summed over rows, at the last choice
        self._expected_batch = 1
        self._retry: dict | None = None  # this round retries the losing option (see ``prepare``)
        self._shifts: dict[tuple[int, int], int] = {}  # the costs' shift counts the retry schedule has seen
        self._winners: dict[tuple[int, int], bool] = {}  # whether plain won, as the retry schedule last saw
        self._reference: dict[tuple[int, int], float] = {}  # plain's rate when the schedule last moved
        self._held: dict[tuple[int, int], int] = {}  # intervals a load move cut short (restored if confirmed)
        self._row_tokens: Estimate | None = None  # tokens per row of this generation's drafting rounds
        self._own_batch = 1  # the batch this generation started drafting at
        self._own = [0.0, 0.0, 0.0]  # its drafting rounds' count, sum and sum of squares of tokens per row
        self._rows = RowProgress()  # each active row's tokens in drafting rounds: which row lags
        self.moved = 1.25  # plain, winning, moved by more than this factor: retry drafting soon
        self._round_start: float | None = None
        self._wall_start: float | None = None
        self._pending: dict | None = None  # the round in flight: what it ran, for the costs
        self._predicted_rows: torch.Tensor | None = None  # [B, D] p_d of the chosen tree per row
        self._built: tuple[torch.Tensor, DraftTree, int] | None = None  # the last reach tree, its input, budget

    @property
    def row_tokens(self) -> float | None:
        """Committed tokens per row of this generation's drafting rounds, a running mean from the shared table's
        prior: the mean of earlier generations at this batch size, counted as the rounds their spread is worth
        (:class:`~ddtree.budget.costs.PromptSpread`, at most ``acceptance_prior``), else the nearest key's figure as
        one round. Acceptance belongs to the prompts, the round seconds to the machine."""
        return None if self._row_tokens is None else self._row_tokens.value

    @property
    def reached(self) -> torch.Tensor | None:
        """``[D]`` decayed count of rounds that reached depth ``d`` (kept in the shared costs: it describes
        the drafter on this target, so a later generation starts calibrated)."""
        return self.costs.reached

    @reached.setter
    def reached(self, value: torch.Tensor | None) -> None:
        self.costs.reached = value

    @property
    def predicted(self) -> torch.Tensor | None:
        """``[D]`` decayed sum of ``p_d`` over verified trees (shared like :attr:`reached`)."""
        return self.costs.predicted

    @predicted.setter
    def predicted(self, value: torch.Tensor | None) -> None:
        self.costs.predicted = value

    @classmethod
    def for_generator(cls, generator: Any, costs: RoundCosts | None = None, **options: Any) -> AutoBudget:
        """A policy for one generation on ``generator``: its builder, and the round costs ``costs``
        (pass the generator's shared table so each generation starts from what the last one learned)."""
        return cls(builder=generator.builder, costs=costs, **options)

    # ------------------------------------------------------------------ the model

    def calibration(self, depth: int) -> torch.Tensor:
        """``c_d`` for depths ``1..depth``."""
        c = torch.ones(depth, dtype=torch.float64)
        if self.reached is not None and self.predicted is not None:
            n = min(depth, self.reached.numel())
            c[:n] = (self.prior_rounds + self.reached[:n]) / (self.prior_rounds + self.predicted[:n])
        return c

    def row_reach(self, logprobs: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """``p_d(n)`` per row ``[B, len(candidates), D]`` (float64, host) for every candidate, from one tree
        at budget ``top`` (default the largest candidate; larger candidates get the budget-``top`` figures).
        Computed on the device and read to the host as this one small tensor."""
        bsz, depth, _ = logprobs.shape
        top = self.candidates[-1] if top is None else top
        if top == 0 or depth == 0:
            return torch.zeros(bsz, len(self.candidates), depth, dtype=torch.float64)
        tree = self.builder(torch.zeros(bsz, dtype=torch.long, device=logprobs.device), logprobs, top)
        self._built = (logprobs, tree, top)
        probs = tree.scores[:, 1:].float().exp()  # [B, N-1]
        nodes = probs.shape[1]
        if nodes == 0:
            return torch.zeros(bsz, len(self.candidates), depth, dtype=torch.float64)
        depths = (tree.depths[:, 1:] - 1).clamp(0, depth - 1)
        per_depth = probs.new_zeros(bsz, nodes, depth).scatter_(2, depths[..., None], probs[..., None])
        cum = per_depth.cumsum(dim=1)  # [B, N-1, D]: the first k nodes' reach by depth
        take = torch.tensor([min(n, nodes) - 1 for n in self.candidates], device=cum.device)
        return cum.index_select(1, take).clamp(max=1.0).cpu().double()

    def built_tree(self, logprobs: torch.Tensor, roots: torch.Tensor, budget: int) -> DraftTree | None:
        """The tree ``best_first`` grows from ``logprobs`` under ``budget``, cut from the larger one
        :meth:`choose` grew from the same tensor to price the budgets (``None`` when it grew none, or its
        builder is another). Best-first trees nest: the one under ``n`` nodes is the first ``n`` of any larger
        one (one total order on candidates), so the round need not grow it again."""
        if self._built is None or self._built[0] is not logprobs or self.builder is not best_first:
            return None
        _, tree, top = self._built
        if budget > top:
            return None
        n = min(budget + 1, tree.num_nodes)  # fewer nodes than asked: the candidates ran out in both
        return DraftTree(torch.cat([roots.view(-1, 1).long(), tree.tokens[:, 1:n]], dim=1), tree.parents[:, :n],
                         tree.depths[:, :n], tree.scores[:, :n], tree.visibility[:, :n, :n])

    def reach_probabilities(self, logprobs: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """``p_d(n)`` ``[len(candidates), D]`` averaged over rows."""
        return self.row_reach(logprobs, top).mean(dim=0)

    def expected_tokens(self, reach: torch.Tensor) -> torch.Tensor:
        """``E[tokens | n]`` per candidate (``[..., C]``) from ``p_d(n)`` ``[..., C, D]`` and the calibration."""
        r = (reach * self.calibration(reach.shape[-1])).clamp(max=1.0)
        r = torch.cummin(r, dim=-1).values  # reaching depth d needs depth d-1
        return 1.0 + r.sum(dim=-1)

    def tree_seconds(self, n: int, batch: int, context: int) -> tuple[float | None, bool]:
        """Seconds of a drafting round at budget ``n`` and whether its verify was measured (or priced by the
        latency model) at this batch and context: only such candidates are chosen outside exploration."""
        verify: float | None
        if self.latency is not None:
            verify = self.scale * self.latency.seconds(n + 1, context, batch)
            measured = getattr(self.latency, "measured", None)
            known = measured is None or n + 1 in measured(context, batch)
        else:
            verify = self.costs.verify_seconds(n + 1, batch, context)
            table, factor = self.costs.verify_table(batch, context)
            # one doubling past the largest measured count is priced by the last two's slope: trees grow
            # a step at a time where a bigger verify costs little more (a GPU), and are measured once chosen
            known = (self.costs.verify_known(n + 1, batch, context)
                     or (len(table) >= 2 and (n + 1) * factor <= 2 * max(table)))
        overhead = self._overhead(batch, context)
        if verify is None or overhead is None:
            return None, False
        return overhead + verify, known

    def _overhead(self, batch: int, context: int) -> float | None:
        if self.fixed_overhead is not None:
            return self.fixed_overhead
        learned = self.costs.overhead_seconds(batch, context)
        if learned is None and self.latency is not None:
            return self.scale * self.latency.seconds(1, context, batch)
        return learned

    @staticmethod
    def _argmax(rates: dict[int, tuple[float, bool]]) -> int | None:
        known = [(r, -n, n) for n, (r, k) in rates.items() if k]
        return max(known)[2] if known else None

    # ------------------------------------------------------------------ BudgetPolicy

    def prepare(self, context_len: int, batch: int) -> None:
        """Book the round that just ended against its costs, then decide whether this round drafts.

        The comparison is between measured rates (committed tokens per second of plain rounds and of
        drafting rounds, :meth:`RoundCosts.plain_rate` and :meth:`RoundCosts.drafted_rate`): the faster one
        runs, and the other is retried once it last ran ``interval`` rounds ago at this batch and context
        bucket (its rounds, not the generation's: passing through many keys does not multiply retries). The interval
        doubles each time a retry confirms the winner (up to ``retry_every``; never so short that a retry
        costs more than ``retry_cost`` of the rounds' time), and falls back to 2 when the round seconds
        shift or a winning plain rate moves by a quarter (load came or went), spaced anew when the winner
        changes; a generation whose prompts were never drafted retries once, spaced by the loss alone. A retry's
        seconds replace the loser's (its one fresh look: judged an outlier, it would keep a price from another
        load), and when plain takes over on a rate the load moved, drafting is measured again after 2 rounds.
        A drafting retry uses the best measured tree. Where nothing is measured, a plain step comes
        first (the cheap one), then a tree at the start budget (smaller as the batch grows)."""
        now = self.clock()
        wall = None if self.wall_clock is None else self.wall_clock()
        self._book(now, wall)
        self._round_start, self._wall_start = now, wall
        self.batch = batch
        self._retry = None
        key = self.costs.key(batch, context_len)
        plain = self.costs.plain_rate(batch, context_len)
        drafted = self._drafted_rate(batch, context_len)
        if plain is None:
            skip = True
        elif drafted is None:
            skip = False
        else:
            winner = 0 if plain[0] >= drafted[0] else 1
            seconds = self.costs.round_seconds(batch, context_len)
            interval = self._retry_interval(key, plain[0], drafted[0], seconds)
            loser = "drafted" if winner == 0 else "plain"
            if self.costs.samples(loser) < 2:  # the first round of a kind is no evidence to back off on (it
                interval = 2  # also paid first-call costs: kernels, shapes)
            fresh = False
            if winner == 0 and self._row_tokens is None:  # this generation's prompts were never drafted: the
                # table's acceptance is other prompts'; one retry, spaced by the loss alone, measures theirs
                spaced = self._spaced(2, plain[0], drafted[0], *seconds)
                fresh, interval = spaced < interval, min(interval, spaced)
            if self.costs.since(batch, context_len, loser) >= interval:
                self._retry = {"key": key, "winner": winner, "fresh": fresh}
                self.costs.expire(batch, context_len, loser)  # the loser's one fresh look, not an outlier
                self.explorations += 1
                skip = winner == 1
            else:
                skip = winner == 0
        self.skip_draft = skip
        if skip:
            self.plain_rounds += 1
            self._pending = {"plain": True, "batch": batch, "context": context_len, "retry": self._retry}

    def _drafted_rate(self, batch: int, context: int) -> tuple[float, int] | None:
        """Drafting's measured rate here for this generation's prompts (:meth:`RoundCosts.drafted_rate`), at
        batch > 1 priced by the row that lags (:class:`~ddtree.budget.rows.RowProgress`; before this call has
        enough drafting rounds to tell, the share the last call at this batch size measured): a call lasts until
        its last row is done, so the tokens drafting moves the other rows ahead by save no rounds."""
        row = self.row_tokens
        if row is None:  # before this generation's own rounds: the mean over generations, where they tell
            spread = self.costs.spread.get(batch)
            row = spread.mean if spread is not None and spread.prior_rounds(self.acceptance_prior) else None
        drafted = self.costs.drafted_rate(batch, context, row)
        if drafted is None:
            return None
        return drafted[0] * self.costs.lagging.get(batch, 1.0), drafted[1]  # kept current by ``observe``

    def _retry_interval(self, key: tuple[int, int], plain: float, drafted: float,
                        seconds: tuple[float | None, float | None]) -> int:
        """The retry interval at ``key``: 2 when the round seconds shifted, or plain is winning and its rate
        moved by more than ``moved`` (the load came or went: the loser was measured under another), the
        interval it cut short held to be restored if that retry confirms the winner (on a noisy machine plain's
        rate moves by a quarter often: each move buys one early retry, not a new schedule); spaced anew when
        the winner changed."""
        shifts, winner = self.costs.shifts.get(key, 0), plain >= drafted
        reference = self._reference.setdefault(key, plain)
        moved = winner and self._load_moved(reference, plain)
        if self._shifts.setdefault(key, shifts) != shifts or moved:
            self._held.setdefault(key, self.costs.intervals.get(key, 2))
            self.costs.intervals[key] = 2
        elif self._winners.setdefault(key, winner) != winner:
            self.costs.intervals[key] = self._spaced(2, plain, drafted, *seconds)
        if moved or self._winners[key] != winner:
            self._reference[key] = plain
        self._shifts[key], self._winners[key] = shifts, winner
        if key not in self.costs.intervals:
            self.costs.intervals[key] = self._spaced(2, plain, drafted, *seconds)
        return self.costs.intervals[key]

    def _load_moved(self, reference: float, plain: float) -> bool:
        """Whether plain's rate moved from ``reference`` by more than ``moved``: its rate is one token per row
        per round, so a move is the load's, not the drafter's."""
        return not reference / self.moved <= plain <= reference * self.moved

    def _spaced(self, interval: int, rate: float, other: float, seconds: float | None = None,
                other_seconds: float | None = None) -> int:
        """At least ``interval``, and enough rounds that one retry of the loser costs at most ``retry_cost``
        of them. A retry loses ``loss`` of its own round's tokens, and its round may be longer than the
        winner's (a tree round at batch 8 lasts 2-3 plain rounds), so the wait is ``loss`` times the loser's
        round seconds over the winner's, over ``retry_cost``: a loser at half the winner's rate, in a round
        as long, waits 50 rounds at 0.01; in a round twice as long, 100."""
        loss = 1.0 - min(rate, other) / max(rate, other, 1e-12)
        length = 1.0
        if seconds is not None and other_seconds is not None and min(seconds, other_seconds) > 0:
            winner, loser = (seconds, other_seconds) if rate >= other else (other_seconds, seconds)
            length = loser / winner
        return int(min(self.retry_every, max(interval, math.ceil(loss * length / self.retry_cost - 1e-9))))


    def _retried(self, retry: dict, batch: int, context: int) -> None:
        """After a retry round is booked: the schedule backs off while the same option keeps winning (up to
        ``retry_every`` rounds; a close race costs little whoever wins it), and starts again at 2 when the
        other one wins (spaced out by ``retry_cost`` in both cases)."""
        plain = self.costs.plain_rate(batch, context)
        drafted = self._drafted_rate(batch, context)
        if plain is None or drafted is None:
            return
        key, interval = retry["key"], self.costs.intervals.get(retry["key"], 2)
        winner = 0 if plain[0] >= drafted[0] else 1
        held = self._held.pop(key, 2)  # the interval before a load move cut it short: one early retry only
        reference = self._reference.get(key, plain[0])
        if winner != retry["winner"]:
            interval = 2
        elif not retry.get("fresh"):  # a generation's first try of its own prompts says nothing of the schedule
            interval = max(2 * interval, held)
        if winner == 0 and retry["winner"] == 1 and self._load_moved(reference, plain[0]):
            # plain took over on a rate the load moved: drafting's seconds are from before the move, so they are
            # measured again after 2 rounds, the first of them replacing the old figure
            self.costs.expire(batch, context, "drafted")
        else:
            interval = self._spaced(interval, plain[0], drafted[0], *self.costs.round_seconds(batch, context))
        self.costs.intervals[key] = interval
        self._shifts[key], self._winners[key] = self.costs.shifts.get(key, 0), winner == 0
        self._reference[key] = plain[0]

    def _start_budget(self, batch: int) -> int:
        """The first tree's budget at ``batch`` rows: ``start`` nodes shared by the rows (a verify costs
        about the batch's total node count on a compute-bound device), at least the smallest candidate."""
        fits = [c for c in self.candidates if c <= max(1, self.start // max(1, batch))]
        return fits[-1] if fits else self.candidates[0]

    def _neighbour(self, best: int, batch: int, context: int) -> int:
        """A hill-climbing step from ``best``: a neighbouring budget never measured here (upwards first), else
        the neighbour measured longest ago."""
        i = self.candidates.index(best)
        near = self.candidates[i + 1:i + 2] + self.candidates[max(0, i - 1):i]
        if not near:
            return best
        stamps = self.costs.verify_stamps(batch, context)
        unmeasured = [n for n in near if self.latency is None and n + 1 not in stamps]
        return unmeasured[0] if unmeasured else min(near, key=lambda n: (stamps.get(n + 1, -1), n))

    def _restart(self, schedule: Schedule, best: int, batch: int, context: int) -> bool:
        """Whether the neighbour schedule starts again at 2 (noting the shifts it has now seen): the round seconds
        here shifted since it last looked (the load moved), or the best budget has a neighbour never measured here
        (the climb goes on). A best that flips between measured budgets (a near tie) keeps it: each flip would buy
        a try of a losing tree."""
        shifts = self.costs.shifts.get(self.costs.key(batch, context), 0)
        moved, schedule.shifts = shifts != schedule.shifts, shifts
        return moved or (self.latency is None and self._neighbour(best, batch, context) + 1
                         not in self.costs.verify_stamps(batch, context))

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        batch = logprobs.shape[0]
        seconds = {n: self.tree_seconds(n, batch, context_len) for n in self.candidates}
        measured = [n for n in self.candidates if seconds[n][1]]
        wanted = set(measured) or {self._start_budget(batch)}
        schedule = self.costs.neighbours.setdefault(self.costs.key(batch, context_len), Schedule())
        explore = False
        if self._retry is None and measured:
            schedule.left -= 1
            explore = schedule.left <= 0
        top = max(wanted)
        if explore:
            above = [c for c in self.candidates if c > top]
            top = max(top, above[0] if above else top)
        reach = self.row_reach(logprobs, top)  # the round's one host read for the policy
        rows = self.expected_tokens(reach)  # [B, C]
        expected = rows.sum(dim=0).tolist()
        self._expected = {n: e for n, e in zip(self.candidates, expected) if n <= top}
        self._expected_batch = batch
        rates = {n: (e / s, True) for n, e in zip(self.candidates, expected)
                 for s, k in [seconds[n]] if k and s is not None and n <= top}
        best = self._argmax(rates)  # None only when ``rates`` is empty: all its entries are measured
        self.best = best if best is not None else self.best
        if best is not None and self._restart(schedule, best, batch, context_len):
            schedule.interval, schedule.left = 2, min(schedule.left, 2)
        if explore and best is not None:
            choice = self._neighbour(best, batch, context_len)
            self.explorations += 1
            schedule.interval = min(2 * schedule.interval, self.explore_every)
            stamps = self.costs.verify_stamps(batch, context_len)
            current = stamps.get(choice + 1, -1) >= self.costs.verify_changed(best + 1, batch, context_len)
            if choice in rates and current:  # a neighbour priced well below the best waits longer (a try costs
                # more), unless its price is from before the best's seconds last changed (another load)
                schedule.interval = self._spaced(schedule.interval, rates[best][0], rates[choice][0])
            schedule.left = schedule.interval
        elif best is not None:
            choice = best
        else:
            choice = self._start_budget(batch)
        self.choices[choice] = self.choices.get(choice, 0) + 1
        self._predicted_rows = reach[:, self.candidates.index(choice)]
        self._pending = {"plain": False, "nodes": choice + 1, "batch": batch, "context": context_len,
                         "retry": self._retry, "explored": explore and choice != best,
                         "expected": self._expected.get(choice)}
        self.last = {
            "context": context_len,
            "batch": batch,
            "chosen": choice,
            "explored": explore,
            "expected_tokens": {n: round(e, 4) for n, e in self._expected.items()},
            "round_seconds": {n: round(s, 6) for n, (s, _) in seconds.items() if s is not None},
            "tokens_per_second": {n: round(r, 2) for n, (r, _) in rates.items()},
            "row_expected_tokens": [round(e, 4) for e in rows[:, self.candidates.index(choice)].tolist()],
        }
        return choice

    def observe(self, accepted: Sequence[int], verify_seconds: float, context_len: int) -> None:
        """Calibrate the drafter against each row's accepted count (root included) and keep the verify
        seconds for the round's costs (booked at the next ``prepare``, when the round's end is known)."""
        pending = self._pending
        if pending is None:
            return
        pending["verify"] = verify_seconds
        pending["tokens"] = sum(int(a) for a in accepted)
        self.rounds += 1
        if pending["plain"]:
            return
        predicted_rows = cast(torch.Tensor, self._predicted_rows)  # set by ``choose`` for a drafting round
        if len(accepted) != predicted_rows.shape[0]:
            raise ValueError(f"observe got {len(accepted)} accepted counts for a round of "
                             f"{predicted_rows.shape[0]} rows: pass one count per active row, in row order")
        self._rows.add(accepted)
        share = self._rows.lagging(len(accepted))
        if share is not None and len(accepted) > 1:  # this call's own share, once its rounds tell
            self.costs.lagging[len(accepted)] = share
        depth = max(1, predicted_rows.shape[1])
        predicted = predicted_rows.mean(dim=0) if predicted_rows.shape[1] else torch.zeros(1, dtype=torch.float64)
        counts = torch.tensor([int(a) for a in accepted], dtype=torch.float64)[:, None] - 1
        reached = (torch.arange(1, depth + 1, dtype=torch.float64)[None] <= counts).double().mean(dim=0)
        reached_sums, predicted_sums = self._grow(depth)
        reached_sums *= self.forget
        predicted_sums *= self.forget
        reached_sums[:depth] += reached
        predicted_sums[:depth] += predicted
        if self.latency is not None and verify_seconds > 0:
            modelled = self.latency.seconds(pending["nodes"], pending["context"], pending["batch"])
            if modelled > 0:
                ratio = min(4.0, max(0.25, verify_seconds / modelled))
                self.scale += self.ema * (ratio - self.scale)

    def _book(self, now: float, wall: float | None = None) -> None:
        """The round that ran since the last ``prepare``: its seconds (``clock``'s) into the learned costs, its
        verify's rescaled from wall time when ``clock`` counts something else."""
        pending, self._pending = self._pending, None
        if pending is None or "verify" not in pending or self._round_start is None:
            return
        seconds = now - self._round_start
        verify = pending["verify"]
        if wall is not None and self._wall_start is not None and wall > self._wall_start:
            verify = min(seconds, verify * seconds / (wall - self._wall_start))
        if pending["plain"]:
            self.costs.record_plain(pending["batch"], pending["context"], seconds)
        else:
            # an exploration round ran a neighbour of the best tree on purpose: its verify prices that budget,
            # but the rate of drafting (against plain rounds) is the rate of the policy's own choices
            tokens = None if pending.get("explored") else pending["tokens"]
            if tokens is not None:
                if self._row_tokens is None:
                    self._row_tokens = self.costs.row_tokens_prior(pending["batch"], pending["context"],
                                                                   pending.get("expected"), self.acceptance_prior)
                    self._own_batch, self._own = pending["batch"], [0.0, 0.0, 0.0]
                value = tokens / pending["batch"]
                self._row_tokens.update(value, self.rounds)
                self._own = [self._own[0] + 1, self._own[1] + value, self._own[2] + value * value]
                self._check_prior()
            self.costs.record_tree(pending["nodes"], pending["batch"], pending["context"], seconds, verify, tokens,
                                   pending.get("expected"))
        if pending.get("retry") is not None:
            self._retried(pending["retry"], pending["batch"], pending["context"])

    def _check_prior(self) -> None:
        """Drop the earlier generations' prior once this generation's own rounds say its prompts are unlike
        theirs (:meth:`PromptSpread.unlike`): from then on its estimate is its own running mean."""
        rounds, total, _ = self._own
        estimate, spread = self._row_tokens, self.costs.spread.get(self._own_batch)
        if estimate is None or spread is None or estimate.count <= rounds + 1 or rounds < 3:
            return  # no weighted prior left to drop (or too few rounds to judge)
        if spread.unlike(total / rounds, int(rounds)):
            estimate.value, estimate.count, estimate.weight = total / rounds, int(rounds), TOKENS_WEIGHT

    def finish(self) -> None:
        """Book this generation's own tokens per row in the table's spread (at the batch it started drafting
        at, once it drafted 4 rounds), and save the learned costs to ``profile`` (when one is set)."""
        rounds, total, squares = self._own
        if rounds >= 4:
            mean = total / rounds
            variance = max(0.0, squares / rounds - mean * mean) * rounds / (rounds - 1)
            self.costs.spread.setdefault(self._own_batch, PromptSpread()).add(mean, variance, int(rounds))
        self._own = [0.0, 0.0, 0.0]
        if self.profile is not None:
            save_profile(self.costs, self.profile)

    def describe(self) -> dict:
        depth = self.reached.numel() if self.reached is not None else 0
        context, batch = self.last.get("context", 0), self.last.get("batch", self.batch)
        plain = self.costs.plain_seconds(batch, context)
        drafted = self._drafted_rate(batch, context)
        overhead = self._overhead(batch, context)
        return {
            "policy": "auto",
            "cost_model": COST_MODEL,
            "candidates": list(self.candidates),
            "rounds": self.rounds,
            "plain_rounds": self.plain_rounds,
            "explorations": self.explorations,
            "plain_round_seconds": None if plain is None else round(plain, 6),
            "plain_tokens_per_second": None if plain is None else round(batch / max(plain, 1e-12), 2),
            "drafted_tokens_per_second": None if drafted is None else round(drafted[0], 2),
            "choices": {str(k): v for k, v in sorted(self.choices.items())},
            "overhead_seconds": None if overhead is None else round(overhead, 6),
            "verify_scale": round(self.scale, 4),
            "depth_calibration": [round(c, 4) for c in self.calibration(depth).tolist()],
            "costs": self.costs.describe(),
            **({"latency": self.latency.describe()} if self.latency is not None else {}),
            "last_round": self.last,
        }

    # ------------------------------------------------------------------ helpers

    def _grow(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decayed per-depth sums ``(reached, predicted)``, zero-padded to at least ``depth``."""
        if self.reached is None or self.predicted is None:
            self.reached = torch.zeros(depth, dtype=torch.float64)
            self.predicted = torch.zeros(depth, dtype=torch.float64)
        elif self.reached.numel() < depth:
            pad = depth - self.reached.numel()
            self.reached = torch.cat([self.reached, torch.zeros(pad, dtype=torch.float64)])
            self.predicted = torch.cat([self.predicted, torch.zeros(pad, dtype=torch.float64)])
        return self.reached, self.predicted
