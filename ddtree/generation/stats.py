"""``RoundStats``: what a generation's rounds did, counted in one place.

The round calls :meth:`RoundStats.observe` once, after its one host read, with what that read gave; the
output (``GenerationOutput``, ``GenerationStats``) is made from these counts alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

from ddtree.core.tree import SOURCE_NAMES, DraftTree


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
class RoundStats:
    """Per row, each round's acceptance (and its tree when ``record``); per round, the budget; the rounds after
    the prefill; and accepted draft tokens by the proposer that put them in the tree."""

    rows: InitVar[int]
    record: bool = False  # keep each round's tree and path (record_trees=True)
    acceptance: list[list[int]] = field(init=False)  # [row][round]: accepted nodes, root included
    records: list[list[RoundRecord]] = field(init=False)  # [row][round], when record
    budgets: list[int] = field(default_factory=list)  # each tree round's budget (0: the policy skipped the draft)
    nodes: list[int] = field(default_factory=list)  # each tree round's draft nodes verified (fewer where none fit)
    reasons: list[str] = field(default_factory=list)  # each tree round's reason for its budget (the policy's)
    rounds: int = 0  # verify rounds (or plain decode steps) after the prefill
    accepted_by_source: dict[str, int] = field(default_factory=lambda: {"drafter": 0, "lookup": 0, "both": 0})

    def __post_init__(self, rows: int) -> None:
        self.acceptance = [[] for _ in range(rows)]
        self.records = [[] for _ in range(rows)]

    def observe(self, rows: Sequence[int], counts: Sequence[int], *, budget: int | None = None,
                sources: Sequence[Sequence[int]] | None = None, records: Sequence[RoundRecord] | None = None,
                reason: str | None = None, nodes: int | None = None) -> None:
        """Count one round: active row ``i`` (batch row ``rows[i]``) accepted ``counts[i]`` nodes, root included.

        ``budget``: the tree round's budget (``None`` for a plain step), ``reason`` why, ``nodes`` the draft nodes
        its tree had (default the budget; fewer where the builder cannot fill it); ``sources[i]``: the
        proposer flags of row ``i``'s accepted nodes, root first, when the tree carries them; ``records[i]``: row
        ``i``'s round, when :attr:`record`."""
        for i, row in enumerate(rows):
            self.acceptance[row].append(counts[i])
            if records is not None:
                self.records[row].append(records[i])
        if budget is not None:
            self.budgets.append(budget)
            self.nodes.append(budget if nodes is None else nodes)
            self.reasons.append(reason or "fixed")
        for flags in sources or ():
            for flag in flags[1:]:
                self.accepted_by_source[SOURCE_NAMES[flag]] += 1
        self.rounds += 1
