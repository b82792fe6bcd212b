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

import torch


@dataclass
class DraftTree:
    """A batch of token trees, all tensors ``[B, N]`` (``visibility`` is ``[B, N, N]``).

    ``scores`` is the path log-probability under the drafter (0 for the root).
    ``visibility[b, i, j]`` is True when ``j`` is ``i`` or one of its ancestors.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    visibility: torch.Tensor = field(repr=False)

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


def _root_only(root_tokens: torch.Tensor, dtype: torch.dtype) -> DraftTree:
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
    level_scores: list[torch.Tensor],
    level_tokens: list[torch.Tensor],
    level_parents: list[torch.Tensor],
    budget: int,
) -> DraftTree:
    """Select the ``budget`` best candidates over all levels and index them in pop order.

    Levels are concatenated depth-major with each level already in key order, so a
    stable descending sort on score realises the documented tie rule.
    """
    bsz = root_tokens.shape[0]
    device = root_tokens.device
    sizes = [s.shape[1] for s in level_scores]
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    scores = torch.cat(level_scores, dim=1)
    tokens = torch.cat(level_tokens, dim=1)
    # Parent ids in the concatenated numbering; -1 means the root.
    parent_ids = torch.cat(
        [level_parents[0].new_full(level_parents[0].shape, -1)]
        + [p + offsets[d - 1] for d, p in enumerate(level_parents) if d > 0],
        dim=1,
    )
    total = scores.shape[1]
    budget = min(budget, total)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :budget]
    final_index = torch.zeros(bsz, total + 1, dtype=torch.long, device=device)  # slot `total` is the root
    final_index.scatter_(1, order, torch.arange(1, budget + 1, device=device).expand(bsz, budget))
    sel_parent = parent_ids.gather(1, order)
    sel_parent = torch.where(sel_parent < 0, torch.full_like(sel_parent, total), sel_parent)
    parents = torch.cat(
        [torch.full((bsz, 1), -1, dtype=torch.long, device=device), final_index.gather(1, sel_parent)], dim=1
    )
    node_tokens = torch.cat([root_tokens.view(bsz, 1).long(), tokens.gather(1, order)], dim=1)
    node_scores = torch.cat([scores.new_zeros(bsz, 1), scores.gather(1, order)], dim=1)
    return DraftTree.from_parents(node_tokens, parents, node_scores)


def _expand_levels(
    logprobs: torch.Tensor, keep: int, max_depth: int, stop_below: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per depth, keep the ``keep`` best paths (by the tie rule) among extensions of the last level."""
    bsz, _, vocab = logprobs.shape
    k = min(keep, vocab)
    vals, toks = ranked_topk(logprobs.float(), k)
    level_scores, level_tokens, level_parents = [vals[:, 0]], [toks[:, 0]], [
        torch.zeros(bsz, k, dtype=torch.long, device=logprobs.device)
    ]
    for d in range(1, max_depth):
        prev = level_scores[-1]
        cand = (prev[:, :, None] + vals[:, d, None, :]).reshape(bsz, -1)
        if stop_below is not None and bool((cand.max(dim=1).values < stop_below).all()):
            break
        m = min(keep, cand.shape[1])
        pick = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :m]
        level_scores.append(cand.gather(1, pick))
        level_parents.append(torch.div(pick, k, rounding_mode="floor"))
        level_tokens.append(toks[:, d].gather(1, pick % k))
    return level_scores, level_tokens, level_parents


def best_first(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the ``budget`` nodes of highest path log-prob, depth capped at ``D``.

    Equivalent to the published heap loop (pop best, push next sibling and first
    child) but vectorised per depth: a node in the global top-``budget`` is in
    the top-``budget`` of its own depth, and its parent is too.
    """
    _check_inputs(root_tokens, logprobs, budget)
    if budget == 0 or logprobs.shape[1] == 0:
        return _root_only(root_tokens, torch.float32)
    bsz, depth, vocab = logprobs.shape
    k = min(budget, vocab)
    vals, _ = ranked_topk(logprobs[:, :1].float(), k)
    # The budget-th best score among depth-1 nodes bounds every deeper useful node from below.
    floor = vals[:, 0, k - 1] if k == budget else None
    levels = _expand_levels(logprobs, budget, depth, stop_below=floor)
    return _assemble(root_tokens, *levels, budget)


def chain(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DFlash: the drafter's top token at each depth, ``min(budget, D)`` nodes deep."""
    _check_inputs(root_tokens, logprobs, budget)
    depth = min(budget, logprobs.shape[1])
    if depth == 0:
        return _root_only(root_tokens, torch.float32)
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
            return _root_only(root_tokens, torch.float32)
        levels = _expand_levels(logprobs, width, max_depth)
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
