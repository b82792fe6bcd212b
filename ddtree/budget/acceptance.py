"""The acceptance model: expected committed tokens per row for each candidate budget (:data:`COST_MODEL`).

``p_d(n)``: the probability, by the proposal's scores, that the target's path reaches depth ``d`` in the
budget-``n`` tree the round would verify (the sum of ``exp(path log-prob)`` over its depth-``d`` nodes); ``c_d``
calibrates it by depth against the accepted counts. :class:`PromptSpread` and :class:`RowProgress` weigh what a
call and a row accept against noise, through one shrinkage rule (:func:`shrink`, empirical Bayes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ddtree.budget.costs import Estimate, Key, nearest
from ddtree.budget.settings import Settings
from ddtree.core.builders import TreeBuilder, best_first
from ddtree.core.graft import graft_cuts
from ddtree.core.tree import DraftTree
from ddtree.drafters.base import Proposal, built_tree

COST_MODEL = ("tokens_per_second(n) = sum_rows E[tokens|n] / (overhead(B, ctx) + verify(B x n+1 nodes, ctx)); "
              "tokens_per_second(plain) = B / plain(B, ctx); E[tokens|n] = 1 + sum_d min(1, c_d * p_d(n)), "
              "non-increasing in d")


@dataclass
class Calibration:
    """Decayed per-depth sums: rounds that reached depth ``d``, and the ``p_d`` the chosen trees predicted."""

    reached: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)

    def factors(self, depth: int, prior_rounds: float) -> list[float]:
        """``c_d`` for depths ``1..depth``: 1 where nothing was measured."""
        known = [(prior_rounds + r) / (prior_rounds + p) for r, p in zip(self.reached, self.predicted)]
        return (known + [1.0] * depth)[:depth]

    def add(self, predicted_rows: Sequence[Sequence[float]], accepted: Sequence[int], forget: float) -> None:
        """One round: ``predicted_rows`` the chosen tree's ``p_d`` per row, ``accepted`` each row's accepted
        count (root included)."""
        depth, rows = max([1, *(len(p) for p in predicted_rows)]), len(accepted)
        grow = [0.0] * (depth - len(self.reached))
        self.reached = [forget * r for r in self.reached + grow]
        self.predicted = [forget * p for p in self.predicted + grow]
        for d in range(depth):
            self.reached[d] += sum(int(a) - 1 > d for a in accepted) / rows
            self.predicted[d] += sum(p[d] for p in predicted_rows if d < len(p)) / rows


@dataclass
class Priced:
    """The candidates' prices, read once: ``expected[b][i]`` ``E[tokens | candidates[i]]`` of row ``b``, and
    ``reach[b][i]`` its ``p_d`` by depth."""

    expected: list[list[float]]
    reach: list[list[list[float]]]


class TreePricer:
    """Prices every candidate from the tree the round would verify, on the device: the builder's tree (or its
    pairwise form) at the largest budget wanted, ordered by score, so its budget-``n`` tree is its first ``n``
    nodes; with lookup branches, each cut grafted as the round would graft it (all in one merge,
    :func:`~ddtree.core.graft.graft_cuts`). Keeps the builder's tree so the round can take the chosen
    budget's cut."""

    def __init__(self, builder: TreeBuilder, candidates: Sequence[int]) -> None:
        self.builder, self.candidates = builder, list(candidates)
        self._built: tuple[Proposal, DraftTree, int] | None = None

    def reach(self, proposal: Proposal, top: int | None = None) -> torch.Tensor:
        """``p_d(n)`` per row ``[B, len(candidates), D]`` on the proposal's device, from one tree at budget
        ``top`` (default the largest candidate; larger candidates get its figures)."""
        logprobs = proposal.logprobs
        bsz, depth, _ = logprobs.shape
        top = self.candidates[-1] if top is None else top
        reach = torch.zeros(bsz, len(self.candidates), depth, device=logprobs.device)
        if top == 0 or depth == 0:
            return reach
        roots = torch.zeros(bsz, dtype=torch.long, device=logprobs.device)
        built = None if proposal.pairwise is not None else self.builder(roots, logprobs, top)
        if built is not None:
            self._built = (proposal, built, top)
        tree = built_tree(proposal, roots, self.builder, top, built)
        nodes = tree.num_nodes - 1
        if nodes == 0:
            return reach
        if proposal.paths is not None and proposal.has_paths:  # each budget's tree grafted on its own
            budgets = sorted({min(n, nodes) for n in self.candidates})  # larger candidates: the top's figures
            cuts = graft_cuts(tree, proposal.paths, budgets)
            mass = _depth_mass(cuts, depth).view(bsz, len(budgets), depth).clamp(max=1.0)
            take = torch.tensor([budgets.index(min(n, nodes)) for n in self.candidates], device=mass.device)
            return mass.index_select(1, take)
        probs = tree.scores[:, 1:].float().exp()  # [B, N-1]
        depths = (tree.depths[:, 1:] - 1).clamp(0, depth - 1)
        per_depth = probs.new_zeros(bsz, nodes, depth).scatter_(2, depths[..., None], probs[..., None])
        take = torch.tensor([min(n, nodes) - 1 for n in self.candidates], device=per_depth.device)
        return per_depth.cumsum(dim=1).index_select(1, take).clamp(max=1.0)

    def price(self, proposal: Proposal, top: int, calibration: Sequence[float]) -> Priced:
        """:meth:`reach` and ``E[tokens | n]`` under ``calibration`` (``c_d``), in the policy's one host read."""
        reach = self.reach(proposal, top)
        c = torch.tensor(list(calibration), dtype=reach.dtype, device=reach.device)
        packed = torch.cat([expected_tokens(reach, c)[..., None], reach], dim=-1).tolist()  # the one read
        return Priced([[n[0] for n in row] for row in packed], [[n[1:] for n in row] for row in packed])

    def tree(self, proposal: Proposal, roots: torch.Tensor, budget: int, builder: TreeBuilder) -> DraftTree | None:
        """The builder's tree for ``proposal`` under ``budget``, cut from the pricing tree when that is exact (the
        same proposal, best-first, a budget within it); else ``None``."""
        if self._built is None or self._built[0] is not proposal or builder is not best_first:
            return None
        _, tree, top = self._built
        if self.builder is not best_first or budget > top:
            return None
        n = min(budget + 1, tree.num_nodes)  # fewer nodes than asked: the candidates ran out in both
        return DraftTree(torch.cat([roots.view(-1, 1).long(), tree.tokens[:, 1:n]], dim=1), tree.parents[:, :n],
                         tree.depths[:, :n], tree.scores[:, :n], tree.visibility[:, :n, :n])


def _depth_mass(tree: DraftTree, depth: int) -> torch.Tensor:
    """``[B, depth]``: each row's ``exp(score)`` summed by depth over its draft nodes (pads add nothing)."""
    probs = tree.scores[:, 1:].float().exp()
    depths = (tree.depths[:, 1:] - 1).clamp(0, depth - 1)
    return probs.new_zeros(tree.batch_size, depth).scatter_add_(1, depths, probs)


def expected_tokens(reach: torch.Tensor, calibration: torch.Tensor) -> torch.Tensor:
    """``E[tokens | n]`` ``[..., C]`` from ``p_d(n)`` ``[..., C, D]`` and ``c_d`` ``[D]``."""
    r = torch.cummin((reach * calibration).clamp(max=1.0), dim=-1).values  # reaching d needs d-1
    return 1.0 + r.sum(dim=-1)


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


def shrink(value: float, centre: float, spread: float, noise: float) -> float:
    """``value`` pulled towards ``centre`` by how much of its distance ``noise`` (its own variance) explains
    against ``spread`` (the true values' variance: their estimates' variance less ``noise``): all the way when
    ``spread <= 0``."""
    return centre if spread <= 0 else centre + spread / (spread + noise) * (value - centre)


@dataclass
class PromptSpread:
    """How far calls' own tokens per row lie apart at one batch size against how much one call's rounds vary:
    the rounds' worth a new call's prior deserves. Calls alike make a strong prior, calls apart a weak one."""

    means: Moments = field(default_factory=Moments)  # of the calls' means
    within: float = 0.0  # summed: each call's variance of a round's tokens per row
    noise: float = 0.0  # summed: each call's variance of its mean

    def add(self, rounds: Moments) -> None:
        self.means.add(rounds.mean)
        self.within += rounds.variance
        self.noise += rounds.variance / max(1, rounds.count)

    def variances(self, least: int) -> tuple[float, float] | None:
        """``(within, between)`` once ``least`` calls tell, else ``None``."""
        n = self.means.count
        return None if n < least else (self.within / n, self.means.variance - self.noise / n)

    def prior_rounds(self, most: float, least: int = 3) -> float | None:
        """The prior's weight in rounds, in ``[1, most]``."""
        spread = self.variances(least)
        if spread is None:
            return None
        within, apart = spread
        return 1.0 if within <= 0 else most if apart <= 0 else min(most, max(1.0, within / apart))

    def unlike(self, mean: float, rounds: int, sigmas: float = 3.0, least: int = 3) -> bool:
        """Whether a call's own mean over ``rounds`` lies ``sigmas`` standard deviations off these calls'."""
        spread = self.variances(least)
        return spread is not None and rounds >= 1 and \
            (mean - self.means.mean) ** 2 > sigmas ** 2 * (max(spread[1], 0.0) + spread[0] / rounds)


class RowProgress:
    """Each active row's tokens over the drafting rounds since the batch last lost a row, to price drafting by
    the row that lags (a call lasts until its last row is done): its mean shrunk towards the batch's by how
    much of the rows' spread their round-to-round noise explains."""

    def __init__(self, min_rounds: int = 4) -> None:
        self.min_rounds = max(2, min_rounds)
        self.rows: list[Moments] = []

    def add(self, accepted: Sequence[int]) -> None:
        """One drafting round's counts, one per active row; another number of rows starts again."""
        if len(accepted) != len(self.rows):
            self.rows = [Moments() for _ in accepted]
        for row, a in zip(self.rows, accepted):
            row.add(float(a))

    def lagging(self, batch: int) -> float | None:
        """The lagging row's expected tokens over the batch's mean: 1.0 for one row, ``None`` until
        ``min_rounds`` rounds of these ``batch`` rows tell a slow row from an unlucky one."""
        if batch < 2:
            return 1.0
        if len(self.rows) != batch or self.rows[0].count < self.min_rounds:
            return None
        means = Moments()
        for row in self.rows:
            means.add(row.mean)
        if means.mean <= 0:
            return 1.0
        noise = sum(row.variance for row in self.rows) / batch / self.rows[0].count  # of one row's mean
        low = shrink(min(row.mean for row in self.rows), means.mean, means.variance - noise, noise)
        return max(0.0, min(1.0, low / means.mean))


class CallTokens:
    """A call's committed tokens per row of a drafting round: a running mean from a prior the earlier calls give
    (their mean at this batch, counted as the rounds their ``spread`` is worth; else the nearest key's figure in
    ``tokens``, else what the policy expected of the first tree, as one round), left once the call's own rounds
    say its prompts are unlike theirs. Its rounds also update ``tokens``, the next call's figures by key. A
    drafting round after plain ones starts from the mean drawn back up towards the call's own (:meth:`_reverted`)."""

    def __init__(self, s: Settings, spread: dict[int, PromptSpread], tokens: dict[Key, Estimate]) -> None:
        self.s, self.spread, self.tokens = s, spread, tokens
        self.estimate: Estimate | None = None
        self.own, self.batch = Moments(), 1  # this call's own rounds, at the batch it started drafting at
        self.idle = 0  # plain rounds since the call last drafted

    def value(self, key: Key) -> float | None:
        """Tokens per row to price drafting at: the call's own, else earlier calls' where they tell."""
        if self.estimate is not None:
            return self.estimate.value
        if self._prior_rounds(key[1]) is not None:
            return self.spread[key[1]].means.mean
        near = nearest(self.tokens, key)
        return None if near is None else self.tokens[near].value

    def add(self, key: Key, value: float, expected: float | None, stamp: int) -> None:
        """One drafting round's tokens per row (``expected``: what the policy expected of it, per row)."""
        s, near = self.s, nearest(self.tokens, key)
        if self.estimate is None:
            rounds = self._prior_rounds(key[1])
            if rounds is not None:
                self.estimate = self._start(self.spread[key[1]].means.mean, max(1, round(rounds)))
            else:
                self.estimate = self._start(expected if near is None else self.tokens[near].value)
            self.own, self.batch = Moments(), key[1]
        else:
            self.estimate.value = self._reverted(self.estimate)
        self.idle = 0
        self.estimate.update(value, stamp)
        self.own.add(value)
        spread = self.spread.get(self.batch)
        if (spread is not None and self.estimate.count > self.own.count + 1 and self.own.count >= s.unlike_after
                and spread.unlike(self.own.mean, self.own.count, s.unlike_sigmas, s.min_generations)):
            self.estimate.value, self.estimate.count = self.own.mean, self.own.count  # not like theirs
            self.estimate.weight = s.tokens_weight
        if key not in self.tokens:  # a nearest key's figure is where the key's estimate starts, not a round
            self.tokens[key] = self._start(expected) if near is None else self._start(self.tokens[near].value, 0)
        self.tokens[key].update(value, stamp)

    def _reverted(self, estimate: Estimate) -> float | None:
        """The running mean, when below the call's whole mean, drawn back up to it by ``forget`` a plain round: a
        poor stretch of text ends, and plain rounds cannot show it, so a retry's one round would otherwise be
        weighed against the stretch. Above it, it stays: plain then won on the seconds (a load), which the cost
        table follows."""
        value, own = estimate.value, self.own
        if value is None or not self.idle or own.count < self.s.min_rounds or value >= own.mean:
            return value
        return own.mean + (value - own.mean) * self.s.forget ** self.idle

    def _prior_rounds(self, batch: int) -> float | None:
        spread = self.spread.get(batch)
        return None if spread is None else spread.prior_rounds(self.s.acceptance_prior, self.s.min_generations)

    def _start(self, value: float | None, rounds: int = 1) -> Estimate:
        """An estimate at ``value``, counted as ``rounds`` rounds of a plain mean (0: a start, not a round)."""
        mean = Estimate(self.s.tokens_weight)
        mean.value = value
        if value is not None and rounds:
            mean.count, mean.averaging, mean.weight = rounds, True, min(mean.weight, 1.0 / rounds)
        return mean
