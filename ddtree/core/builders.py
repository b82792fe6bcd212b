"""Draft token trees and the builders that grow them from per-depth drafter distributions.

A :class:`DraftTree` holds node 0 as the root (the last bonus token, not yet
seen by the target) and ``budget`` draft nodes after it. Parents always come
before their children, so index order is a valid topological order.

A builder is any callable ``builder(root_tokens, logprobs, budget) -> DraftTree``
where ``root_tokens`` is ``[B]``, ``logprobs`` is ``[B, D, V]`` (log-probabilities
for the D positions after the root) and ``budget`` is the number of non-root
nodes wanted. ``best_first``, ``chain`` and ``beam(width, depth)`` ship here.

Tie rule (deterministic, shared by every builder): at one depth, tokens are
ranked by log-prob descending, then by token id ascending. Nodes are ordered by
path score descending, then depth ascending, then the order of their parent,
then their rank. This is exactly the pop order of the published heap
construction when its heap key is ``(-score, depth, parent_pop_index, rank)``.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

from ddtree.core.tree import DraftTree, root_only


class TreeBuilder(Protocol):
    def __call__(self, root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree: ...


def ranked_topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per depth, ordered by log-prob descending then token id ascending."""
    if 0 < k < logprobs.shape[-1]:
        # One place more than asked: a tie straddles the k-th place exactly when the (k+1)-th value equals
        # the k-th (a vocabulary-wide comparison would hold a [B, D, V] count in int64, 18 MB at 152k).
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


def _check_inputs(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> None:
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"tree budget must be an int >= 0 (the number of draft nodes), got {budget!r}")
    if logprobs.dim() != 3:
        raise ValueError(f"draft log-probs must be [batch, depth, vocab], got shape {tuple(logprobs.shape)}")
    if root_tokens.numel() != logprobs.shape[0]:
        raise ValueError(f"{root_tokens.numel()} root tokens for a batch of {logprobs.shape[0]} distributions")


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
    node_tokens = torch.cat([root_tokens.view(bsz, 1).long(), torch.from_numpy(tokens[rows, order]).to(device)], 1)
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

    ``vals``/``toks`` are the ranked top-k lists ``[B, D, k]`` from :func:`ranked_topk`, as
    numpy arrays: the work is many small steps, where numpy's per-call cost is far below
    torch's (the scores are float32 sums either way). ``deep_keep`` (default ``keep``) caps
    the levels below depth 1; see :func:`best_first_from_topk`.

    Dominance pruning leaves the result unchanged: both lists are in key order, so the
    ``(i+1)(j+1) - 1`` pairs ``(i', j') <= (i, j)`` all come before ``(parent i, rank j)``, and
    a pair with ``(i+1)(j+1) > m`` cannot make the level's top ``m``. About ``m * ln(m)``
    pairs remain instead of ``m * k``.
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


def _host(vals: torch.Tensor, toks: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return vals.detach().float().cpu().numpy(), toks.detach().cpu().numpy().astype(np.int64, copy=False)


def best_first(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the ``budget`` nodes of highest path log-prob, depth capped at ``D``.

    Equivalent to the published heap loop (pop best, push next sibling and first
    child) but vectorised per depth: a node in the global top-``budget`` is in
    the top-``budget`` of its own depth, and its parent is too.
    """
    _check_inputs(root_tokens, logprobs, budget)
    if budget == 0 or logprobs.shape[1] == 0:
        return root_only(root_tokens, torch.float32)
    vals, toks = ranked_topk(logprobs.float(), min(budget, logprobs.shape[-1]))
    return best_first_from_topk(root_tokens, vals, toks, budget)


def best_first_from_topk(root_tokens: torch.Tensor, vals: torch.Tensor, toks: torch.Tensor, budget: int) -> DraftTree:
    """:func:`best_first` after its top-k step (``vals``/``toks`` ``[B, D, min(budget, V)]`` from
    :func:`ranked_topk`), split out so benchmarks can time the tree growth alone.

    The levels below depth 1 are first capped at a quarter of the budget, which drafter-like
    distributions never fill at one depth; when the selection shows that a cap may have
    mattered (:func:`_levels_suffice`), the levels are grown again with a 4x larger cap.
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
    """True when capping the deep levels at ``deep_keep`` cannot have changed the tree.

    A capped level holds the first ``deep_keep`` nodes of its depth in key order. If the
    selection leaves at least one of them out, every node beyond the cap comes after that
    one, which already lost to ``budget`` selected nodes: nothing beyond the cap is needed.
    """
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
        return root_only(root_tokens, torch.float32)
    bsz = logprobs.shape[0]
    vals, toks = ranked_topk(logprobs[:, :depth].float(), 1)
    scores = vals[..., 0].cumsum(dim=1)
    parents = torch.arange(-1, depth, device=logprobs.device).expand(bsz, depth + 1)
    tokens = torch.cat([root_tokens.view(bsz, 1).long(), toks[..., 0]], dim=1)
    return DraftTree.from_parents(tokens, parents, torch.cat([scores.new_zeros(bsz, 1), scores], dim=1))


def beam(width: int, depth: int | None = None) -> Callable[[torch.Tensor, torch.Tensor, int], DraftTree]:
    """A builder that keeps the ``width`` best paths per depth, up to ``depth`` deep.

    The tree is the union of the beams (at most ``width * depth`` nodes). The
    ``budget`` argument caps the node count, keeping the best nodes by the tie rule.
    """
    if width < 1 or (depth is not None and depth < 1):
        raise ValueError(f"beam needs width >= 1 and depth >= 1, got width={width}, depth={depth}")

    def build(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
        _check_inputs(root_tokens, logprobs, budget)
        max_depth = logprobs.shape[1] if depth is None else min(depth, logprobs.shape[1])
        if budget == 0 or max_depth == 0:
            return root_only(root_tokens, torch.float32)
        vals, toks = ranked_topk(logprobs[:, :max_depth].float(), min(width, logprobs.shape[-1]))
        levels = _expand_levels(*_host(vals, toks), width, max_depth)
        return _assemble(root_tokens, *levels, budget)

    build.__name__ = f"beam_{width}x{depth if depth is not None else 'D'}"
    build.__qualname__ = build.__name__
    return build


BUILDERS: dict[str, TreeBuilder] = {"best_first": best_first, "chain": chain}


def resolve_builder(builder: str | TreeBuilder) -> TreeBuilder:
    """A builder from a name (``best_first``, ``chain``, ``beam@WxD``, ``module:function``) or a callable."""
    if callable(builder):
        return builder
    if not isinstance(builder, str):
        raise TypeError(f"builder must be a name or a callable, got {type(builder).__name__}")
    if builder in BUILDERS:
        return BUILDERS[builder]
    if builder.startswith("beam@"):
        try:
            w, d = builder[5:].lower().split("x")
            return beam(int(w), int(d))
        except ValueError as exc:
            raise ValueError(f"beam builder must look like 'beam@4x8' (width x depth), got {builder!r}") from exc
    if ":" in builder:
        import importlib

        module_name, _, attr = builder.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"tree builder {builder!r}: cannot import module {module_name!r} ({exc})") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"{builder!r} does not name a callable builder")
        return fn
    raise ValueError(
        f"unknown tree builder {builder!r}: use 'best_first', 'chain', 'beam@WxD', 'module:function' or a callable"
    )
