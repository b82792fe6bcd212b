"""``RowBook``: the host's bookkeeping of a generation's rows, kept in Python so no decision waits on the device.

Rows are the prompts of a batch. Rows still generating are *active*; the device state holds them in
``active`` order. ``host_lengths`` mirrors the device's committed lengths as Python ints, kept up to date from
what a round reads anyway (its accepted counts, once), so that widths, raggedness and slices are decided on the
host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowBook:
    """Each row's prompt, emitted tokens and stop state; the active rows and their committed lengths."""

    prompts: list[torch.Tensor]
    max_new_tokens: int
    stops: frozenset[int]
    new_tokens: list[list[int]] = field(init=False)  # [row]: what the generation emitted
    finished: list[bool] = field(init=False)  # [row]: stopped (stop token or max_new_tokens)
    active: list[int] = field(init=False)  # the rows still generating, in the device state's row order
    host_lengths: list[int] = field(default_factory=list)  # [active]: committed tokens, as the device's lengths
    prefilled: bool = False

    def __post_init__(self) -> None:
        rows = len(self.prompts)
        self.new_tokens = [[] for _ in range(rows)]
        self.finished = [False] * rows
        self.active = list(range(rows))

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

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

    def drop_finished(self) -> list[int]:
        """Drop the rows that finished from ``active`` and ``host_lengths``; returns the active positions kept
        (select them from the device state)."""
        keep = [i for i, row in enumerate(self.active) if not self.finished[row]]
        self.active = [self.active[i] for i in keep]
        self.host_lengths = [self.host_lengths[i] for i in keep]
        return keep
