"""``tree_budget="auto"``: each round, a plain step or the budget that maximises expected tokens per second.

A bigger tree accepts more tokens but costs a longer verify forward; where the
two cross depends on the device, the model, the batch, the context length and
the load on the machine, so the choice is made from measurements, not constants.
The cost model, all of whose terms :meth:`AutoBudget.describe` reports
(``out.stats.budget_policy``)::

    tokens_per_second(n) = sum_rows E[tokens | n] / (overhead(B, ctx) + verify(B rows x n+1 nodes, ctx))
    tokens_per_second(plain) = B / plain(B, ctx)

``verify``, ``overhead``, ``plain``
    Seconds learned from the rounds themselves (:mod:`ddtree.budget.costs`): each
    round's wall time (the policy's clock, read once per round) and its verify
    forward's seconds, by context bucket, batch and node count, as outlier-robust
    moving averages that follow lasting load changes. A budget is chosen only once
    its verify was measured at this batch and context (or lies between measured
    ones); others, and plain steps, are tried on an exploration schedule. A
    :class:`LatencyModel` given to :class:`AutoBudget` prices verify instead
    (``scale * verify``, ``scale`` the observed over modelled ratio).
``E[tokens | n] = 1 + sum_d r_d(n)``
    Per row: ``r_d(n) = min(1, c_d * p_d(n))``, made non-increasing in ``d``; ``p_d(n)`` is
    the drafter's probability that the target's path reaches depth ``d`` in the
    budget-``n`` tree (the sum of ``exp(path log-prob)`` over its depth-``d``
    nodes: the paths are disjoint). ``c_d`` calibrates the drafter online from the
    rows' accepted counts: reached-depth counts over predicted ones, with a prior of
    ``prior_rounds`` rounds at ratio 1 and exponential forgetting.

Before drafting, ``prepare`` compares the plain rate with the best tree's (from
the last drafted round's expected tokens and the current costs); when plain wins
the round skips the draft (``skip_draft``).

The trees of all candidate budgets come from one builder call at the largest
measured candidate: the budget-``n`` tree is taken as its first ``n`` nodes, which is
exact for ``best_first``, ``chain`` and ``beam`` (their nodes are in key order).

:class:`ProfiledLatency` is an opt-in verify profile (a stall before the rounds
that need it) for a policy that should start from measured verify seconds.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ddtree.core.builders import best_first
from ddtree.core.tree import DraftTree

COST_MODEL = (
    "tokens_per_second(n) = sum_rows E[tokens|n] / (overhead(B, ctx) + verify(B x n+1 nodes, ctx)); "
    "tokens_per_second(plain) = B / plain(B, ctx); seconds learned from the rounds by context bucket, batch and "
    "node count; E[tokens|n] = 1 + sum_d min(1, c_d * p_d(n)) (non-increasing in d), p_d(n) = sum of "
    "exp(path log-prob) over the depth-d nodes of the budget-n tree"
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

    def __init__(self, generator: Any, node_counts: Sequence[int], repeats: int = 3, seed: int = 0,
                 time_per_count: float = 0.1, clock: Callable[[], float] = time.perf_counter) -> None:
        self.generator = generator
        self.clock = clock  # times the profiled forwards (inject a fake one to test deterministically)
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
            t0 = self.clock()
            self.profiles[key] = self._measure(self._fit_bucket(bucket), batch)
            self.profile_seconds += self.clock() - t0
        return self.profiles[key]

    def _fit_bucket(self, bucket: int) -> int:
        limit = getattr(self.generator.target.config, "max_position_embeddings", None)
        depth = self.generator.drafter.block_size
        return bucket if limit is None else max(1, min(bucket, limit - depth - 1))

    def _shape_tree(self, nodes: int, vocab: int, device: torch.device) -> DraftTree:
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
        from ddtree.core.masks import tree_position_ids
        from ddtree.runtime.distributed import Lockstep
        from ddtree.targets.cache import new_target_cache, truncate
        from ddtree.targets.forward import PREFILL_CHUNK, chunked_prefill, target_forward

        gen = self.generator
        lockstep = getattr(gen, "lockstep", None) or Lockstep()
        target = gen.target
        device = target.get_input_embeddings().weight.device
        vocab = target.get_input_embeddings().weight.shape[0]
        dtype = next(target.parameters()).dtype
        rng = torch.Generator().manual_seed(self.seed)
        cache = new_target_cache(target)
        prefix = torch.randint(0, vocab, (batch, context), generator=rng).to(device)
        chunked_prefill(target, prefix, cache, getattr(gen, "prefill_chunk", PREFILL_CHUNK))  # last logits only
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        table: dict[int, float] = {}
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
                t0 = self.clock()
                target_forward(target, tokens, positions, cache, hidden=False, **kwargs)
                sync()
                if warm:
                    warm = False
                else:
                    times.append(self.clock() - t0)
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
