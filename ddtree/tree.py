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

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch


@dataclass
class DraftTree:
    """A batch of token trees, all tensors ``[B, N]`` (``visibility`` is ``[B, N, N]``).

    ``scores`` is the path log-probability under the drafter (0 for the root).
    ``visibility[b, i, j]`` is True when ``j`` is ``i`` or one of its ancestors.
    ``sources`` (optional) flags which proposer put each node there
    (:data:`ddtree.lookup.DRAFTER` / ``LOOKUP`` bits), for acceptance by source.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    visibility: torch.Tensor = field(repr=False)
    sources: torch.Tensor | None = field(default=None, repr=False)

    def row(self, b: int) -> "DraftTree":
        """Row ``b`` as a batch-1 tree."""
        pick = slice(b, b + 1)
        return DraftTree(self.tokens[pick], self.parents[pick], self.depths[pick], self.scores[pick],
                         self.visibility[pick], None if self.sources is None else self.sources[pick])

    @classmethod
    def from_parents(
        cls, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor | None = None
    ) -> "DraftTree":
        """Build depths and visibility from parent pointers (``parents[:, 0] == -1``)."""
        if tokens.dim() == 1:
            tokens, parents = tokens[None], parents[None]
            scores = None if scores is None else scores[None]
        if tokens.shape != parents.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ in shape")
        bsz, n = tokens.shape
        if n == 0:
            raise ValueError("a draft tree needs at least the root node, got 0 nodes")
        idx = torch.arange(n, device=tokens.device)
        if (parents[:, 0] != -1).any() or (n > 1 and ((parents[:, 1:] < 0) | (parents[:, 1:] >= idx[1:])).any()):
            raise ValueError("parents must be -1 for the root and point to an earlier node for every other node")
        depths, visibility = _depths_and_visibility(parents)
        if scores is None:
            scores = torch.zeros(bsz, n, dtype=torch.float32, device=tokens.device)
        return cls(tokens, parents, depths, scores, visibility)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return self.tokens.shape[1]

    @property
    def budget(self) -> int:
        return self.num_nodes - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def children(self, node: int, row: int = 0) -> list[int]:
        """Indices of ``node``'s children in row ``row``, in index order."""
        return torch.nonzero(self.parents[row] == node).flatten().tolist()

    def child_table(self, row: int = 0) -> dict[int, dict[int, int]]:
        """``{node: {token: child}}`` for row ``row``; a convenience for custom walks."""
        table: dict[int, dict[int, int]] = {}
        for child, (parent, tok) in enumerate(zip(self.parents[row].tolist(), self.tokens[row].tolist())):
            if parent >= 0:
                table.setdefault(parent, {})[tok] = child
        return table

    def to_networkx(self, row: int = 0):
        """A ``networkx.DiGraph`` with edges parent -> child and node attributes token, depth, score."""
        import networkx as nx

        g = nx.DiGraph()
        toks, deps, scs, pars = (t[row].tolist() for t in (self.tokens, self.depths, self.scores, self.parents))
        for i, (tok, dep, sc) in enumerate(zip(toks, deps, scs)):
            g.add_node(i, token=tok, depth=dep, score=sc)
        g.add_edges_from((p, i) for i, p in enumerate(pars) if p >= 0)
        return g

    def to_dict(self, row: int = 0) -> dict:
        """Plain lists, for JSON."""
        return {
            "tokens": self.tokens[row].tolist(),
            "parents": self.parents[row].tolist(),
            "scores": [float(s) for s in self.scores[row].tolist()],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "DraftTree":
        return cls.from_parents(
            torch.tensor(data["tokens"]), torch.tensor(data["parents"]), torch.tensor(data.get("scores"))
            if data.get("scores") is not None else None,
        )


class TreeBuilder(Protocol):
    def __call__(self, root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree: ...


def _depths_and_visibility(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pointer jumping over ancestors: one vectorised step per depth level."""
    bsz, n = parents.shape
    device = parents.device
    visibility = torch.eye(n, dtype=torch.bool, device=device).expand(bsz, n, n).clone()
    depths = torch.zeros(bsz, n, dtype=torch.long, device=device)
    rows = torch.arange(bsz, device=device)[:, None]
    cols = torch.arange(n, device=device).expand(bsz, n)
    ancestor = parents.clone()
    while True:
        live = ancestor >= 0
        if not live.any():
            break
        depths += live.long()
        safe = ancestor.clamp(min=0)
        visibility[rows.expand(bsz, n)[live], cols[live], safe[live]] = True
        ancestor = torch.where(live, parents.gather(1, safe), ancestor)
    return depths, visibility


def ranked_topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per depth, ordered by log-prob descending then token id ascending."""
    vals, toks = logprobs.topk(k, dim=-1)
    if k < logprobs.shape[-1] and bool(((logprobs >= vals[..., -1:]).sum(dim=-1) > k).any()):
        # Ties straddle the k-th place and topk picks among them arbitrarily: the
        # lowest ids must win, so fall back to an exact stable sort.
        toks = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[..., :k]
        return logprobs.gather(-1, toks), toks
    by_tok = toks.argsort(dim=-1, stable=True)
    vals, toks = vals.gather(-1, by_tok), toks.gather(-1, by_tok)
    by_val = (-vals).argsort(dim=-1, stable=True)
    return vals.gather(-1, by_val), toks.gather(-1, by_val)


def root_only(root_tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> DraftTree:
    """The tree of the roots alone: verifying it is one plain decode step per row."""
    bsz = root_tokens.shape[0]
    return DraftTree.from_parents(
        root_tokens.view(bsz, 1).long(),
        torch.full((bsz, 1), -1, dtype=torch.long, device=root_tokens.device),
        torch.zeros(bsz, 1, dtype=dtype, device=root_tokens.device),
    )


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


def graft_paths(tree: DraftTree, paths: list[list[tuple[list[int], list[float]]]], budget: int) -> DraftTree:
    """Add extra branches to ``tree`` and keep its ``budget`` best non-root nodes by score.

    ``paths[b]`` lists row ``b``'s branches as ``(tokens, scores)`` from the root,
    scores non-increasing along a branch (cumulative log-probs or log-confidences).
    A branch follows the tree's nodes while they match and adds the rest; a node
    on both keeps the higher score. Scores never rise from parent to child, so
    the best ``budget`` nodes (ties broken by depth) include their ancestors.
    Rows are padded to one node count with the best leftover candidates where a
    row has fewer. ``sources`` records each node's origin (drafter 1, branch 2).
    """
    from .lookup import DRAFTER, LOOKUP

    bsz = tree.batch_size
    if len(paths) != bsz:
        raise ValueError(f"paths are given for {len(paths)} rows, the tree has {bsz}")
    rows = []
    for b in range(bsz):
        toks = tree.tokens[b].tolist()
        pars = tree.parents[b].tolist()
        scs = [float(x) for x in tree.scores[b].tolist()]
        src = [DRAFTER] * len(toks) if tree.sources is None else tree.sources[b].tolist()
        src[0] = 0
        children = {}
        for i in range(1, len(toks)):
            children.setdefault((pars[i], toks[i]), i)
        for branch, branch_scores in paths[b]:
            node = 0
            for tok, score in zip(branch, branch_scores):
                child = children.get((node, tok))
                if child is None:
                    toks.append(int(tok))
                    pars.append(node)
                    scs.append(float(score))
                    src.append(LOOKUP)
                    child = len(toks) - 1
                    children[(node, tok)] = child
                else:
                    scs[child] = max(scs[child], float(score))
                    src[child] |= LOOKUP
                node = child
        rows.append((toks, pars, scs, src))
    depth_of = []
    for toks, pars, _, _ in rows:
        d = [0] * len(toks)
        for i in range(1, len(toks)):
            d[i] = d[pars[i]] + 1
        depth_of.append(d)
    keep = min(budget, min(len(r[0]) for r in rows) - 1)
    out_t, out_p, out_s, out_src = [], [], [], []
    for (toks, pars, scs, src), d in zip(rows, depth_of):
        order = sorted(range(1, len(toks)), key=lambda i: (-scs[i], d[i], i))[:keep]
        new_index = {0: 0}
        for j, i in enumerate(order, start=1):
            new_index[i] = j
        out_t.append([toks[0]] + [toks[i] for i in order])
        out_p.append([-1] + [new_index[pars[i]] for i in order])
        out_s.append([0.0] + [scs[i] for i in order])
        out_src.append([0] + [src[i] for i in order])
    device = tree.tokens.device
    grafted = DraftTree.from_parents(torch.tensor(out_t, device=device), torch.tensor(out_p, device=device),
                                     torch.tensor(out_s, dtype=tree.scores.dtype, device=device))
    grafted.sources = torch.tensor(out_src, device=device)
    return grafted


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
