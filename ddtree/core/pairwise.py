"""Trees from *pairwise* draft scores: a token's score depends on its parent's token.

A DFlash2 drafter ranks each depth's candidates with a selector that reads the
previous token, so one distribution per depth (what :mod:`ddtree.core.builders`
consumes) cannot describe it. :class:`PairwiseScores` holds, per depth, the
candidate tokens and the log-probability of every candidate given every
candidate of the depth before; the builders here grow trees in which each
child is scored given its *own* parent. Verification does not read these scores:
any deterministic tree is verified exactly, so output stays lossless. Like the
plain builders, these run on the tensors' device with no host reads;
:mod:`ddtree.core.reference_builders` holds the numpy forms they must match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from ddtree.core.builders import (
    TreeBuilder,
    as_logprobs,
    assemble,
    best_first,
    candidate_code,
    chain,
    shape_constant,
    top_stable,
)
from ddtree.core.tree import DraftTree, path_tree, root_only


@dataclass
class PairwiseScores:
    """Per row ``b`` and depth ``d`` (``0 .. D-1``, depth ``d + 1`` in the tree):

    ``candidates`` ``[B, D, K]``: the tokens a depth may hold, in ascending id order (the tie rule);
    ``first`` ``[B, K]``: log-probs of depth 0's candidates given the root token;
    ``table`` ``[B, D-1, K, K]``: ``table[b, d, i, j]`` = log-prob of candidate ``j`` of depth ``d + 1``
    given that depth ``d`` holds candidate ``i``. Each row of ``first``/``table`` sums to 1 in probability.
    """

    candidates: torch.Tensor
    first: torch.Tensor
    table: torch.Tensor

    @property
    def depth(self) -> int:
        return self.candidates.shape[1]

    def greedy_indices(self) -> torch.Tensor:
        """``[B, D]`` candidate indices of the greedy path (each depth's argmax given the choice before), compared
        as float32 like every builder (ties: the first, lowest-id candidate)."""
        idx = [self.first.float().argmax(dim=-1)]
        rows = torch.arange(self.first.shape[0], device=self.first.device)
        for d in range(self.depth - 1):
            idx.append(self.table[rows, d, idx[-1]].float().argmax(dim=-1))
        return torch.stack(idx, dim=1)

    def along(self, indices: torch.Tensor, vocab: int) -> torch.Tensor:
        """Log-probs ``[B, D, vocab]`` (``-inf`` off the candidates) of each depth given the path ``indices``
        ``[B, D]`` before it: the per-depth view that plain builders and budget policies read."""
        rows = torch.arange(indices.shape[0], device=indices.device)
        steps = [self.first] + [self.table[rows, d, indices[:, d]] for d in range(self.depth - 1)]
        dense = torch.stack(steps, dim=1).float()
        out = dense.new_full((*dense.shape[:2], vocab), float("-inf"))
        return out.scatter_(-1, self.candidates, dense)


def chain_pairwise(root_tokens: torch.Tensor, scores: PairwiseScores, budget: int) -> DraftTree:
    """The greedy path, ``min(budget, D)`` nodes deep: each depth's best candidate given the one before."""
    depth = min(budget, scores.depth)
    if depth == 0:
        return root_only(root_tokens, torch.float32)
    bsz = root_tokens.shape[0]
    idx = scores.greedy_indices()[:, :depth]
    rows = torch.arange(bsz, device=idx.device)
    steps = [scores.first[rows, idx[:, 0]]] + [scores.table[rows, d, idx[:, d], idx[:, d + 1]]
                                               for d in range(depth - 1)]
    path = torch.stack(steps, dim=1).float().cumsum(dim=1)
    toks = scores.candidates[:, :depth].gather(-1, idx[..., None])[..., 0]
    out = root_tokens.device
    tokens = torch.cat([root_tokens.reshape(bsz, 1).long(), toks.to(out)], dim=1)
    return path_tree(tokens, torch.cat([path.new_zeros(bsz, 1), path], dim=1).to(out))


def best_first_pairwise(root_tokens: torch.Tensor, scores: PairwiseScores, budget: int) -> DraftTree:
    """DDTree over pairwise scores: the ``budget`` nodes of highest path log-prob, where a child's
    log-prob is read given its own parent's token.

    Path scores never rise along a path, so the best ``budget`` nodes form a tree, and each lies in the
    best ``budget`` of its depth (its parent too): a level keeps only those, and a level's candidates are
    its parents' ``K`` children each, one ``[M, K]`` gather per depth. Ties go by parent order, then
    token id (the candidates are in id order), as in :mod:`ddtree.core.builders`.
    """
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"tree budget must be an int >= 0 (the number of draft nodes), got {budget!r}")
    if budget == 0 or scores.depth == 0:
        return root_only(root_tokens, torch.float32)
    cands = scores.candidates.long()
    first, table = as_logprobs(scores.first.detach().float()), as_logprobs(scores.table.detach().float())
    bsz, depth, k = cands.shape
    level0, levels = shape_constant(_pairwise_plan, k, budget, depth, cands.device)
    best, keep = top_stable(first, budget)  # each level is kept in key order: score, then parent, then id
    level_scores, level_codes = [best], [level0.take(keep)]
    for d, level_codes_d in enumerate(levels, start=1):
        rows = table[:, d - 1].gather(1, keep[..., None].expand(-1, -1, k))  # [B, M, K]: the kept parents' rows
        best, pick = top_stable((level_scores[-1][..., None] + rows).flatten(1), budget)
        keep = pick % k
        level_scores.append(best)
        level_codes.append(level_codes_d.take(pick))
    return assemble(root_tokens, level_scores, level_codes, cands.flatten(1), budget)


@lru_cache(maxsize=256)
def _pairwise_plan(k: int, budget: int, depth: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The codes (:func:`~ddtree.core.builders.candidate_code`) of level 0's candidates (indexed by candidate)
    and of each deeper level's (indexed by parent place ``* k +`` candidate), for :func:`best_first_pairwise`."""
    sizes = [min(budget, k)]
    for _ in range(1, depth):
        sizes.append(min(budget, sizes[-1] * k))
    total, offset, levels = sum(sizes), 0, []
    for d in range(1, depth):
        codes = [candidate_code(offset + p // k, d * k + p % k) for p in range(sizes[d - 1] * k)]
        levels.append(torch.tensor(codes, device=device))
        offset += sizes[d - 1]
    return torch.tensor([candidate_code(total, j) for j in range(k)], device=device), levels


PairwiseBuilder = Callable[[torch.Tensor, PairwiseScores, int], DraftTree]

PAIRWISE_BUILDERS: dict[TreeBuilder, PairwiseBuilder] = {best_first: best_first_pairwise, chain: chain_pairwise}


def pairwise_builder(builder: TreeBuilder) -> PairwiseBuilder | None:
    """The pairwise form of ``builder`` (``best_first`` -> :func:`best_first_pairwise`, ``chain`` ->
    :func:`chain_pairwise`, or its own ``pairwise`` attribute), else ``None``: a builder without one is
    given the per-depth log-probs along the greedy path instead."""
    own = getattr(builder, "pairwise", None)
    if own is not None:
        return own
    return next((pair for plain, pair in PAIRWISE_BUILDERS.items() if plain is builder), None)
