"""Extra branches grafted into a built tree under its budget (prompt lookup's continuation, a user's paths).

:class:`Branches` holds each row's branches from its root as fixed-shape tensors; :func:`graft_paths` merges
them into a :class:`~ddtree.core.tree.DraftTree` as tensor operations (a loop over branch depths, none over
nodes), so a round that grafts reads nothing back from the device.

The merge: a branch follows the tree's nodes while their tokens match and adds the rest as new nodes; a node
on both keeps the higher score and both source flags. Then ``keep = min(budget, N - 1 + K * D)`` non-root
candidates make the tree, for a tree of ``N`` nodes and ``K`` branches of ``D`` tokens: every row gets the
same, value-independent node count. The tree's first path (:func:`~ddtree.core.tree.first_path`: the
drafter's best guess at each depth) is always kept, so where the drafter is right the graft never costs it
a token; the other places go to the best of the rest by (score descending, depth ascending, candidate index
ascending): the drafter's alternatives and the branches' new nodes compete by score, and the room the tree
leaves under the budget goes to the branches. The kept nodes are listed in that key order (score first).
Scores never rise from parent to child, so the kept nodes include their ancestors. A row with fewer
candidates than ``keep`` (its branches matched the tree, or it has none, while the tree was smaller than the
budget) is filled with pad nodes: copies of the root (its token, parent -1, depth 0, score -inf) that see only
themselves, so the target computes for them what it computes for the root, and the walk never accepts one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree.core.builders import top_stable
from ddtree.core.tree import DRAFTER, LOOKUP, DraftTree, first_path

HostPaths = list[list[tuple[list[int], list[float]]]]
"""Branches as Python lists: per row, ``(tokens, cumulative scores)`` from the root."""


@dataclass
class Branches:
    """Each row's extra branches from its root: ``tokens`` ``[B, K, D]``, cumulative ``scores`` ``[B, K, D]``
    (non-increasing along a branch), ``lengths`` ``[B, K]`` (how many of a branch's ``D`` places are real; 0:
    no branch). Entries past a branch's length are ignored."""

    tokens: torch.Tensor
    scores: torch.Tensor
    lengths: torch.Tensor

    @property
    def empty(self) -> bool:
        """No places at all (a shape fact, no read): grafting would change nothing."""
        return self.tokens.shape[1] == 0 or self.tokens.shape[2] == 0

    @classmethod
    def from_lists(cls, paths: HostPaths, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> Branches:
        """The tensor form of per-row ``(tokens, scores)`` lists (rows padded to the most branches, branches
        to the longest)."""
        bsz = len(paths)
        k = max((len(row) for row in paths), default=0)
        d = max((len(toks) for row in paths for toks, _ in row), default=0)
        tokens = torch.zeros(bsz, k, d, dtype=torch.long)
        scores = torch.full((bsz, k, d), float("-inf"), dtype=torch.float64)
        lengths = torch.zeros(bsz, k, dtype=torch.long)
        for b, row in enumerate(paths):
            for j, (toks, scs) in enumerate(row):
                if len(toks) != len(scs):
                    raise ValueError(f"row {b}'s branch {j} has {len(toks)} tokens and {len(scs)} scores")
                tokens[b, j, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                scores[b, j, : len(scs)] = torch.tensor(scs, dtype=torch.float64)
                lengths[b, j] = len(toks)
        return cls(tokens.to(device), scores.to(dtype).to(device), lengths.to(device))

    def cat(self, other: Branches) -> Branches:
        """Both sets of branches, ``self``'s first (each row's branches side by side)."""
        d = max(self.tokens.shape[2], other.tokens.shape[2])

        def widen(x: torch.Tensor, fill: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, d - x.shape[2]), value=fill)

        return Branches(torch.cat([widen(self.tokens, 0), widen(other.tokens, 0)], dim=1),
                        torch.cat([widen(self.scores, float("-inf")), widen(other.scores.to(self.scores.dtype),
                                                                             float("-inf"))], dim=1),
                        torch.cat([self.lengths, other.lengths], dim=1))


def as_branches(paths: Branches | HostPaths, like: torch.Tensor) -> Branches:
    """``paths`` as :class:`Branches` on ``like``'s device, scores in its dtype."""
    if isinstance(paths, Branches):
        return Branches(paths.tokens.to(like.device), paths.scores.to(device=like.device, dtype=like.dtype),
                        paths.lengths.to(like.device))
    return Branches.from_lists(paths, like.device, like.dtype)


def graft_paths(tree: DraftTree, paths: Branches | HostPaths, budget: int) -> DraftTree:
    """``tree`` with ``paths`` (:class:`Branches`, or per-row ``(tokens, scores)`` lists) merged in,
    ``min(budget, N - 1 + K * D)`` non-root candidates kept: the tree's first path, then the best of the rest
    (see the module docstring); ``sources`` flags each node's proposers (drafter 1, branch 2, root and pads 0)."""
    if not isinstance(paths, Branches) and len(paths) != tree.batch_size:
        raise ValueError(f"paths are given for {len(paths)} rows, the tree has {tree.batch_size}")
    branches = as_branches(paths, tree.scores)
    if branches.tokens.shape[0] != tree.batch_size:
        raise ValueError(f"branches are given for {branches.tokens.shape[0]} rows, the tree has {tree.batch_size}")
    if branches.empty:
        return tree
    keep = min(budget, tree.num_nodes - 1 + branches.tokens.shape[1] * branches.tokens.shape[2])
    return _select(_merge(tree, branches), tree.tokens[:, 0], keep, first_path(tree))


def graft_cuts(tree: DraftTree, paths: Branches | HostPaths, budgets: Sequence[int]) -> DraftTree:
    """Row ``b * len(budgets) + i``: ``graft_paths(cut, paths, budgets[i])`` for ``cut`` row ``b`` of ``tree``
    with only its first ``budgets[i]`` draft nodes (the rest as pads), all in one merge, padded to the
    largest's node count. For a builder whose budget-``n`` tree is its first ``n`` nodes (best-first, the
    chain, beams, pairwise trees), these are the trees a round would verify at each budget: what the budget
    policy prices. Every ``budgets[i]`` must be at most ``tree``'s draft nodes."""
    bsz, n = tree.tokens.shape
    if any(b > n - 1 or b < 0 for b in budgets):
        raise ValueError(f"budgets {list(budgets)} must lie in [0, {n - 1}], the tree's draft nodes")
    cuts = len(budgets)
    branches = as_branches(paths, tree.scores)
    rows = torch.arange(bsz, device=tree.tokens.device).repeat_interleave(cuts)
    limit = torch.tensor(list(budgets), device=tree.tokens.device).repeat(bsz)
    index = torch.arange(n, device=tree.tokens.device)
    cut = index[None, :] > limit[:, None]  # [B * cuts, N]: nodes past the budget become pads
    roots = tree.tokens[rows, :1].expand(-1, n)
    sources = (tree.sources[rows] if tree.sources is not None
               else torch.full_like(cut, DRAFTER, dtype=torch.long))
    cut_tree = DraftTree(
        tokens=torch.where(cut, roots, tree.tokens[rows]),
        parents=torch.where(cut, -1, tree.parents[rows]),
        depths=torch.where(cut, 0, tree.depths[rows]),
        scores=torch.where(cut, float("-inf"), tree.scores[rows]),
        visibility=torch.where(cut[:, :, None], torch.eye(n, dtype=torch.bool, device=cut.device),
                               tree.visibility[rows]),
        sources=torch.where(cut, 0, sources),
    )
    branches = Branches(branches.tokens[rows], branches.scores[rows], branches.lengths[rows])
    if branches.empty:
        return cut_tree
    places = branches.tokens.shape[1] * branches.tokens.shape[2]
    keep = min(max(budgets, default=0), n - 1 + places)
    # each cut's own keep, min(budget, its nodes + places), is its budget: a cut has as many nodes as that
    return _select(_merge(cut_tree, branches), cut_tree.tokens[:, 0], keep, first_path(cut_tree), limit)


@dataclass
class _Candidates:
    """The tree's nodes then one slot per branch place, ``[B, C]`` (``visibility`` ``[B, C, C]``, as 0/1
    bytes); ``real`` marks the tree's nodes and the slots a branch filled."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    sources: torch.Tensor
    real: torch.Tensor
    visibility: torch.Tensor


def _merge(tree: DraftTree, branches: Branches) -> _Candidates:
    """Walk every row's branches down the tree at once, one branch after another: a branch follows, place by
    place, the first real candidate with its token under the current node, and fills its own slots from the
    first place that has none."""
    bsz, n = tree.tokens.shape
    _, k, d = branches.tokens.shape
    device = tree.tokens.device
    extra = k * d

    def grow(x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        return torch.cat([x, x.new_full((bsz, extra), fill)], dim=1)

    sources = (tree.sources.long() if tree.sources is not None
               else torch.full((bsz, n), DRAFTER, dtype=torch.long, device=device))
    sources = torch.cat([sources.new_zeros(bsz, 1), sources[:, 1:]], dim=1)  # the root is nobody's proposal
    cand = _Candidates(
        tokens=grow(tree.tokens.long(), 0),
        parents=grow(tree.parents.long(), -1),
        depths=grow(tree.depths.long(), 0),
        scores=grow(tree.scores, float("-inf")),
        sources=grow(sources, 0),
        real=torch.cat([(tree.parents >= 0) | (torch.arange(n, device=device) == 0),  # a pad stays one
                        torch.zeros(bsz, extra, dtype=torch.bool, device=device)], dim=1),
        # as bytes: inductor's CPU code for this file's gathers of a padded boolean matrix fails to compile
        # (torch 2.13: a blend of VecMask<int> and VecMask<float>)
        visibility=torch.nn.functional.pad(tree.visibility.to(torch.uint8), (0, extra, 0, extra)),
    )
    lengths = branches.lengths.to(device)
    for j in range(k):
        _walk(cand, branches.tokens[:, j], branches.scores[:, j], lengths[:, j], n + j * d)
    return cand


def _walk(cand: _Candidates, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor, base: int) -> None:
    """One branch per row (``tokens``/``scores`` ``[B, D]``, ``length`` ``[B]`` places) into ``cand``, its
    slots at ``base ..``: every place at once. The walk follows, at each place, the first real candidate (by
    index) with the place's token under the node it stands on, so the candidates it follows are those whose
    every ancestor (and itself) is such a first one matching the branch at its depth; it stops at the deepest,
    and the places after it become a chain of new slots under it."""
    bsz, c = cand.tokens.shape
    d = tokens.shape[1]
    index = torch.arange(c, device=cand.tokens.device)
    depth = cand.depths
    place = (depth - 1).clamp(0, d - 1)
    matches = cand.real & (depth >= 1) & (depth <= length[:, None]) & (cand.tokens == tokens.gather(1, place))
    earlier_twin = ((cand.parents[:, :, None] == cand.parents[:, None, :])
                    & (cand.tokens[:, :, None] == cand.tokens[:, None, :])
                    & cand.real[:, None, :] & (index[None, :] < index[:, None]))  # [B, x, y]: y is x's earlier twin
    first = matches & ~earlier_twin.any(dim=2)
    followed = first & ~(cand.visibility.bool() & ~(first | (index == 0))[:, None, :]).any(dim=2)  # its whole path
    cand.scores = torch.where(followed, torch.maximum(cand.scores, scores.gather(1, place)), cand.scores)
    cand.sources = torch.where(followed, cand.sources | LOOKUP, cand.sources)
    stop = torch.where(followed, depth, 0).amax(dim=1)  # [B]: places followed; the branch adds from there
    node = torch.where(stop > 0, (followed & (depth == stop[:, None])).long().argmax(dim=1), 0)
    at = torch.arange(d, device=index.device)
    add = (at[None, :] >= stop[:, None]) & (at[None, :] < length[:, None])  # [B, D]
    slots = base + at
    parent = torch.where(at[None, :] == stop[:, None], node[:, None], (slots - 1)[None, :])
    span = slice(base, base + d)
    cand.tokens[:, span] = torch.where(add, tokens, cand.tokens[:, span])
    cand.parents[:, span] = torch.where(add, parent, cand.parents[:, span])
    cand.depths[:, span] = torch.where(add, at[None, :] + 1, cand.depths[:, span])
    cand.scores[:, span] = torch.where(add, scores.to(cand.scores.dtype), cand.scores[:, span])
    cand.sources[:, span] = torch.where(add, LOOKUP, cand.sources[:, span])
    cand.real[:, span] = add
    above = cand.visibility.gather(1, node[:, None, None].expand(bsz, 1, c))  # [B, 1, C]: the node's ancestors
    chain = (index[None, None, :] >= (base + stop)[:, None, None]) & (index[None, None, :] <= slots[None, :, None])
    cand.visibility[:, span] = ((above.bool() | chain) & add[:, :, None]).to(torch.uint8)


def _select(cand: _Candidates, roots: torch.Tensor, keep: int, first: torch.Tensor,
            limit: torch.Tensor | None = None) -> DraftTree:
    """Each row's ``keep`` non-root candidates, ``first`` (``[B, N]``, over the tree's own nodes) and then the
    best of the rest, listed in key order, as a tree; places no real candidate fills, and those past a row's
    ``limit`` (``[B]``, at most ``keep``), become pad nodes (copies of the root that see only themselves)."""
    bsz, c = cand.tokens.shape
    device = cand.tokens.device
    # Real candidates first, each group by depth: a stable descending selection on score then breaks ties
    # by depth and candidate index, and never prefers a missing candidate to a real one scored -inf.
    rest = torch.where(cand.real[:, 1:], cand.depths[:, 1:], c)
    order = rest.sort(dim=1, stable=True).indices + 1
    ranked = cand.scores.gather(1, order)
    must = torch.nn.functional.pad(first, (0, c - first.shape[1])).gather(1, order)
    _, pick = top_stable(torch.where(must, float("inf"), ranked), keep)  # the first path, then the best
    inside = torch.ones_like(pick, dtype=torch.bool)
    if limit is not None:  # a row's first ``limit`` picks are its own selection
        inside = torch.arange(keep, device=device)[None, :] < limit[:, None]
    pick, back = pick.sort(dim=1)  # back to (depth, candidate) order, then by score: the key order
    inside = inside.gather(1, back)
    scores, by_score = torch.where(inside, ranked.gather(1, pick), float("-inf")).sort(dim=1, descending=True,
                                                                                        stable=True)
    chosen = order.gather(1, pick.gather(1, by_score))  # candidate index of each kept node, [B, keep]
    real = cand.real.gather(1, chosen) & inside.gather(1, by_score)
    node = torch.arange(1, keep + 1, device=device).expand(bsz, keep)
    place = torch.zeros(bsz, c, dtype=torch.long, device=device).scatter(1, chosen, node)  # new index by candidate
    parent = place.gather(1, cand.parents.gather(1, chosen).clamp(min=0))
    nodes = torch.cat([torch.zeros(bsz, 1, dtype=torch.long, device=device), chosen], dim=1)
    live = torch.cat([torch.ones(bsz, 1, dtype=torch.bool, device=device), real], dim=1)
    m = keep + 1
    seen = cand.visibility.gather(1, nodes[:, :, None].expand(bsz, m, c)).gather(2, nodes[:, None, :].expand(bsz, m, m))
    eye = torch.eye(m, dtype=torch.bool, device=device)
    no = torch.full_like(chosen, -1)
    return DraftTree(
        tokens=torch.cat([roots[:, None], torch.where(real, cand.tokens.gather(1, chosen), roots[:, None])], dim=1),
        parents=torch.cat([no.new_full((bsz, 1), -1), torch.where(real, parent, no)], dim=1),
        depths=torch.cat([no.new_zeros(bsz, 1), torch.where(real, cand.depths.gather(1, chosen), 0)], dim=1),
        scores=torch.cat([cand.scores.new_zeros(bsz, 1), torch.where(real, scores, float("-inf"))], dim=1),
        visibility=torch.where(live[:, :, None], seen.bool(), eye),
        sources=torch.cat([no.new_zeros(bsz, 1), torch.where(real, cand.sources.gather(1, chosen), 0)], dim=1),
    )
