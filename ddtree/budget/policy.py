"""Budget policies: how many draft nodes each round's tree gets.

``FixedBudget(n)`` gives every round ``n``; ``AutoBudget`` (``tree_budget="auto"``)
picks the budget whose expected tokens per second is highest under a latency
model of the target's verify forward (``ddtree.budget.latency``).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

import torch

from ddtree.budget.latency import COST_MODEL, LatencyModel, ProfiledLatency
from ddtree.core.builders import TreeBuilder, best_first
from ddtree.core.tree import DraftTree

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BudgetPolicy(Protocol):
    """Chooses the tree budget each round. One instance serves one generation (it may learn as it goes).

    ``prepare`` runs before a round, outside the round's draft and verify stages
    (profiling goes there); while ``skip_draft`` is true the round decodes one
    plain step without drafting. ``choose`` sees the round's draft log-probs
    ``[B, D, V]``; ``observe`` sees the verified tree and its verify time;
    ``describe`` is what the generation's stats report. Subclass it to inherit
    the defaults of ``prepare``, ``skip_draft``, ``observe`` and ``describe``.
    """

    skip_draft: bool = False

    def prepare(self, context_len: int, batch: int) -> None:
        return None

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        ...

    def observe(self, tree: DraftTree, result, verify_seconds: float, context_len: int) -> None:
        return None

    def describe(self) -> dict:
        return {"policy": type(self).__name__}


class FixedBudget(BudgetPolicy):
    """The same budget every round."""

    def __init__(self, budget: int):
        check_budget(budget)
        self.budget = budget

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        return self.budget

    def describe(self) -> dict:
        return {"policy": "fixed", "budget": self.budget}


POLICY_PARTS = ("skip_draft", "prepare", "choose", "observe", "describe")


def check_budget(budget) -> None:
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
    """The ``BudgetPolicy`` behind ``tree_budget="auto"``; the cost model is in the module docstring."""

    def __init__(
        self,
        latency: LatencyModel,
        builder: TreeBuilder = best_first,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        overhead_seconds: float | None = None,
        prior_rounds: float = 4.0,
        forget: float = 0.97,
        ema: float = 0.2,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not candidates or any(int(c) < 0 for c in candidates):
            raise ValueError(f"candidates must be non-empty budgets >= 0, got {candidates!r}")
        self.latency = latency
        self.clock = clock  # the seconds it reads between rounds (inject a fake one to test deterministically)
        self.builder = builder
        self.candidates = sorted(set(int(c) for c in candidates))
        self.fixed_overhead = overhead_seconds
        self.overhead = overhead_seconds
        self.prior_rounds = prior_rounds
        self.forget = forget
        self.ema = ema
        self.scale = 1.0
        self.reached: torch.Tensor | None = None  # [D] decayed count of rounds that reached depth d
        self.predicted: torch.Tensor | None = None  # [D] decayed sum of p_d over verified trees
        self.rounds = 0
        self.choices: dict[int, int] = {}
        self.last: dict = {}
        self.batch = 1
        self.skip_draft = False
        self.plain_rounds = 0
        self.plain_seconds: float | None = None  # observed wall time of a round that did not draft
        self._last_prepare: float | None = None
        self._plain_streak = 0
        self._measured: set[int] | None = None
        self._last_choose: float | None = None
        self._last_context = -1
        self._last_verify: float | None = None

    @classmethod
    def for_generator(cls, generator, latency: LatencyModel | None = None, **options) -> "AutoBudget":
        """A policy for one generation on ``generator``: its builder, and ``latency`` (default: a new
        profile of its own target; pass a shared :class:`ProfiledLatency` to profile once per generator)."""
        candidates = options.pop("candidates", DEFAULT_CANDIDATES)
        repeats = options.pop("repeats", 3)
        if latency is None:
            latency = ProfiledLatency(generator, [1] + [c + 1 for c in candidates], repeats=repeats,
                                      clock=options.get("clock", time.perf_counter))
        return cls(latency, builder=generator.builder, candidates=candidates, **options)

    # ------------------------------------------------------------------ the model

    def calibration(self, depth: int) -> torch.Tensor:
        """``c_d`` for depths ``1..depth``."""
        c = torch.ones(depth, dtype=torch.float64)
        if self.reached is not None:
            n = min(depth, self.reached.numel())
            c[:n] = (self.prior_rounds + self.reached[:n]) / (self.prior_rounds + self.predicted[:n])
        return c

    def reach_probabilities(self, logprobs: torch.Tensor, top: int | None = None) -> torch.Tensor:
        """``p_d(n)`` ``[len(candidates), D]`` for every candidate, from one tree at budget ``top``
        (default the largest candidate; larger candidates get the budget-``top`` figures)."""
        bsz, depth, _ = logprobs.shape
        out = torch.zeros(len(self.candidates), depth, dtype=torch.float64)
        top = self.candidates[-1] if top is None else top
        if top == 0 or depth == 0:
            return out
        tree = self.builder(torch.zeros(bsz, dtype=torch.long, device=logprobs.device), logprobs, top)
        probs = tree.scores[:, 1:].double().exp().cpu()  # [B, N-1]
        depths = tree.depths[:, 1:].cpu()
        per_depth = torch.zeros(bsz, probs.shape[1], depth, dtype=torch.float64)
        per_depth.scatter_(2, (depths - 1).clamp(0, depth - 1)[..., None], probs[..., None])
        cum = per_depth.cumsum(dim=1).mean(dim=0)  # [N-1, D], averaged over rows
        for i, n in enumerate(self.candidates):
            if n > 0:
                out[i] = cum[min(n, cum.shape[0]) - 1]
        return out.clamp(max=1.0)

    def expected_tokens(self, reach: torch.Tensor) -> torch.Tensor:
        """``E[tokens | n]`` per candidate from ``p_d(n)`` ``[C, D]`` and the calibration."""
        r = (reach * self.calibration(reach.shape[1])).clamp(max=1.0)
        r = torch.cummin(r, dim=1).values  # reaching depth d needs depth d-1
        return 1.0 + r.sum(dim=1)

    def round_seconds(self, context: int) -> list[float]:
        lat = self.latency
        overhead = self.overhead if self.overhead is not None else lat.seconds(1, context, self.batch)
        return [overhead + self.scale * lat.seconds(n + 1, context, self.batch) for n in self.candidates]

    # ------------------------------------------------------------------ BudgetPolicy

    PLAIN_STREAK = 8
    """Rounds decoded without a draft before a tree is tried again (costs and the drafter's calibration move)."""

    def prepare(self, context_len: int, batch: int) -> None:
        """Profile the context bucket and batch now (before the round, not inside its stages), and decide
        whether this round drafts at all: ``skip_draft`` when one plain step (the roots alone) is expected
        to commit more tokens per second than the best tree did at the last choice."""
        self.batch = batch
        measured = getattr(self.latency, "measured", None)
        self._measured = measured(context_len, batch) if measured is not None else None
        now = self.clock()
        if self.skip_draft and self._last_prepare is not None:  # the round just ended decoded plainly: its cost
            observed = now - self._last_prepare
            if self.plain_seconds is None:
                self.plain_seconds = observed
            elif observed < 5 * self.plain_seconds:
                self.plain_seconds += self.ema * (observed - self.plain_seconds)
        self._last_prepare = now
        self.skip_draft = self._plain_wins(context_len)
        if self.skip_draft:
            self.plain_rounds += 1
            self._last_verify = None  # the next choice must not count these rounds as its overhead

    def _plain_wins(self, context_len: int) -> bool:
        rates = self.last.get("tokens_per_second")
        timed = self._measured is None or 1 in self._measured
        if not rates or not timed or self._plain_streak >= self.PLAIN_STREAK:
            self._plain_streak = 0
            return False
        seconds = self.plain_seconds
        if seconds is None:  # not seen yet: its verify plus a drafting round's whole overhead (an upper bound)
            verify = self.scale * self.latency.seconds(1, context_len, self.batch)
            seconds = verify + (self.overhead if self.overhead is not None else verify)
        plain = 1.0 / max(seconds, 1e-9)
        if plain > max(rates.values()):
            self._plain_streak += 1
            return True
        self._plain_streak = 0
        return False

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        self._track_overhead(context_len)
        self.batch = logprobs.shape[0]
        seconds = self.round_seconds(context_len)
        # Exact pruning: a candidate that could not beat the slowest-possible rate of another
        # even with every draft accepted is skipped, and the one tree build stays small.
        # A candidate whose verify was never timed (only extrapolated) is never chosen.
        floor_rate = max(1.0 / s for s in seconds)
        viable = [(1 + min(n, logprobs.shape[1])) / s >= floor_rate
                  and (self._measured is None or n == 0 or n + 1 in self._measured)
                  for n, s in zip(self.candidates, seconds)]
        if not any(viable):
            viable = [n == self.candidates[0] for n in self.candidates]
        top = max(n for n, v in zip(self.candidates, viable) if v)
        expected = self.expected_tokens(self.reach_probabilities(logprobs, top)).tolist()
        rates = [e / s if v else 0.0 for e, s, v in zip(expected, seconds, viable)]
        best = max(range(len(rates)), key=lambda i: (rates[i], -i))
        choice = self.candidates[best]
        self.choices[choice] = self.choices.get(choice, 0) + 1
        self.last = {
            "context": context_len,
            "chosen": choice,
            "expected_tokens": {n: round(e, 4) for n, e, v in zip(self.candidates, expected, viable) if v},
            "round_seconds": {n: round(s, 6) for n, s in zip(self.candidates, seconds)},
            "tokens_per_second": {n: round(r, 2) for n, r, v in zip(self.candidates, rates, viable) if v},
            "pruned": [n for n, v in zip(self.candidates, viable) if not v],
        }
        return choice

    def observe(self, tree: DraftTree, result, verify_seconds: float, context_len: int) -> None:
        depth_max = max(1, tree.max_depth)
        bsz = tree.batch_size
        probs = tree.scores[:, 1:].double().exp().cpu()
        depths = (tree.depths[:, 1:].cpu() - 1).clamp(min=0)
        predicted = torch.zeros(bsz, depth_max, dtype=torch.float64)
        predicted = predicted.scatter_add_(1, depths, probs).clamp(max=1.0).mean(dim=0)  # averaged over rows
        accepted = result.num_accepted.cpu()[:, None] - 1
        reached = (torch.arange(1, depth_max + 1)[None] <= accepted).double().mean(dim=0)
        self._grow(depth_max)
        self.reached *= self.forget
        self.predicted *= self.forget
        self.reached[:depth_max] += reached
        self.predicted[:depth_max] += predicted
        profiled = self.latency.seconds(tree.num_nodes, context_len, bsz)
        if profiled > 0 and verify_seconds > 0:
            ratio = min(4.0, max(0.25, verify_seconds / profiled))
            self.scale += self.ema * (ratio - self.scale)
        self._last_verify = verify_seconds
        self.rounds += 1

    def describe(self) -> dict:
        depth = self.reached.numel() if self.reached is not None else 0
        return {
            "policy": "auto",
            "cost_model": COST_MODEL,
            "candidates": list(self.candidates),
            "rounds": self.rounds,
            "plain_rounds": self.plain_rounds,
            "plain_round_seconds": None if self.plain_seconds is None else round(self.plain_seconds, 6),
            "choices": {str(k): v for k, v in sorted(self.choices.items())},
            "overhead_seconds": None if self.overhead is None else round(self.overhead, 6),
            "verify_scale": round(self.scale, 4),
            "depth_calibration": [round(c, 4) for c in self.calibration(depth).tolist()],
            "latency": self.latency.describe(),
            "last_round": self.last,
        }

    # ------------------------------------------------------------------ helpers

    def _grow(self, depth: int) -> None:
        if self.reached is None:
            self.reached = torch.zeros(depth, dtype=torch.float64)
            self.predicted = torch.zeros(depth, dtype=torch.float64)
        elif self.reached.numel() < depth:
            pad = depth - self.reached.numel()
            self.reached = torch.cat([self.reached, torch.zeros(pad, dtype=torch.float64)])
            self.predicted = torch.cat([self.predicted, torch.zeros(pad, dtype=torch.float64)])

    def _track_overhead(self, context_len: int) -> None:
        """Round wall time minus its verify, between consecutive rounds of one sequence."""
        now = self.clock()
        same_sequence = context_len > self._last_context and self._last_verify is not None
        if self.fixed_overhead is None and same_sequence and self._last_choose is not None:
            observed = max(0.0, now - self._last_choose - self._last_verify)
            if self.overhead is None:
                self.overhead = observed
            elif observed < 5 * self.overhead + 1e-3:  # skip outliers (a paused consumer, a new prompt)
                self.overhead += self.ema * (observed - self.overhead)
        self._last_choose = now
        self._last_context = context_len
        if not same_sequence:
            self._last_verify = None
