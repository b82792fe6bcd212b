"""Budget policies: how many draft nodes each round's tree gets, or none.

``FixedBudget(n)`` gives every round ``n``; ``AutoBudget`` (``tree_budget="auto"``) picks,
round by round, a plain step or the tree budget whose expected committed tokens per second
is highest, from round costs it measures as it goes (:mod:`ddtree.budget.costs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from ddtree.budget.costs import RoundCosts
from ddtree.budget.latency import COST_MODEL, LatencyModel
from ddtree.core.builders import TreeBuilder, best_first

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BudgetPolicy(Protocol):
    """Chooses the tree budget each round. One instance serves one generation (it may learn as it goes).

    ``prepare`` runs before a round, outside the round's draft and verify stages;
    while ``skip_draft`` is true the round decodes one plain step without drafting.
    ``choose`` sees the round's draft log-probs ``[B, D, V]``; ``observe`` sees, after
    the round emitted, each row's accepted count (host ints the round read anyway) and
    the verify forward's seconds; ``describe`` is what the generation's stats report.
    Subclass it to inherit the defaults of ``prepare``, ``skip_draft``, ``observe`` and
    ``describe``.
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
    deterministically. Only candidates measured at this batch and context (or priced by ``latency``)
    are chosen; the others, and a plain step, are tried on an exploration schedule: after 2 rounds,
    then 4, 8, ... up to ``explore_every``, back to 2 whenever the best choice changes.
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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not candidates or any(int(c) < 1 for c in candidates):
            raise ValueError(f"candidates must be non-empty tree budgets >= 1 (a plain step is always a choice), "
                             f"got {candidates!r}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 rounds, got {explore_every!r}")
        self.latency = latency
        self.costs = costs if costs is not None else RoundCosts()
        self.clock = clock
        self.builder = builder
        self.candidates = sorted({int(c) for c in candidates})
        self.start = min(self.candidates, key=lambda c: (abs(c - start), c))
        self.fixed_overhead = overhead_seconds
        self.prior_rounds = prior_rounds
        self.forget = forget
        self.ema = ema
        self.explore_every = explore_every
        self.scale = 1.0  # observed verify seconds over the latency model's (when one is given)
        self.reached: torch.Tensor | None = None  # [D] decayed count of rounds that reached depth d
        self.predicted: torch.Tensor | None = None  # [D] decayed sum of p_d over verified trees
        self.rounds = 0
        self.plain_rounds = 0
        self.explorations = 0
        self.choices: dict[int, int] = {}
        self.last: dict = {}
        self.batch = 1
        self.skip_draft = False
        self.best: int | None = None  # 0: plain; None: nothing measured yet
        self._expected: dict[int, float] = {}  # E[tokens | n] summed over rows, at the last choice
        self._expected_batch = 1
        self._interval = 2
        self._explore_in = 2
        self._explore_tree: int | None = None
        self._round_start: float | None = None
        self._pending: dict | None = None  # the round in flight: what it ran, for the costs
        self._predicted_rows: torch.Tensor | None = None  # [B, D] p_d of the chosen tree per row

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
        probs = tree.scores[:, 1:].float().exp()  # [B, N-1]
        nodes = probs.shape[1]
        if nodes == 0:
            return torch.zeros(bsz, len(self.candidates), depth, dtype=torch.float64)
        depths = (tree.depths[:, 1:] - 1).clamp(0, depth - 1)
        per_depth = probs.new_zeros(bsz, nodes, depth).scatter_(2, depths[..., None], probs[..., None])
        cum = per_depth.cumsum(dim=1)  # [B, N-1, D]: the first k nodes' reach by depth
        take = torch.tensor([min(n, nodes) - 1 for n in self.candidates], device=cum.device)
        return cum.index_select(1, take).clamp(max=1.0).cpu().double()

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
            known = self.costs.verify_known(n + 1, batch, context)
        overhead = self._overhead(batch, context)
        if verify is None or overhead is None:
            return None, False
        return overhead + verify, known

    def plain_seconds(self, batch: int, context: int) -> float | None:
        """Seconds of a round that does not draft: measured, else (with a latency model) its verify plus a
        drafting round's overhead (an upper bound)."""
        seconds = self.costs.plain_seconds(batch, context)
        if seconds is None and self.latency is not None:
            overhead = self._overhead(batch, context)
            verify = self.scale * self.latency.seconds(1, context, batch)
            seconds = verify + (overhead if overhead is not None else verify)
        return seconds

    def _overhead(self, batch: int, context: int) -> float | None:
        if self.fixed_overhead is not None:
            return self.fixed_overhead
        learned = self.costs.overhead_seconds(batch, context)
        if learned is None and self.latency is not None:
            return self.scale * self.latency.seconds(1, context, batch)
        return learned

    def _rates(self, batch: int, context: int) -> dict[int, tuple[float, bool]]:
        """Expected tokens per second of every option (0: plain), from the last choice's expected tokens
        (rescaled to ``batch`` rows), and whether it is measured."""
        out = {}
        plain = self.plain_seconds(batch, context)
        if plain is not None:
            out[0] = (batch / max(plain, 1e-12), True)
        for n, tokens in self._expected.items():
            seconds, known = self.tree_seconds(n, batch, context)
            if seconds is not None:
                out[n] = (tokens * batch / self._expected_batch / max(seconds, 1e-12), known)
        return out

    @staticmethod
    def _argmax(rates: dict[int, tuple[float, bool]]) -> int | None:
        known = [(r, -n, n) for n, (r, k) in rates.items() if k]
        return max(known)[2] if known else None

    # ------------------------------------------------------------------ BudgetPolicy

    def prepare(self, context_len: int, batch: int) -> None:
        """Book the round that just ended against its costs, then decide whether this round drafts:
        ``skip_draft`` while a plain step is measured to commit more tokens per second than the best tree,
        or to measure a plain step on the exploration schedule."""
        now = self.clock()
        self._book(now)
        self._round_start = now
        self.batch = batch
        self._explore_tree = None
        self._explore_in -= 1
        explore = self._explore_in <= 0
        if explore:
            self.explorations += 1
            self._interval = min(2 * self._interval, self.explore_every)
            self._explore_in = self._interval
        rates = self._rates(batch, context_len)
        best = self._argmax(rates)
        if best != self.best:
            self._interval = 2
            self._explore_in = min(self._explore_in, self._interval)
        self.best = best
        if not self._expected:  # nothing drafted yet: draft to learn what trees give
            self.skip_draft = False
        elif 0 not in rates:  # a plain step never measured: measure it now
            self.skip_draft = True
        elif explore:
            self.skip_draft = self._explore_target(rates, batch, context_len) == 0
        else:
            self.skip_draft = best == 0
        if self.skip_draft:
            self.plain_rounds += 1
            self._pending = {"plain": True, "batch": batch, "context": context_len}

    def _explore_target(self, rates: dict, batch: int, context: int) -> int:
        """What an exploration round tries (0: a plain step): a hill-climbing step around the best tree (the
        best measured one while plain wins), in the order plain, budgets. A neighbour never measured here
        comes first (downwards while plain wins, upwards otherwise); else the option measured longest ago
        (the best tree itself included while plain wins, so its cost and the drafter stay current)."""
        plain_best = self.best in (0, None)
        anchor = self.best if self.best is not None and not plain_best else self.best_tree(rates)
        order = [0] + self.candidates
        i = order.index(anchor)
        up = [order[i + 1]] if i + 1 < len(order) else []
        down = [order[i - 1]] if i >= 1 else []
        near = down + up if plain_best else up + down
        stamps = self.costs.verify_stamps(batch, context)
        plain = self.costs.plain_estimate(batch, context)

        def stamp(n: int) -> int:
            if n == 0:
                return plain.stamp if plain is not None else -1
            return stamps.get(n + 1, -1)

        unmeasured = [n for n in near if n != 0 and self.latency is None and n + 1 not in stamps]
        options = near + ([anchor] if plain_best else [])
        target = unmeasured[0] if unmeasured else min(options, key=lambda n: (stamp(n), n))
        if target != 0:
            self._explore_tree = target
        return target

    def best_tree(self, rates: dict) -> int:
        """The tree budget of highest measured rate (the start budget before any is measured)."""
        trees = {n: v for n, v in rates.items() if n != 0}
        best = self._argmax(trees)
        return self.start if best is None else best

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        batch = logprobs.shape[0]
        seconds = {n: self.tree_seconds(n, batch, context_len) for n in self.candidates}
        wanted = {n for n in self.candidates if seconds[n][1]} or {self.start}
        if self._explore_tree is not None:
            wanted.add(self._explore_tree)
        top = max(wanted)
        reach = self.row_reach(logprobs, top)  # the round's one host read for the policy
        rows = self.expected_tokens(reach)  # [B, C]
        expected = rows.sum(dim=0).tolist()
        self._expected = {n: e for n, e in zip(self.candidates, expected) if n <= top}
        self._expected_batch = batch
        rates = {n: (e / s, True) for n, e in zip(self.candidates, expected)
                 for s, k in [seconds[n]] if k and s is not None and n <= top}
        best = self._argmax(rates)  # None only when ``rates`` is empty: all its entries are measured
        if self._explore_tree is not None:
            choice = self._explore_tree
        elif best is not None:
            choice = best
        else:
            choice = self.start
        self.choices[choice] = self.choices.get(choice, 0) + 1
        self._predicted_rows = reach[:, self.candidates.index(choice)]
        self._pending = {"plain": False, "nodes": choice + 1, "batch": batch, "context": context_len}
        self.last = {
            "context": context_len,
            "batch": batch,
            "chosen": choice,
            "explored": self._explore_tree is not None,
            "expected_tokens": {n: round(e, 4) for n, e in self._expected.items()},
            "round_seconds": {n: round(s, 6) for n, (s, _) in seconds.items() if s is not None},
            "tokens_per_second": {n: round(r, 2) for n, (r, _) in rates.items()},
        }
        return choice

    def observe(self, accepted: Sequence[int], verify_seconds: float, context_len: int) -> None:
        """Calibrate the drafter against each row's accepted count (root included) and keep the verify
        seconds for the round's costs (booked at the next ``prepare``, when the round's end is known)."""
        pending = self._pending
        if pending is None:
            return
        pending["verify"] = verify_seconds
        self.rounds += 1
        if pending["plain"]:
            return
        predicted_rows = cast(torch.Tensor, self._predicted_rows)  # set by ``choose`` for a drafting round
        if len(accepted) != predicted_rows.shape[0]:
            raise ValueError(f"observe got {len(accepted)} accepted counts for a round of "
                             f"{predicted_rows.shape[0]} rows: pass one count per active row, in row order")
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

    def _book(self, now: float) -> None:
        """The round that ran since the last ``prepare``: its wall seconds into the learned costs."""
        pending, self._pending = self._pending, None
        if pending is None or "verify" not in pending or self._round_start is None:
            return
        seconds = now - self._round_start
        if pending["plain"]:
            self.costs.record_plain(pending["batch"], pending["context"], seconds)
        else:
            self.costs.record_tree(pending["nodes"], pending["batch"], pending["context"], seconds,
                                   pending["verify"])

    def describe(self) -> dict:
        depth = self.reached.numel() if self.reached is not None else 0
        context, batch = self.last.get("context", 0), self.last.get("batch", self.batch)
        plain = self.costs.plain_seconds(batch, context)
        overhead = self._overhead(batch, context)
        return {
            "policy": "auto",
            "cost_model": COST_MODEL,
            "candidates": list(self.candidates),
            "rounds": self.rounds,
            "plain_rounds": self.plain_rounds,
            "explorations": self.explorations,
            "plain_round_seconds": None if plain is None else round(plain, 6),
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
