"""``DecodeState``: everything one generation owns, so that generators, drafters and policies stay shareable.

A generator holds models and settings; each ``generate`` / ``stream`` call (or a
custom loop) makes one :class:`DecodeState` with :meth:`SpeculativeGenerator.start`
and advances it with :func:`ddtree.generation.round.speculative_round`. Two states on one
generator never see each other: interleave them, or run them from two threads
one after the other.

Rows are the prompts of a batch. Rows still generating are *active*; they are
the rows of the target cache and of the drafter context, in ``active`` order.
Each active row's committed tokens sit right-aligned in the cache (left
padding, as HF pads), ``lengths[i]`` of them. ``host_lengths`` mirrors ``lengths`` as Python ints, kept up
to date from what a round reads anyway (its accepted counts, once), so that widths, raggedness and slices are
decided on the host without waiting for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ddtree.budget.policy import BudgetPolicy
from ddtree.core.builders import TreeBuilder
from ddtree.core.sampling import SamplingConfig
from ddtree.core.tree import DraftTree
from ddtree.drafters.base import DraftContext, Drafter, takes_host_counts
from ddtree.runtime.distributed import Lockstep
from ddtree.runtime.timing import StageTimer
from ddtree.targets.backends import TreeAttentionBackend
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

    def static_steps(self, budget: int) -> Any: ...


@dataclass
class RoundRecord:
    """One verify round of one row, kept when ``record_trees=True``: its tree and accepted node indices.

    ``start`` is the root's position (the row's committed tokens before the round).
    """

    start: int
    tree: DraftTree
    accepted: list[int]
    bonus: int


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
class DecodeState:
    """One generation: target cache, drafter context, per-row progress, RNG and budget trace."""

    generator: RoundEngine
    prompts: list[torch.Tensor]
    max_new_tokens: int
    sampling: SamplingConfig
    stops: frozenset[int]
    policy: BudgetPolicy | None  # None: plain target-only decoding (budget 0)
    rng: torch.Generator
    timer: StageTimer
    record: bool = False
    prefill_chunk: int | None = PREFILL_CHUNK  # prompt tokens per prefill forward; None: the whole prompt at once
    new_tokens: list[list[int]] = field(default_factory=list)
    acceptance: list[list[int]] = field(default_factory=list)
    records: list[list[RoundRecord]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    cache: Any = None
    draft: DraftContext | None = None
    deferred: list[tuple] = field(default_factory=list)  # drafter-context appends held back (see catch_up_draft):
    # (features, tokens, counts, host_counts)
    lengths: torch.Tensor | None = None  # [A] committed tokens per active row, in the cache
    host_lengths: list[int] = field(default_factory=list)  # the same on the host, kept from the round's one read
    roots: torch.Tensor | None = None  # [A] each active row's last emitted token, not yet in the cache
    draft_takes_host_counts: bool | None = None  # whether draft.append takes host_counts (read once)
    prefilled: bool = False
    rounds: int = 0  # verify rounds (or plain decode steps) after the prefill
    static: Any = None  # the static round's buffers and rows (compile=True), made by its first round
    accepted_by_source: dict[str, int] = field(default_factory=lambda: {"drafter": 0, "lookup": 0, "both": 0})

    def __post_init__(self) -> None:
        rows = len(self.prompts)
        self.new_tokens = [[] for _ in range(rows)]
        self.acceptance = [[] for _ in range(rows)]
        self.records = [[] for _ in range(rows)]
        self.finished = [False] * rows
        self.active = list(range(rows))

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def done(self) -> bool:
        return self.prefilled and not self.active

    def catch_up_draft(self) -> DraftContext | None:
        """The drafter context with the prompt's last prefill chunk taken in.

        The prefill hands that chunk's features to the drafter after it has emitted the first token, not
        before: the first token then waits on the target's prefill alone, and the drafter's share moves
        into the first tree round (which calls this first). A custom loop that reads ``draft`` right after
        the prefill calls this too."""
        if self.deferred:
            with torch.inference_mode(), self.timer.stage("prefill"):
                for features, tokens, counts, host_counts in self.deferred:
                    self.append_draft(features, tokens, counts, host_counts)
            self.deferred.clear()
        return self.draft

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

    def emit(self, row: int, tokens: list[int]) -> list[int]:
        """Append a row's tokens, cut at its first stop token (kept) and at ``max_new_tokens``; returns what was
        appended (the round's output for the row: streams hand out exactly this). Sets ``finished[row]``."""
        room = max(0, self.max_new_tokens - len(self.new_tokens[row]))
        kept = list(tokens[:room])
        for i, tok in enumerate(kept):
            if tok in self.stops:
                kept = kept[: i + 1]
                self.finished[row] = True
                break
        self.new_tokens[row].extend(kept)
        self.finished[row] = self.finished[row] or len(self.new_tokens[row]) >= self.max_new_tokens
        return kept
