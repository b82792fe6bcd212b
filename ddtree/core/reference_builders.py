"""The numpy tree builders: the yardstick the device builders in :mod:`ddtree.core.builders` and
:mod:`ddtree.core.pairwise` must match node for node (tokens, parents, depths, visibility, scores, order).

They copy the top-k lists to the host, grow the levels with numpy and copy the tree back, so a round never
uses them; tests and ``python -m ddtree.bench tree-build`` do. The tie rule is the one documented at the top
of :mod:`ddtree.core.builders`. :func:`graft_paths` is the node-by-node yardstick of
:func:`ddtree.core.graft.graft_paths`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ddtree.core.builders import _check_inputs
from ddtree.core.pairwise import PairwiseScores
from ddtree.core.tree import DRAFTER, LOOKUP, DraftTree


def ranked_topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per depth, ordered by log-prob descending then token id ascending (host tie check)."""
    if 0 < k < logprobs.shape[-1]:
        # A tie straddles the k-th place exactly when the (k+1)-th value equals the k-th.
        vals, toks = logprobs.topk(k + 1, dim=-1)
        if bool((vals[..., k] >= vals[..., k - 1]).any()):
            # topk picks among tied values arbitrarily: the lowest ids must win, so sort exactly.
            toks = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[..., :k]
            return logprobs.gather(-1, toks), toks
        vals, toks = vals[..., :k], toks[..., :k]
    else:
        vals, toks = logprobs.topk(k, dim=-1)
    by_tok = toks.argsort(dim=-1, stable=True)
    vals, toks = vals.gather(-1, by_tok), toks.gather(-1, by_tok)
    by_val = (-vals).argsort(dim=-1, stable=True)
    return vals.gather(-1, by_val), toks.gather(-1, by_val)


def _root_only(root_tokens: torch.Tensor) -> DraftTree:
    bsz = root_tokens.shape[0]
    return DraftTree.from_parents(
        root_tokens.reshape(bsz, 1).long(),
        torch.full((bsz, 1), -1, dtype=torch.long, device=root_tokens.device),
        torch.zeros(bsz, 1, dtype=torch.float32, device=root_tokens.device),
    )


def _assemble(
    root_tokens: torch.Tensor,
    level_scores: list[np.ndarray],
    level_tokens: list[np.ndarray],
    level_parents: list[np.ndarray],
    budget: int,
    order: np.ndarray | None = None,
) -> DraftTree:
    """Select the ``budget`` best candidates over all levels and index them in pop order.

    Levels are concatenated depth-major with each level already in key order, so a
    stable descending sort on score realises the documented tie rule. Depths are the
    level numbers; visibility comes from walking all nodes up to the root together.
    """
    bsz = root_tokens.shape[0]
    sizes = [s.shape[1] for s in level_scores]
    offsets = np.cumsum([0] + sizes[:-1])
    scores = np.concatenate(level_scores, axis=1)
    tokens = np.concatenate(level_tokens, axis=1)
    # Parent ids in the concatenated numbering; -1 means the root.
    parent_ids = np.concatenate(
        [np.full(level_parents[0].shape, -1, dtype=np.int64)]
        + [p + offsets[d - 1] for d, p in enumerate(level_parents) if d > 0],
        axis=1,
    )
    level_depth = np.repeat(np.arange(1, len(sizes) + 1), sizes)
    total = scores.shape[1]
    order = _top_stable(scores, min(budget, total)) if order is None else order
    budget = order.shape[1]
    rows = np.arange(bsz)[:, None]
    final_index = np.zeros((bsz, total + 1), dtype=np.int64)  # slot `total` is the root
    final_index[rows, order] = np.arange(1, budget + 1)
    sel_parent = parent_ids[rows, order]
    sel_parent[sel_parent < 0] = total
    n = budget + 1
    parents = np.concatenate([np.full((bsz, 1), -1), final_index[rows, sel_parent]], axis=1)
    depths = np.concatenate([np.zeros((bsz, 1), dtype=np.int64), level_depth[order]], axis=1)
    # Walk every node up to the root at once, one level per step (the root is its own parent here).
    up = parents.copy()
    up[:, 0] = 0
    steps = [np.broadcast_to(np.arange(n), (bsz, n))]
    for _ in range(len(sizes)):
        steps.append(up[rows, steps[-1]])
    visibility = np.zeros((bsz, n, n), dtype=bool)
    # One flat scatter: entry (b, i, ancestor) sits at (b * n + i) * n + ancestor.
    flat = (np.arange(bsz * n).reshape(bsz, n, 1) * n + np.stack(steps, axis=2)).ravel()
    visibility.reshape(-1)[flat] = True
    device = root_tokens.device
    node_tokens = torch.cat([root_tokens.reshape(bsz, 1).long(), torch.from_numpy(tokens[rows, order]).to(device)], 1)
    node_scores = np.concatenate([np.zeros((bsz, 1), np.float32), scores[rows, order]], axis=1)
    return DraftTree(
        node_tokens,
        torch.from_numpy(parents).to(device),
        torch.from_numpy(depths).to(device),
        torch.from_numpy(node_scores).to(device),
        torch.from_numpy(visibility).to(device),
    )


def _expand_levels(
    vals: np.ndarray, toks: np.ndarray, keep: int, max_depth: int, deep_keep: int | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per depth, keep the ``keep`` best paths (by the tie rule) among extensions of the last level.

    ``vals``/``toks`` are the ranked top-k lists ``[B, D, k]`` as numpy arrays. ``deep_keep``
    (default ``keep``) caps the levels below depth 1; see :func:`best_first_from_topk`.

    Dominance pruning leaves the result unchanged: both lists are in key order, so the
    ``(i+1)(j+1) - 1`` pairs ``(i', j') <= (i, j)`` all come before ``(parent i, rank j)``, and
    a pair with ``(i+1)(j+1) > m`` cannot make the level's top ``m``.
    """
    bsz, _, k = vals.shape
    m = keep if deep_keep is None else deep_keep
    rows = np.arange(bsz)[:, None]
    level_scores, level_tokens, level_parents = [vals[:, 0]], [toks[:, 0]], [np.zeros((bsz, k), dtype=np.int64)]
    dominance = np.minimum(m // np.arange(1, max(k, m) + 1), k)  # widths allowed by (i+1)(j+1) <= m
    pairs: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by parent count: levels repeat their sizes
    for d in range(1, max_depth):
        prev = level_scores[-1]
        if prev.shape[1] not in pairs:
            widths = dominance[: prev.shape[1]]
            widths = widths[widths > 0]  # non-increasing, so this keeps a prefix of the parents
            ii = np.repeat(np.arange(widths.size), widths)
            pairs[prev.shape[1]] = ii, np.arange(ii.size) - np.repeat(np.cumsum(widths) - widths, widths)
        ii, jj = pairs[prev.shape[1]]
        # Row-major (parent, rank) order, so a stable selection breaks score ties by the key.
        cand = prev[:, ii] + vals[:, d, jj]
        pick = _top_stable(cand, m)
        level_scores.append(cand[rows, pick])
        level_parents.append(ii[pick])
        level_tokens.append(toks[:, d][rows, jj[pick]])
    return level_scores, level_tokens, level_parents


def _top_stable(x: np.ndarray, m: int) -> np.ndarray:
    """Per row, the first ``m`` indices of a stable descending sort: partition, then sort the few left."""
    n = x.shape[1]
    if m >= n:
        return np.argsort(-x, axis=1, kind="stable")
    out = np.empty((x.shape[0], m), dtype=np.int64)
    for b, row in enumerate(x):
        kth = np.partition(row, n - m)[n - m]
        idx = np.flatnonzero(row >= kth)  # ties with the m-th value included, in index order
        out[b] = idx[np.argsort(-row[idx], kind="stable")[:m]]
    return out


def _capped(scores: np.ndarray) -> np.ndarray:
    """Scores at most 0, NaN as -inf: the builders' rule (a path's score never rises)."""
    return np.minimum(np.nan_to_num(scores, nan=-np.inf, posinf=0.0, neginf=-np.inf), 0.0)


def _host(vals: torch.Tensor, toks: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return _capped(vals.detach().float().cpu().numpy()), toks.detach().cpu().numpy().astype(np.int64, copy=False)


def best_first(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree with numpy: the ``budget`` nodes of highest path log-prob, depth capped at ``D``."""
    _check_inputs(root_tokens, logprobs, budget)
    if budget == 0 or logprobs.shape[1] == 0:
        return _root_only(root_tokens)
    vals, toks = ranked_topk(logprobs.float(), min(budget, logprobs.shape[-1]))
    return best_first_from_topk(root_tokens, vals, toks, budget)


def best_first_from_topk(root_tokens: torch.Tensor, vals: torch.Tensor, toks: torch.Tensor, budget: int) -> DraftTree:
    """:func:`best_first` after its top-k step.

    The levels below depth 1 are first capped at a quarter of the budget; when the selection
    shows that a cap may have mattered (:func:`_levels_suffice`), they are grown again with a
    4x larger cap.
    """
    host = _host(vals, toks)
    deep_keep = max(16, budget // 4)
    while True:
        levels = _expand_levels(*host, budget, vals.shape[1], deep_keep=min(deep_keep, budget))
        order = _top_stable(np.concatenate(levels[0], axis=1), budget)
        if deep_keep >= budget or _levels_suffice(levels[0], order, deep_keep):
            return _assemble(root_tokens, *levels, budget, order=order)
        deep_keep *= 4


def _levels_suffice(level_scores: list[np.ndarray], order: np.ndarray, deep_keep: int) -> bool:
    """True when capping the deep levels at ``deep_keep`` cannot have changed the tree: if the selection
    leaves out one of a capped level's nodes, every node beyond the cap comes after that one."""
    sizes = np.array([s.shape[1] for s in level_scores])
    level = np.searchsorted(np.cumsum(sizes), order, side="right")  # the level of each selected node
    for row in level:
        chosen = np.bincount(row, minlength=sizes.size)
        if ((chosen[1:] >= sizes[1:]) & (sizes[1:] >= deep_keep)).any():
            return False
    return True


def chain(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DFlash: the drafter's top token at each depth, ``min(budget, D)`` nodes deep."""
    _check_inputs(root_tokens, logprobs, budget)
    depth = min(budget, logprobs.shape[1])
    if depth == 0:
        return _root_only(root_tokens)
    bsz = logprobs.shape[0]
    vals, toks = ranked_topk(logprobs[:, :depth].float(), 1)
    scores = vals[..., 0].cumsum(dim=1)
    parents = torch.arange(-1, depth, device=logprobs.device).expand(bsz, depth + 1)
    tokens = torch.cat([root_tokens.reshape(bsz, 1).long(), toks[..., 0]], dim=1)
    return DraftTree.from_parents(tokens, parents, torch.cat([scores.new_zeros(bsz, 1), scores], dim=1))


def beam(width: int, depth: int | None = None) -> Callable[[torch.Tensor, torch.Tensor, int], DraftTree]:
    """A builder that keeps the ``width`` best paths per depth, up to ``depth`` deep (numpy)."""
    if width < 1 or (depth is not None and depth < 1):
        raise ValueError(f"beam needs width >= 1 and depth >= 1, got width={width}, depth={depth}")

    def build(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
        _check_inputs(root_tokens, logprobs, budget)
        max_depth = logprobs.shape[1] if depth is None else min(depth, logprobs.shape[1])
        if budget == 0 or max_depth == 0:
            return _root_only(root_tokens)
        vals, toks = ranked_topk(logprobs[:, :max_depth].float(), min(width, logprobs.shape[-1]))
        levels = _expand_levels(*_host(vals, toks), width, max_depth)
        return _assemble(root_tokens, *levels, budget)

    return build


def chain_pairwise(root_tokens: torch.Tensor, scores: PairwiseScores, budget: int) -> DraftTree:
    """The greedy path over :class:`~ddtree.core.pairwise.PairwiseScores`, ``min(budget, D)`` nodes deep."""
    depth = min(budget, scores.depth)
    if depth == 0:
        return _root_only(root_tokens)
    bsz = root_tokens.shape[0]
    idx = scores.greedy_indices()[:, :depth]
    rows = torch.arange(bsz, device=idx.device)
    steps = [scores.first[rows, idx[:, 0]]] + [scores.table[rows, d, idx[:, d], idx[:, d + 1]]
                                               for d in range(depth - 1)]
    path = torch.stack(steps, dim=1).float().cumsum(dim=1)
    toks = scores.candidates[:, :depth].gather(-1, idx[..., None])[..., 0]
    parents = torch.arange(-1, depth, device=idx.device).expand(bsz, depth + 1)
    tokens = torch.cat([root_tokens.reshape(bsz, 1).long(), toks.to(root_tokens.device)], dim=1)
    return DraftTree.from_parents(tokens, parents.to(root_tokens.device),
                                  torch.cat([path.new_zeros(bsz, 1), path], dim=1).to(root_tokens.device))


def best_first_pairwise(root_tokens: torch.Tensor, scores: PairwiseScores, budget: int) -> DraftTree:
    """DDTree over :class:`~ddtree.core.pairwise.PairwiseScores` with numpy: each level keeps the best
    ``budget`` of its parents' ``K`` children each."""
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"tree budget must be an int >= 0 (the number of draft nodes), got {budget!r}")
    if budget == 0 or scores.depth == 0:
        return _root_only(root_tokens)
    cands = scores.candidates.detach().cpu().numpy().astype(np.int64, copy=False)
    first = _capped(scores.first.detach().float().cpu().numpy())
    table = _capped(scores.table.detach().float().cpu().numpy())
    bsz, depth, k = cands.shape
    rows = np.arange(bsz)[:, None]
    keep0 = _top_stable(first, min(budget, k))  # each level is kept in key order: score, then parent, then id
    level_scores, level_tokens, level_parents = [first[rows, keep0]], [cands[:, 0][rows, keep0]], [
        np.zeros_like(keep0)]
    level_idx = keep0  # candidate index of each kept node
    for d in range(1, depth):
        child = level_scores[-1][:, :, None] + table[:, d - 1][rows, level_idx]  # [B, M, K]
        flat = child.reshape(bsz, -1)
        pick = _top_stable(flat, min(budget, flat.shape[1]))
        parent, j = np.divmod(pick, k)
        level_scores.append(flat[rows, pick])
        level_tokens.append(cands[:, d][rows, j])
        level_parents.append(parent)
        level_idx = j
    return _assemble(root_tokens, level_scores, level_tokens, level_parents, budget)


def graft_paths(tree: DraftTree, paths: list[list[tuple[list[int], list[float]]]], budget: int) -> DraftTree:
    """:func:`ddtree.core.graft.graft_paths` in Python, node by node: each branch walked down the tree through a
    ``(parent, token) -> child`` table; the tree's first path (from the root, each node's lowest-index child)
    kept, then the best of the rest by ``(-score, depth, index)``, the kept nodes listed in that order; pads
    (copies of the root that see only themselves) where a row has fewer candidates than the others keep."""
    bsz = tree.batch_size
    k = max((len(row) for row in paths), default=0)
    d = max((len(toks) for row in paths for toks, _ in row), default=0)
    if k == 0 or d == 0:
        return tree
    keep = min(budget, tree.num_nodes - 1 + k * d)
    n = keep + 1
    out_t, out_p, out_d, out_s, out_src, out_vis = [], [], [], [], [], []
    for b in range(bsz):
        toks = tree.tokens[b].tolist()
        pars = tree.parents[b].tolist()
        deps = tree.depths[b].tolist()
        scs = [float(x) for x in tree.scores[b].tolist()]
        src = [DRAFTER] * len(toks) if tree.sources is None else tree.sources[b].tolist()
        src[0] = 0
        children: dict[tuple[int, int], int] = {}
        for i in range(1, len(toks)):
            children.setdefault((pars[i], toks[i]), i)
        first, node = set(), 0
        while True:
            kids = [i for i in range(1, len(toks)) if pars[i] == node]
            if not kids:
                break
            node = min(kids)
            first.add(node)
        for branch, branch_scores in paths[b]:
            node = 0
            for tok, score in zip(branch, branch_scores):
                child = children.get((node, int(tok)))
                if child is None:
                    toks.append(int(tok))
                    pars.append(node)
                    deps.append(deps[node] + 1)
                    scs.append(float(score))
                    src.append(LOOKUP)
                    child = len(toks) - 1
                    children[(node, int(tok))] = child
                else:
                    scs[child] = max(scs[child], float(score))
                    src[child] |= LOOKUP
                node = child
        key = {i: (-scs[i], deps[i], i) for i in range(1, len(toks))}
        order = sorted(sorted(key, key=lambda i: (i not in first, key[i]))[:keep], key=key.__getitem__)
        new_index = {0: 0}
        for j, i in enumerate(order, start=1):
            new_index[i] = j
        pads = keep - len(order)
        row_parents = [-1] + [new_index[pars[i]] for i in order] + [-1] * pads
        out_t.append([toks[0]] + [toks[i] for i in order] + [toks[0]] * pads)
        out_p.append(row_parents)
        out_d.append([0] + [deps[i] for i in order] + [0] * pads)
        out_s.append([0.0] + [scs[i] for i in order] + [float("-inf")] * pads)
        out_src.append([0] + [src[i] for i in order] + [0] * pads)
        vis = np.eye(n, dtype=bool)
        for j in range(1, len(order) + 1):  # parents come first, so their rows are complete
            vis[j] |= vis[row_parents[j]]
        out_vis.append(vis)
    device = tree.tokens.device
    return DraftTree(torch.tensor(out_t, device=device), torch.tensor(out_p, device=device),
                     torch.tensor(out_d, device=device), torch.tensor(out_s, dtype=tree.scores.dtype, device=device),
                     torch.from_numpy(np.stack(out_vis)).to(device), torch.tensor(out_src, device=device))
