"""``tree_budget="auto"``: each round, the budget that maximises expected tokens per second.

A bigger tree accepts more tokens but costs a longer verify forward; where the
two cross depends on the device, the model and the context length, so the
choice is made from measurements, not constants. The cost model, all of whose
terms :meth:`AutoBudget.describe` reports (``out.stats.budget_policy``)::

    tokens_per_second(n) = E[tokens | n] / (overhead + scale * verify(n + 1, bucket(context)))

``verify(nodes, ctx)``
    Seconds of one target forward over a tree of ``nodes`` nodes on top of a
    cache of ``ctx`` tokens, profiled on the real target, device, dtype and
    attention backend (:class:`ProfiledLatency`). Profiled once per context
    bucket (powers of two, at least 64) and cached; a new bucket is profiled
    when the context grows into it. Linear in between profiled node counts.
``scale``
    Observed verify seconds over profiled ones, an exponential moving average:
    folds in the bucket's rounding and machine drift.
``overhead``
    The per-round seconds outside verify (draft, tree build, mask, commit and
    this policy): wall time between two ``choose`` calls minus that round's
    verify, averaged. Before the first round it is taken as ``verify(1)``.
``E[tokens | n] = 1 + sum_d r_d(n)``
    ``r_d(n) = min(1, c_d * p_d(n))``, made non-increasing in ``d``; ``p_d(n)`` is
    the drafter's probability that the target's path reaches depth ``d`` in the
    budget-``n`` tree (the sum of ``exp(path log-prob)`` over its depth-``d``
    nodes: the paths are disjoint). ``c_d`` calibrates the drafter online:
    reached-depth counts over predicted ones, with a prior of ``prior_rounds``
    rounds at ratio 1 and exponential forgetting, so a depth that has not been
    tried for a while drifts back to the prior and gets explored again.

Before drafting, ``prepare`` compares one plain round (the roots alone: one token per
``plain_seconds``, observed once such rounds have run, else ``overhead + scale * verify(1)``)
with the best tree rate of the last choice; when plain wins, the round skips the draft
(``skip_draft``), and a tree is tried again after ``PLAIN_STREAK`` such rounds.

The trees of all candidate budgets come from one builder call at the largest
candidate: the budget-``n`` tree is taken as its first ``n`` nodes, which is
exact for ``best_first``, ``chain`` and ``beam`` (their nodes are in key order).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Protocol, Sequence

import torch

from .tree import DraftTree, TreeBuilder, best_first

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COST_MODEL = (
    "tokens_per_second(n) = E[tokens|n] / (overhead + scale * verify(n+1 nodes, bucket(context))); "
    "E[tokens|n] = 1 + sum_d min(1, c_d * p_d(n)) (non-increasing in d), p_d(n) = sum of exp(path log-prob) "
    "over the depth-d nodes of the budget-n tree"
)


class BudgetPolicy(Protocol):
    """Chooses the tree budget each round. One instance serves one generation (it may learn as it goes).

    ``prepare`` runs before a round, outside the round's stages (profiling goes
    there); ``choose`` sees the round's draft log-probs ``[B, D, V]``; ``observe``
    sees the verified tree and its verify time.
    """

    def prepare(self, context_len: int, batch: int) -> None: ...

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int: ...

    def observe(self, tree: DraftTree, result, verify_seconds: float, context_len: int) -> None: ...


class FixedBudget:
    """The same budget every round."""

    def __init__(self, budget: int):
        check_budget(budget)
        self.budget = budget

    def prepare(self, context_len: int, batch: int) -> None:
        pass

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int:
        return self.budget

    def observe(self, tree: DraftTree, result, verify_seconds: float, context_len: int) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": "fixed", "budget": self.budget}


def check_budget(budget) -> None:
    """A budget is an int >= 0, ``"auto"`` or a :class:`BudgetPolicy`."""
    if isinstance(budget, str) and budget == "auto":
        return
    if all(hasattr(budget, m) for m in ("choose", "observe")):
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(
            f"tree_budget must be an int >= 0 (draft nodes per round; 0 = no drafting), 'auto' "
            f"or a BudgetPolicy, got {budget!r}"
        )


class LatencyModel(Protocol):
    """Seconds of one verify forward over ``nodes`` tree nodes per row, ``batch`` rows, after ``context`` tokens."""

    def seconds(self, nodes: int, context: int, batch: int = 1) -> float: ...

    def describe(self) -> dict: ...


class FunctionLatency:
    """A latency model from a plain function; for known cost models (tests) or external measurements."""

    def __init__(self, fn: Callable[..., float], name: str = "function"):
        self.fn = fn
        self.name = name

    def seconds(self, nodes: int, context: int, batch: int = 1) -> float:
        """``fn(nodes, context)`` at batch 1; ``fn(nodes, context, batch)`` otherwise."""
        return float(self.fn(nodes, context) if batch == 1 else self.fn(nodes, context, batch))

    def describe(self) -> dict:
        return {"kind": self.name}


def synthetic_logprobs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Drafter-like rows ``[1, depth, vocab]``: a confident head (top-1 0.7 fading to 0.35) over a random tail.

    Peaked like a trained drafter, so best_first trees grow deep (a flat random
    distribution would only ever give depth-1 and depth-2 trees): the tree
    shapes the profile times are the shapes rounds verify.
    """
    g = torch.Generator().manual_seed(seed)
    fade = torch.linspace(1.0, 0.5, depth).view(depth, 1)
    head = fade * torch.tensor([0.7, 0.12, 0.05, 0.03])  # [depth, 4]
    tail = torch.softmax(torch.randn(depth, vocab, generator=g) * 1.5, dim=-1) * (1.0 - head.sum(-1, keepdim=True))
    ids = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(depth)])
    probs = tail.scatter_add(1, ids, head)
    return probs.log()[None]


def batch_bucket(batch: int) -> int:
    """The power of two (at least ``batch``) a batch is profiled at: rows finishing one by one re-profile
    a few times, not once per row count."""
    return 1 << max(0, int(batch) - 1).bit_length()


def context_bucket(context: int, minimum: int = 64) -> int:
    """The power of two (at least ``minimum``) that a context length is profiled at."""
    return max(minimum, 1 << max(0, int(context)).bit_length())


class ProfiledLatency:
    """Verify latency measured on the generator's own target, backend and device.

    For a context bucket ``C`` it prefills ``C`` random tokens into a fresh cache,
    then times the tree forward (mask built outside the timing, as in a round)
    for each node count: the fastest of up to ``repeats`` runs, fewer once a count
    has taken ``time_per_count`` seconds (big trees on a CPU are slow and steady),
    cropping the cache back to ``C`` after each. Results are cached per bucket.

    Counts stop once one verifies slower than ``2 * (1 + D)`` times the smallest: even
    with all ``D`` drafts accepted, and an overhead of one small verify, such a tree
    commits fewer tokens per second than the smallest one. Larger counts are
    extrapolated from the last two, and :class:`AutoBudget` never chooses them.

    It measures the model and the machine, not a sequence, so a generator keeps
    one and every generation on it shares the table. Profiles are keyed by
    ``(context bucket, batch bucket)``: a batch verifies one tree per row in one
    forward, timed at the next power of two of its rows.
    """

    def __init__(self, generator, node_counts: Sequence[int], repeats: int = 3, seed: int = 0,
                 time_per_count: float = 0.1):
        self.generator = generator
        self.node_counts = sorted(set(int(n) for n in node_counts))
        self.repeats = repeats
        self.time_per_count = time_per_count
        self.hopeless = 2.0 * max(2, generator.drafter.block_size)
        self.seed = seed
        self.profiles: dict[tuple[int, int], dict[int, float]] = {}
        self.profile_seconds = 0.0
        self._tree: DraftTree | None = None

    def measured(self, context: int, batch: int = 1) -> set[int]:
        """Node counts actually timed for this context bucket and batch (profiling it if needed)."""
        return set(self.profile(context_bucket(context), batch_bucket(batch)))

    def seconds(self, nodes: int, context: int, batch: int = 1) -> float:
        table = self.profile(context_bucket(context), batch_bucket(batch))
        xs = sorted(table)
        i = bisect.bisect_left(xs, nodes)
        if i < len(xs) and xs[i] == nodes:
            return table[nodes]
        if len(xs) == 1:
            return table[xs[0]]
        lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i >= len(xs) else (xs[i - 1], xs[i])
        slope = (table[hi] - table[lo]) / (hi - lo) if hi != lo else 0.0
        return max(table[lo] + slope * (nodes - lo), 1e-6)

    def profile(self, bucket: int, batch: int = 1) -> dict[int, float]:
        key = (bucket, batch)
        if key not in self.profiles:
            t0 = time.perf_counter()
            self.profiles[key] = self._measure(self._fit_bucket(bucket), batch)
            self.profile_seconds += time.perf_counter() - t0
        return self.profiles[key]

    def _fit_bucket(self, bucket: int) -> int:
        limit = getattr(self.generator.target.config, "max_position_embeddings", None)
        depth = self.generator.drafter.block_size
        return bucket if limit is None else max(1, min(bucket, limit - depth - 1))

    def _shape_tree(self, nodes: int, vocab: int, device) -> DraftTree:
        """A realistic tree shape (best_first over drafter-like log-probs); smaller ones are its prefixes."""
        if self._tree is None or self._tree.num_nodes < nodes:
            depth = max(1, self.generator.drafter.block_size - 1)
            lp = synthetic_logprobs(depth, min(vocab, 4096), self.seed)
            self._tree = best_first(torch.zeros(1, dtype=torch.long), lp, max(self.node_counts) - 1)
        parents = self._tree.parents[:, :nodes]
        if parents.shape[1] < nodes:  # a tiny vocabulary caps the tree: hang the rest on the root
            parents = torch.cat([parents, parents.new_zeros(1, nodes - parents.shape[1])], dim=1)
        parents = parents.to(device)
        return DraftTree.from_parents(torch.zeros_like(parents), parents.clone())

    @torch.inference_mode()
    def _measure(self, context: int, batch: int) -> dict[int, float]:
        from .cache import new_target_cache, truncate
        from .masks import tree_position_ids
        from .round import target_forward

        from .distributed import Lockstep

        gen = self.generator
        lockstep = getattr(gen, "lockstep", None) or Lockstep()
        target = gen.target
        device = target.get_input_embeddings().weight.device
        vocab = target.get_input_embeddings().weight.shape[0]
        dtype = next(target.parameters()).dtype
        rng = torch.Generator().manual_seed(self.seed)
        cache = new_target_cache(target)
        target_forward(target, torch.randint(0, vocab, (batch, context), generator=rng).to(device), None, cache)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        table = {}
        for nodes in self.node_counts:
            shape = self._shape_tree(nodes, vocab, device)
            tree = DraftTree.from_parents(torch.zeros(batch, nodes, dtype=torch.long, device=device),
                                          shape.parents.expand(batch, -1).clone())
            tokens = torch.randint(0, vocab, (batch, nodes), generator=rng).to(device)
            kwargs = gen.backend.tree_forward_kwargs(target, tree, context, dtype)
            positions = tree_position_ids(tree.depths, context)
            times: list[float] = []
            warm = not table  # the first forward on a fresh cache pays one-off allocations: untimed
            # Ranks of a tensor-parallel target time the same forwards: rank 0's clock says when to stop.
            while lockstep.share(len(times) < self.repeats and (not times or sum(times) < self.time_per_count)):
                sync()
                t0 = time.perf_counter()
                target_forward(target, tokens, positions, cache, hidden=False, **kwargs)
                sync()
                if warm:
                    warm = False
                else:
                    times.append(time.perf_counter() - t0)
                truncate(cache, context)  # back to the prefix
            table[nodes] = min(times)  # the least disturbed run; `scale` restores typical speed
            if lockstep.share(len(table) > 1 and table[nodes] > self.hopeless * table[self.node_counts[0]]):
                break  # bigger trees cannot pay for themselves here: leave them to extrapolation
        counts = sorted(table)
        for a, b in zip(counts, counts[1:]):  # more nodes never verify faster
            table[b] = max(table[b], table[a])
        return table

    def describe(self) -> dict:
        return {
            "kind": "profiled",
            "repeats": self.repeats,
            "profile_seconds": round(self.profile_seconds, 4),
            "verify_seconds": {
                f"{b}x{r}": {str(n): round(s, 6) for n, s in t.items()} for (b, r), t in sorted(self.profiles.items())
            },
        }


class AutoBudget:
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
    ):
        if not candidates or any(int(c) < 0 for c in candidates):
            raise ValueError(f"candidates must be non-empty budgets >= 0, got {candidates!r}")
        self.latency = latency
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
            latency = ProfiledLatency(generator, [1] + [c + 1 for c in candidates], repeats=repeats)
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
        now = time.perf_counter()
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
        now = time.perf_counter()
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

