"""``DecodeState``: everything one generation owns, so that generators, drafters and policies stay shareable.

A generator holds models and settings; each ``generate`` / ``stream`` call (or a
custom loop) makes one :class:`DecodeState` with :meth:`SpeculativeGenerator.start`
and advances it with :func:`ddtree.generation.round.speculative_round`. Two states on one
generator never see each other: interleave them, or run them from two threads
one after the other.

The state is three parts, one per concern: ``rows`` (:class:`~ddtree.generation.rows.RowBook`, the host's
bookkeeping of each row), ``on_device`` (:class:`DeviceState`, the target cache, the drafter context and the
row tensors) and ``stats`` (:class:`~ddtree.generation.stats.RoundStats`, what the rounds did). Each active
row's committed tokens sit right-aligned in the cache (left padding, as HF pads), ``on_device.lengths[i]`` of
them, mirrored on the host by ``rows.host_lengths[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ddtree.budget.policy import BudgetPolicy
from ddtree.core.builders import TreeBuilder
from ddtree.core.sampling import SamplingConfig
from ddtree.drafters.base import DraftContext, Drafter, takes_host_counts, takes_host_rows
from ddtree.generation.rows import RowBook
from ddtree.generation.stats import RoundRecord, RoundStats
from ddtree.runtime.distributed import Lockstep
from ddtree.runtime.timing import StageTimer
from ddtree.targets.backends import TreeAttentionBackend
from ddtree.targets.cache import select_rows as select_cache_rows
from ddtree.targets.forward import PREFILL_CHUNK, TargetModel


class RoundEngine(Protocol):
    """What a round reads from the object that made its state (a :class:`SpeculativeGenerator`): models
    and settings shared by every generation, never per-generation state."""

    target: TargetModel
    drafter: Drafter
    builder: TreeBuilder
    backend: TreeAttentionBackend
    lockstep: Lockstep

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def compile(self) -> bool | str: ...

    @property
    def numerics(self) -> str: ...

    def static_steps(self, budget: int, sampling: SamplingConfig, *, drafting: bool = True) -> Any: ...

    def keep_static_steps(self) -> None: ...


@dataclass
class RoundResult:
    """What one round committed, per row of the batch (inactive rows: ``[]`` and ``None``).

    ``tokens[b]`` is what the round appended to row ``b``'s output: cut at a stop token (kept) and at
    ``max_new_tokens``, so the rounds' tokens add up to exactly what ``generate`` returns.
    ``acceptance[b]`` counts the tree nodes on row ``b``'s accepted path including
    the root, which is the tokens the round verified for it before any cut;
    ``None`` for the prefill, which emits one token per row and verifies nothing.
    """

    tokens: list[list[int]]
    acceptance: list[int | None]
    finished: list[int]


@dataclass
class DeviceState:
    """What the device holds for the active rows, in ``RowBook.active`` order: the target cache, the drafter
    context (with the prefill's held-back appends), each row's committed length and its root token."""

    cache: Any = None
    draft: DraftContext | None = None
    deferred: list[tuple] = field(default_factory=list)  # drafter-context appends held back (see catch_up_draft):
    # (features, tokens, counts, host_counts)
    lengths: torch.Tensor | None = None  # [A] committed tokens per active row, in the cache
    roots: torch.Tensor | None = None  # [A] each active row's last emitted token, not yet in the cache
    draft_takes_host_counts: bool | None = None  # whether draft.append takes host_counts (read once)
    static: Any = None  # the static round's buffers and rows (compile=True), made by its first tree round
    keys: torch.Tensor | None = None  # [A] each active row's sampling key (ddtree.core.noise); None under greedy

    def append_draft(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None,
                     host_counts: list[int] | None) -> None:
        """``draft.append``, with the host-known counts when the context takes them."""
        draft = self.draft
        assert draft is not None, "the drafter context is made before anything is appended to it"
        if self.draft_takes_host_counts is None:
            self.draft_takes_host_counts = takes_host_counts(draft)
        if self.draft_takes_host_counts:
            draft.append(features, tokens, counts, host_counts=host_counts)
        else:
            draft.append(features, tokens, counts)

    def take_deferred(self) -> None:
        """Give the held-back appends to the drafter context, in order; a run of appends in which every row
        takes all its tokens goes in as one (the drafter projects it in one pass instead of one per round)."""
        for features, tokens, counts, host_counts in _merge_full_runs(self.deferred):
            self.append_draft(features, tokens, counts, host_counts)
        self.deferred.clear()

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the active rows at positions ``keep`` (in order) in the cache, the context and the tensors."""
        lengths, roots = self.lengths, self.roots
        assert lengths is not None and roots is not None, "the prefill sets the row tensors"
        assert not self.deferred, "held-back appends are taken in before rows change"
        index = torch.tensor(keep, dtype=torch.long, device=lengths.device)
        select_cache_rows(self.cache, index)
        if self.draft is not None:
            if takes_host_rows(self.draft):
                self.draft.select_rows(index, host_rows=list(keep))
            else:
                self.draft.select_rows(index)
        self.lengths = lengths.index_select(0, index)
        self.roots = roots.index_select(0, index.to(roots.device))
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))

    def release(self) -> None:
        """Drop the cache and the drafter context: nothing is left to decode, so free the memory now."""
        self.cache = self.draft = None
        self.deferred.clear()


def _is_full(append: tuple) -> bool:
    """Whether every row takes all of this append's tokens (so appending it and the next one equals appending
    their concatenation)."""
    _, tokens, counts, host_counts = append
    return counts is not None and host_counts is not None and all(c == tokens.shape[1] for c in host_counts)


def _merge_full_runs(appends: list[tuple]) -> list[tuple]:
    """``appends`` with each run of consecutive full ones (:func:`_is_full`) concatenated along the tokens."""
    merged: list[tuple] = []
    run: list[tuple] = []
    for append in [*appends, None]:
        if append is not None and _is_full(append):
            run.append(append)
            continue
        if len(run) > 1:
            features = None if run[0][0] is None else torch.cat([a[0] for a in run], dim=1)
            tokens = torch.cat([a[1] for a in run], dim=1)
            counts = torch.stack([a[2] for a in run]).sum(0)
            host_counts = [sum(c) for c in zip(*(a[3] for a in run))]
            merged.append((features, tokens, counts, host_counts))
        else:
            merged.extend(run)
        run = []
        if append is not None:
            merged.append(append)
    return merged


@dataclass
class DecodeState:
    """One generation: its rows (host), its device state, its round statistics, and its settings, seed and
    timer. Sampled tokens are keyed draws (:mod:`ddtree.core.noise`) from ``on_device.keys``: a pure function of
    the seed, the row and the position, so no RNG state advances between rounds."""

    generator: RoundEngine
    rows: RowBook
    sampling: SamplingConfig
    policy: BudgetPolicy | None  # None: plain target-only decoding (budget 0)
    seed: int | list[int] | None  # what keyed this generation's draws (None: greedy, nothing drawn)
    timer: StageTimer
    stats: RoundStats
    prefill_chunk: int | None = PREFILL_CHUNK  # prompt tokens per prefill forward; None: the whole prompt at once
    coupled_drafts: bool = False  # build trees from the drafter's scores plus the keyed noise (options.coupled_at)
    on_device: DeviceState = field(default_factory=DeviceState)

    @property
    def batch_size(self) -> int:
        return self.rows.batch_size

    @property
    def done(self) -> bool:
        return self.rows.prefilled and not self.rows.active

    @property
    def new_tokens(self) -> list[list[int]]:
        """Each row's tokens so far (``rows.new_tokens``)."""
        return self.rows.new_tokens

    @property
    def acceptance(self) -> list[list[int]]:
        """Each row's acceptance per round so far (``stats.acceptance``)."""
        return self.stats.acceptance

    @property
    def records(self) -> list[list[RoundRecord]]:
        """Each row's recorded rounds so far, with ``record_trees=True`` (``stats.records``)."""
        return self.stats.records

    def catch_up_draft(self) -> DraftContext | None:
        """The drafter context with its held-back appends taken in.

        The prefill hands the prompt's last chunk to the drafter after it has emitted the first token, not
        before: the first token then waits on the target's prefill alone. A round that does not draft holds
        its append back too: the drafter is not needed until a round drafts, and a run of held appends goes
        in as one pass. The next drafting round takes them in first (timed as its ``draft``). A custom loop
        that reads the drafter context between rounds takes it from here."""
        held = self.on_device
        if held.deferred:
            with torch.inference_mode(), self.timer.stage("draft"):
                held.take_deferred()
        return held.draft
