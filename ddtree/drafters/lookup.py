"""Prompt lookup: propose what followed the latest earlier occurrence of the text just written.

Answers often repeat their prompt or themselves (code, lists, names, a small
model's loops). :class:`PromptLookup` is a drafter with no model: it matches the
last ``n`` committed tokens (plus the root) against everything committed
before, longest ``n`` first, and proposes the continuation of the latest match.
On its own it serves a target that has no trained drafter. :class:`WithLookup`
adds its continuation as one more branch to a model drafter's tree, under the
same node budget (see :func:`ddtree.core.graft.graft_paths`): the drafter's first
path is kept whole, and the branch competes with the drafter's alternatives and
takes the room its tree leaves, so a right drafter loses nothing to it.
Verification is unchanged, so the output stays exact whatever is proposed.

A lookup token's score is ``log(confidence[n])`` per depth, ``n`` being the
matched n-gram length: a longer match is more often continued the same way.
These scores rank the branch against the model drafter's path log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ddtree.core.graft import Branches, as_branches
from ddtree.drafters.base import (
    DraftContext,
    Drafter,
    Proposal,
    StaticDraftContext,
    check_proposal,
    propose_to_depth,
    takes_host_counts,
    takes_host_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_CONFIDENCE = (0.35, 0.6, 0.75, 0.85)
"""Per-token confidence of a lookup match of 1, 2, 3 and >= 4 tokens."""


def lookup_continuation(tokens: np.ndarray, depth: int, max_ngram: int = 4,
                        min_ngram: int = 1) -> tuple[list[int], int]:
    """The ``depth`` tokens after the latest earlier occurrence of the longest matching suffix.

    The copy may run into the text it predicts (as LZ77 copies do): a match ``p``
    tokens back predicts that the text repeats with period ``p``, so a loop is
    proposed to full depth. Returns ``(continuation, n)`` with ``n`` the matched
    suffix length (``([], 0)`` when nothing matches).
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # starts 0 .. length-1-n
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence; its continuation starts here
            period = length - start
            cont = tokens[start:].tolist()
            while len(cont) < depth:
                cont.append(cont[len(cont) - period])
            return cont[:depth], n
    return [], 0


class PromptLookup(Drafter):
    """A model-free drafter: the continuation of the latest earlier match of the last tokens.

    ``propose`` gives per-depth log-probs with the continuation's token at
    ``log(confidence)`` and the rest spread evenly, so any builder makes a tree
    of it (``chain`` gives the plain lookup chain).
    """

    target_layer_ids: list[int] = []
    needs_hidden_states = False

    def __init__(self, vocab_size: int, block_size: int = 8, max_ngram: int = 4, min_ngram: int = 1,
                 confidence: Sequence[float] = DEFAULT_CONFIDENCE) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the root and at least one proposed token), got {block_size}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if not confidence or not all(0.0 < c < 1.0 for c in confidence):
            raise ValueError(f"confidence values must lie in (0, 1), got {confidence!r}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.confidence = tuple(float(c) for c in confidence)

    @classmethod
    def for_target(cls, target: PreTrainedModel, **options: Any) -> PromptLookup:
        return cls(target.get_output_embeddings().weight.shape[0], **options)

    def context_features(self, hidden_states: Sequence[torch.Tensor]) -> None:
        return None

    def new_context(self, batch_size: int = 1) -> LookupContext:
        return LookupContext(self, batch_size)

    def score(self, n: int) -> float:
        """Log-confidence of one token continued from an ``n``-token match."""
        return float(np.log(self.confidence[min(n, len(self.confidence)) - 1]))

    def score_table(self, device: torch.device | str) -> torch.Tensor:
        """``[1 + len(confidence), block_size - 1]``: row ``n`` the cumulative branch scores of an
        ``n``-token match (``n`` past the table: its last row), row 0 unused (no match)."""
        depth = self.block_size - 1
        rows = [[0.0] * depth] + [[self.score(n) * (d + 1) for d in range(depth)]
                                  for n in range(1, len(self.confidence) + 1)]
        return torch.tensor(rows, dtype=torch.float32, device=device)

    def logprob_table(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per match length ``n`` (0: none), the log-prob of each token off the continuation and of its token:
        ``log((1 - c) / (V - 1))`` and ``log(c)``, or a uniform ``-log(V)`` for no match."""
        v = self.vocab_size
        spread = [-float(np.log(v))] + [float(np.log((1.0 - c) / (v - 1))) for c in self.confidence]
        hit = [-float(np.log(v))] + [float(np.log(c)) for c in self.confidence]
        return (torch.tensor(spread, dtype=torch.float32, device=device),
                torch.tensor(hit, dtype=torch.float32, device=device))


class LookupContext(DraftContext):
    """Each row's committed tokens in one device buffer ``[B, capacity]``; the match runs as tensor ops, so a
    round that looks up reads nothing back from the device (the host keeps an upper bound of each row's
    length, exact when the round passes ``host_counts``, to size the buffer and the scan)."""

    def __init__(self, lookup: PromptLookup, batch_size: int) -> None:
        self.lookup = lookup
        self.tokens: torch.Tensor | None = None  # [B, capacity], made on the first append's device
        self.lengths: torch.Tensor | None = None  # [B]
        self.host_lengths = [0] * batch_size  # upper bounds of ``lengths`` (equal when host counts are given)

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None = None,
               host_counts: Sequence[int] | None = None) -> None:
        bsz, t = tokens.shape
        device = tokens.device
        if self.tokens is None or self.lengths is None:
            self.tokens = torch.zeros(bsz, 256, dtype=torch.long, device=device)
            self.lengths = torch.zeros(bsz, dtype=torch.long, device=device)
        need = max(self.host_lengths) + t + 1  # every row writes all t columns; one more for the root
        if need > self.tokens.shape[1]:
            grown = self.tokens.new_zeros(bsz, max(need, 2 * self.tokens.shape[1]))  # doubling: few copies
            grown[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = grown
        columns = self.lengths[:, None] + torch.arange(t, device=device)  # columns past a row's count: stale
        self.tokens.scatter_(1, columns, tokens.long())
        self.lengths = self.lengths + (t if counts is None else counts.to(device=device, dtype=torch.long))
        added = [t] * bsz if counts is None or host_counts is None else list(host_counts)
        self.host_lengths = [n + a for n, a in zip(self.host_lengths, added)]

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int] | None = None) -> None:
        keep = [int(r) for r in rows] if host_rows is None else list(host_rows)
        self.host_lengths = [self.host_lengths[i] for i in keep]
        if self.tokens is not None and self.lengths is not None:
            index = rows.to(self.tokens.device)
            self.tokens, self.lengths = self.tokens.index_select(0, index), self.lengths.index_select(0, index)

    def continuations(self, root_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the ``block_size - 1`` tokens after the latest earlier occurrence of the longest suffix
        (root included) that occurred before, and that suffix's length (0: no match, tokens 0): what
        :func:`lookup_continuation` gives, for every row at once."""
        roots = root_tokens.view(-1).long()
        if self.tokens is None or self.lengths is None:  # nothing committed: nothing to match
            zeros = torch.zeros(roots.shape[0], dtype=torch.long, device=roots.device)
            return zeros[:, None].expand(-1, self.lookup.block_size - 1).clone(), zeros
        width = max(self.host_lengths) + 1  # the longest text with its root
        return match_continuations(self.lookup, self.tokens[:, :width], self.lengths, roots)

    def paths(self, root_tokens: torch.Tensor) -> Branches:
        """Each row's lookup branch (one, of ``block_size - 1`` tokens; length 0 where nothing matches), scored
        ``log(confidence[n]) * depth``."""
        return lookup_branches(self.lookup, *self.continuations(root_tokens))

    def propose(self, root_tokens: torch.Tensor, depth: int | None = None) -> Proposal:
        return lookup_proposal(self.lookup, *self.continuations(root_tokens))  # cheap at any depth: all of it

    def to_static(self, capacity: int) -> StaticLookupContext:
        """The committed tokens in a fixed ``[B, capacity]`` buffer, for the static round."""
        if self.tokens is None or self.lengths is None:
            raise RuntimeError("the lookup has no context yet: append the prompt first")
        buffer = self.tokens.new_zeros(self.tokens.shape[0], capacity)
        width = min(capacity, self.tokens.shape[1])
        buffer[:, :width] = self.tokens[:, :width]
        return StaticLookupContext(self.lookup, buffer)


def match_continuations(lookup: PromptLookup, tokens: torch.Tensor, lengths: torch.Tensor,
                        roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``block_size - 1`` tokens after the latest earlier occurrence of the longest suffix (root
    included) that occurred before, and that suffix's length (0: no match, tokens 0). ``tokens`` ``[B, W]``
    holds each row's committed text in columns ``0 .. lengths - 1`` (``W`` > every length; later columns are
    ignored), so a fixed ``W`` gives fixed shapes."""
    depth = lookup.block_size - 1
    width = tokens.shape[1]
    seq = tokens.scatter(1, lengths[:, None], roots[:, None])
    total = lengths + 1  # each row's text, root included
    found = torch.zeros_like(total)
    start = torch.zeros_like(total)
    for n in range(min(lookup.max_ngram, width - 1), lookup.min_ngram - 1, -1):
        suffix = seq.gather(1, (total - n).clamp(min=0)[:, None] + torch.arange(n, device=seq.device))
        windows = seq[:, : width - 1].unfold(1, n, 1)  # window j covers j .. j + n - 1
        place = torch.arange(windows.shape[1], device=seq.device)
        hit = (windows == suffix[:, None, :]).all(dim=-1) & (place <= (total - 1 - n)[:, None])
        latest = torch.where(hit, place, -1).amax(dim=1)  # -1: no earlier occurrence
        take = (found == 0) & (latest >= 0)
        found = torch.where(take, n, found)
        start = torch.where(take, latest + n, start)
    period = torch.where(found > 0, total - start, 1)  # a match p back: the text repeats with period p
    index = start[:, None] + torch.arange(depth, device=seq.device) % period[:, None]
    return torch.where(found[:, None] > 0, seq.gather(1, index), 0), found


def lookup_proposal(lookup: PromptLookup, cont: torch.Tensor, found: torch.Tensor) -> Proposal:
    """The continuations as per-depth log-probs (the lookup as a drafter on its own): each depth's token at the
    match's confidence, the rest spread evenly; uniform where nothing matched."""
    bsz, depth = cont.shape
    spread, hit = lookup.logprob_table(cont.device)
    n = found.clamp(max=spread.shape[0] - 1)
    lp = spread.index_select(0, n)[:, None, None].expand(bsz, depth, lookup.vocab_size).clone()
    # Rows without a match write -log(V) over -log(V): unchanged.
    lp.scatter_(2, cont[..., None], hit.index_select(0, n)[:, None, None].expand(bsz, depth, 1).contiguous())
    return Proposal(lp)


def lookup_branches(lookup: PromptLookup, cont: torch.Tensor, found: torch.Tensor) -> Branches:
    """The continuations as one branch per row, scored by their match length (length 0 where none)."""
    table = lookup.score_table(cont.device)  # [1 + len(confidence), D]
    scores = table.index_select(0, found.clamp(max=table.shape[0] - 1))
    lengths = torch.where(found > 0, cont.shape[1], 0)
    return Branches(cont[:, None], scores[:, None], lengths[:, None])


class StaticLookupContext:
    """The lookup in the static round: the committed tokens in one ``[B, capacity]`` buffer written at the
    round's lengths, matched over the whole buffer (columns past a row's length are ignored)."""

    def __init__(self, lookup: PromptLookup, tokens: torch.Tensor) -> None:
        self.lookup = lookup
        self.tokens = tokens

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[1])

    def reserve(self, capacity: int) -> None:
        if capacity > self.capacity:
            self.tokens = torch.nn.functional.pad(self.tokens, (0, capacity - self.capacity))

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        columns = (lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)).clamp(max=self.capacity - 1)
        self.tokens.scatter_(1, columns, tokens.long())

    def branches(self, root_tokens: torch.Tensor, lengths: torch.Tensor) -> Branches:
        roots = root_tokens.view(-1).long()
        return lookup_branches(self.lookup, *match_continuations(self.lookup, self.tokens, lengths, roots))

    def propose(self, root_tokens: torch.Tensor, lengths: torch.Tensor) -> Proposal:
        """The lookup alone as the static round's drafter."""
        roots = root_tokens.view(-1).long()
        return lookup_proposal(self.lookup, *match_continuations(self.lookup, self.tokens, lengths, roots))


class StaticMergedContext:
    """A model drafter's static context plus the static lookup, fed the same tokens (see :class:`MergedContext`)."""

    def __init__(self, model: StaticDraftContext, lookup: StaticLookupContext) -> None:
        self.model, self.lookup = model, lookup

    @property
    def capacity(self) -> int:
        return min(self.model.capacity, self.lookup.capacity)

    def reserve(self, capacity: int) -> None:
        self.model.reserve(capacity)
        self.lookup.reserve(capacity)

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        self.model.append(features, tokens, lengths)
        self.lookup.append(None, tokens, lengths)

    def propose(self, root_tokens: torch.Tensor, lengths: torch.Tensor) -> Proposal:
        proposal = self.model.propose(root_tokens, lengths)
        return with_lookup_branch(proposal, self.lookup.branches(root_tokens, lengths))


def with_lookup_branch(proposal: Proposal, lookup: Branches) -> Proposal:
    """``proposal`` with the lookup's branches after its own paths (an empty path list is none)."""
    own = proposal.paths if proposal.has_paths else None
    return dataclasses.replace(proposal, paths=lookup if own is None else as_branches(own, lookup.scores).cat(lookup))


class WithLookup(Drafter):
    """A model drafter plus a prompt-lookup branch, merged into one tree per round under the same budget (the
    drafter's first path kept whole: :func:`~ddtree.core.graft.graft_paths`)."""

    def __init__(self, drafter: Drafter, lookup: PromptLookup | None = None, vocab_size: int | None = None,
                 **options: Any) -> None:
        self.drafter = drafter
        if lookup is None:
            if vocab_size is None:
                raise ValueError("give WithLookup a PromptLookup, or the vocab_size to build one")
            lookup = PromptLookup(vocab_size, block_size=drafter.block_size, **options)
        self.lookup = lookup
        self.grafted_nodes = lookup.block_size - 1  # the most its branch adds to a tree (one branch, block - 1)
        self.block_size = drafter.block_size
        self.target_layer_ids = drafter.target_layer_ids
        self.needs_hidden_states = drafter.needs_hidden_states
        self.cpu_linear_model = getattr(drafter, "cpu_linear_model", None)

    def context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        return self.drafter.context_features(hidden_states)

    def new_context(self, batch_size: int = 1) -> MergedContext:
        return MergedContext(self.drafter.new_context(batch_size), self.lookup.new_context(batch_size))


class MergedContext(DraftContext):
    """The model drafter's context and the lookup's, fed the same tokens; proposals keep every field of the
    model's (its pairwise scores, its own paths) and add the lookup branch to its paths."""

    def __init__(self, model_context: DraftContext, lookup_context: LookupContext) -> None:
        self.model, self.lookup = model_context, lookup_context
        self._model_host_counts = takes_host_counts(model_context)  # optional in the protocol

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None = None,
               host_counts: Sequence[int] | None = None) -> None:
        if self._model_host_counts:
            self.model.append(features, tokens, counts, host_counts=host_counts)
        else:
            self.model.append(features, tokens, counts)
        self.lookup.append(None, tokens, counts, host_counts=host_counts)

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int] | None = None) -> None:
        if host_rows is not None and takes_host_rows(self.model):
            self.model.select_rows(rows, host_rows=host_rows)
        else:
            self.model.select_rows(rows)
        self.lookup.select_rows(rows, host_rows)

    def to_static(self, capacity: int) -> StaticMergedContext:
        """Both contexts in the static round's fixed buffers (the model context must have its own
        ``to_static``: DFlash and DFlash2 do)."""
        to_static = getattr(self.model, "to_static", None)
        if to_static is None:
            raise ValueError(f"compile=True needs a drafter context with to_static (DFlash, DFlash2); "
                             f"{type(self.model).__name__} has none. Use compile=False")
        return StaticMergedContext(to_static(capacity), self.lookup.to_static(capacity))

    def propose(self, root_tokens: torch.Tensor, depth: int | None = None) -> Proposal:
        proposal = check_proposal(propose_to_depth(self.model, root_tokens, depth), self.model)
        return with_lookup_branch(proposal, self.lookup.paths(root_tokens))
