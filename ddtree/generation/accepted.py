"""A round's accepted paths on the host: packed for its one read, unpacked, counted and emitted.

The dynamic round (:mod:`ddtree.generation.round`) and the static one (:mod:`ddtree.generation.static_round`)
end the same way: :func:`pack_accepted` puts each row's accepted count, bonus token, path and path tokens (and
their proposers' flags) in one tensor, the round reads it back once (``.tolist()``, at its own site, where the
host-read counters look for it), :func:`unpack_accepted` turns the rows into an :class:`AcceptedOnHost`, and
:func:`observe_accepted` counts the round and :func:`emit_accepted` hands each active row its tokens, through
the one row bookkeeping both rounds keep, :class:`~ddtree.generation.rows.RowBook`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.core.tree import DraftTree
from ddtree.core.verify import VerifyResult
from ddtree.generation.state import DecodeState
from ddtree.generation.stats import RoundRecord


@dataclass
class AcceptedOnHost:
    """A round's one host read: per active row, the accepted count (root included), the bonus token, the
    accepted node indices and their tokens (root first), and their proposers' flags when the tree has them."""

    counts: list[int]
    bonus: list[int]
    paths: list[list[int]]
    tokens: list[list[int]]
    sources: list[list[int]] | None

    def select(self, rows: list[int]) -> AcceptedOnHost:
        """The entries of ``rows`` (tree rows), in that order."""
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return AcceptedOnHost(pick(self.counts), pick(self.bonus), pick(self.paths), pick(self.tokens),
                              None if self.sources is None else pick(self.sources))


def pack_accepted(tree: DraftTree, result: VerifyResult) -> torch.Tensor:
    """``[B, 2 + 2N (+ N)]`` long: each tree row's accepted count, bonus, accepted nodes (``-1`` past the path,
    padded to the tree's ``N`` nodes), their tokens and, when the tree has them, their proposers' flags. Pure
    tensor ops (the static round builds it inside its compiled commit step)."""
    device = tree.tokens.device
    path = result.accepted.clamp(min=0)
    parts = [result.num_accepted[:, None], result.bonus[:, None], result.accepted, tree.tokens.gather(1, path)]
    if tree.sources is not None:
        parts.append(tree.sources.gather(1, path))
    return torch.cat([p.to(device=device, dtype=torch.long) for p in parts], dim=1)


def unpack_accepted(rows: list[list[int]], tree: DraftTree) -> AcceptedOnHost:
    """The host read of :func:`pack_accepted`'s tensor (its rows as lists) for ``tree``, cut to each path."""
    n = tree.num_nodes
    counts = [r[0] for r in rows]
    return AcceptedOnHost(
        counts=counts,
        bonus=[r[1] for r in rows],
        paths=[r[2 : 2 + c] for r, c in zip(rows, counts)],
        tokens=[r[2 + n : 2 + n + c] for r, c in zip(rows, counts)],
        sources=None if tree.sources is None else [r[2 + 2 * n : 2 + 2 * n + c] for r, c in zip(rows, counts)],
    )


def observe_accepted(state: DecodeState, tree: DraftTree, host: AcceptedOnHost, budget: int | None,
                     tree_rows: list[int] | None = None, reason: str | None = None) -> None:
    """Count the round from its host read: ``host`` has one entry per active row (``rows.active`` order), whose
    tree is row ``tree_rows[i]`` of ``tree`` (default ``i``); each row's tree is recorded when recording;
    ``reason``: the policy's for the budget."""
    rows = state.rows
    tree_rows = list(range(len(rows.active))) if tree_rows is None else tree_rows
    records = None
    if state.stats.record:
        records = [RoundRecord(rows.host_lengths[i], tree.row(t), host.paths[i], host.bonus[i])
                   for i, t in enumerate(tree_rows)]
    state.stats.observe(rows.active, host.counts, budget=budget, sources=host.sources, records=records,
                        reason=reason, nodes=None if budget is None else tree.num_nodes - 1)


def emit_accepted(state: DecodeState, host: AcceptedOnHost) -> tuple[list[list[int]], list[int | None]]:
    """Emit each active row's accepted tokens after the root and its bonus token (``host`` in ``rows.active``
    order) and advance ``rows.host_lengths`` by the counts; returns ``(tokens, acceptance)`` per prompt row (a
    :class:`~ddtree.generation.state.RoundResult`'s). Rows that finished are marked, not dropped: each round
    drops them from its own device state, then with :meth:`~ddtree.generation.rows.RowBook.drop_finished`."""
    rows = state.rows
    tokens: list[list[int]] = [[] for _ in rows.prompts]
    acceptance: list[int | None] = [None] * rows.batch_size
    for i, row in enumerate(rows.active):
        acceptance[row] = host.counts[i]
        tokens[row] = rows.emit(row, host.tokens[i][1:] + [host.bonus[i]])
    rows.host_lengths = [n + c for n, c in zip(rows.host_lengths, host.counts)]
    return tokens, acceptance
