"""Longest-branch verification of a draft tree against the target's own decoding rule.

At every node the target makes its choice (argmax, or one draw from its
processed distribution: keyed by the row and the drawn token's position when ``keys`` are given, so every
node at one depth and the plain decoder at that position share one draw). Starting at the root, the walk
follows the child whose token equals that choice; the choice at the last accepted node is the bonus
token. Every emitted token is then exactly what the target would have produced
given its true prefix, so the output is lossless for greedy and sampling alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.core.sampling import GREEDY, SamplingConfig, choose_tokens
from ddtree.core.tree import DraftTree


@dataclass
class VerifyResult:
    """``accepted`` is ``[B, L]`` node indices from the root down (``-1`` pads shorter rows).

    ``num_accepted`` counts the path nodes including the root, which equals the
    tokens emitted this round (accepted drafts + the bonus token).
    """

    accepted: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    choices: torch.Tensor

    @property
    def accepted_tokens_per_row(self) -> list[int]:
        return self.num_accepted.tolist()


def accept_longest_branch(tree: DraftTree, choices: torch.Tensor, length: int | None = None) -> VerifyResult:
    """Vectorised walk: a node is accepted when it and all its ancestors match their parent's choice.

    ``accepted`` gets ``length`` columns when given (at least the longest path: ``tree.num_nodes`` always is),
    so the walk reads nothing back from the device; by default as many as the longest path, which it reads."""
    bsz, n = tree.tokens.shape
    parent_choice = choices.gather(1, tree.parents.clamp(min=0))
    matched = tree.tokens == parent_choice
    matched[:, 0] = True
    ok = ~(tree.visibility & ~matched[:, None, :]).any(dim=-1)  # [B, N]
    deepest = torch.where(ok, tree.depths, torch.full_like(tree.depths, -1)).argmax(dim=1)  # [B]
    rows = torch.arange(bsz, device=choices.device)
    on_path = tree.visibility[rows, deepest]  # ancestors-or-self of the deepest accepted node, [B, N]
    num = on_path.sum(dim=1)
    if length is None:
        length = int(num.max())
    # Ancestors have smaller indices than descendants, so index order is path order.
    order = torch.sort(torch.where(on_path, torch.arange(n, device=choices.device), n), dim=1).values[:, :length]
    accepted = torch.where(order < n, order, torch.full_like(order, -1))
    bonus = choices[rows, deepest]
    return VerifyResult(accepted=accepted, num_accepted=num, bonus=bonus, choices=choices)


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    sampling: SamplingConfig = GREEDY,
    generator: torch.Generator | None = None,
    length: int | None = None,
    *,
    keys: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
) -> VerifyResult:
    """Verify ``tree`` given the target's ``logits`` ``[B, N, V]`` at every node (``length``: see
    :func:`accept_longest_branch`). Sampling draws from ``generator``, or, with ``keys`` ``[B]`` (see
    :func:`ddtree.core.noise.row_keys`) and ``start`` ``[B]`` (each root's position: the row's committed
    length), the keyed draw for the token after each node, at position ``start + depth + 1``."""
    if logits.shape[:2] != tree.tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not cover the tree's {tree.num_nodes} nodes"
        )
    positions = None
    if keys is not None:
        if start is None:
            raise ValueError("keyed verification needs each row's root position (start=, the committed length)")
        positions = start.view(-1, 1).to(tree.depths.device) + tree.depths + 1
    return accept_longest_branch(tree, choose_tokens(logits, sampling, generator, keys=keys, positions=positions),
                                 length)
