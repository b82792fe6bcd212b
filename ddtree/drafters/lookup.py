"""Prompt lookup: propose what followed the latest earlier occurrence of the text just written.

Answers often repeat their prompt or themselves (code, lists, names, a small
model's loops). :class:`PromptLookup` is a drafter with no model: it matches the
last ``n`` committed tokens (plus the root) against everything committed
before, longest ``n`` first, and proposes the continuation of the latest match.
On its own it serves a target that has no trained drafter. :class:`WithLookup`
adds its continuation as one more branch to a model drafter's tree, under the
same node budget (see :func:`ddtree.core.tree.graft_paths`), so each round takes
whichever source the target agrees with. Verification is unchanged, so the
output stays exact whatever is proposed.

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

from ddtree.drafters.base import DraftContext, Drafter, Proposal, check_proposal, takes_host_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

"""Bit flags of :attr:`DraftTree.sources`: which proposer put a node in the tree (3: both)."""


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


class LookupContext(DraftContext):
    """Each row's committed tokens, in a growing buffer (appends copy only the new tokens)."""

    def __init__(self, lookup: PromptLookup, batch_size: int) -> None:
        self.lookup = lookup
        self.buffers = [np.zeros(64, dtype=np.int64) for _ in range(batch_size)]
        self.lengths = [0] * batch_size

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None = None,
               host_counts: Sequence[int] | None = None) -> None:
        rows = tokens.detach().cpu().numpy()
        row_counts: list[int]
        if counts is None:
            row_counts = [rows.shape[1]] * rows.shape[0]
        else:
            row_counts = list(host_counts) if host_counts is not None else counts.tolist()
        for b, (row, count) in enumerate(zip(rows, row_counts)):
            need = self.lengths[b] + count
            if need > self.buffers[b].shape[0]:
                grown = np.zeros(max(need, 2 * self.buffers[b].shape[0]), dtype=np.int64)
                grown[: self.lengths[b]] = self.buffers[b][: self.lengths[b]]
                self.buffers[b] = grown
            self.buffers[b][self.lengths[b] : need] = row[:count]
            self.lengths[b] = need

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int] | None = None) -> None:
        keep = [int(r) for r in rows] if host_rows is None else list(host_rows)
        self.buffers = [self.buffers[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]

    def continuations(self, root_tokens: torch.Tensor) -> list[tuple[list[int], int]]:
        lk = self.lookup
        roots = root_tokens.view(-1).tolist()
        out: list[tuple[list[int], int]] = []
        for b, root in enumerate(roots):
            seq = np.append(self.buffers[b][: self.lengths[b]], root)
            out.append(lookup_continuation(seq, lk.block_size - 1, lk.max_ngram, lk.min_ngram))
        return out

    def paths(self, root_tokens: torch.Tensor) -> list[list[tuple[list[int], list[float]]]]:
        """Per row, the lookup branch as ``(tokens, cumulative scores)`` (no branch when nothing matches)."""
        out: list[list[tuple[list[int], list[float]]]] = []
        for cont, n in self.continuations(root_tokens):
            step = self.lookup.score(n) if n else 0.0
            out.append([(cont, [step * (d + 1) for d in range(len(cont))])] if cont else [])
        return out

    def propose(self, root_tokens: torch.Tensor) -> Proposal:
        lk = self.lookup
        depth, vocab = lk.block_size - 1, lk.vocab_size
        rows = root_tokens.numel()
        lp = torch.full((rows, depth, vocab), -float(np.log(vocab)), device=root_tokens.device)
        for b, (cont, n) in enumerate(self.continuations(root_tokens)):
            if not cont:
                continue
            c = lk.confidence[min(n, len(lk.confidence)) - 1]
            lp[b, : len(cont)] = float(np.log((1.0 - c) / (vocab - 1)))
            lp[b, torch.arange(len(cont)), torch.tensor(cont)] = float(np.log(c))
        return Proposal(lp)


class WithLookup(Drafter):
    """A model drafter plus a prompt-lookup branch, merged into one tree per round under the same budget."""

    def __init__(self, drafter: Drafter, lookup: PromptLookup | None = None, vocab_size: int | None = None,
                 **options: Any) -> None:
        self.drafter = drafter
        if lookup is None:
            if vocab_size is None:
                raise ValueError("give WithLookup a PromptLookup, or the vocab_size to build one")
            lookup = PromptLookup(vocab_size, block_size=drafter.block_size, **options)
        self.lookup = lookup
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

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None = None,
               host_counts: Sequence[int] | None = None) -> None:
        self.model.append(features, tokens, counts, host_counts=host_counts)
        self.lookup.append(None, tokens, counts, host_counts=host_counts)

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int] | None = None) -> None:
        if host_rows is not None and takes_host_rows(self.model):
            self.model.select_rows(rows, host_rows=host_rows)
        else:
            self.model.select_rows(rows)
        self.lookup.select_rows(rows, host_rows)

    def propose(self, root_tokens: torch.Tensor) -> Proposal:
        proposal = check_proposal(self.model.propose(root_tokens), self.model)
        lookup = self.lookup.paths(root_tokens)
        paths = lookup if proposal.paths is None else [own + extra for own, extra in zip(proposal.paths, lookup)]
        return dataclasses.replace(proposal, paths=paths)
