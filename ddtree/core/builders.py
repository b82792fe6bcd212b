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

The builders run on the tensors' device as fixed-shape tensor operations: no
host reads and no loop over nodes (only over depths), so a round that builds a
tree never waits for the device. Every shape follows from ``budget``, ``D``,
``V`` and the batch size alone. :mod:`ddtree.core.reference_builders` holds
the numpy builders they must match node for node.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from ddtree.core.tree import DraftTree, path_tree, root_only

if TYPE_CHECKING:
    from functools import _lru_cache_wrapper

T = TypeVar("T")


class TreeBuilder(Protocol):
    def __call__(self, root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree: ...


def ranked_topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per depth, ordered by log-prob descending then token id ascending.

    ``topk`` picks among values tied at the ``k``-th place arbitrarily, and the lowest ids must win. Every
    value above the ``k``-th is in ``topk``'s answer (fewer than ``k`` of them); the places left go to the
    lowest ids equal to the ``k``-th value, found by :func:`_first_equal` in fixed shapes, so no host branch
    decides whether a tie straddles the ``k``-th place.
    """
    vocab = logprobs.shape[-1]
    vals, toks = logprobs.topk(k, dim=-1)
    by_tok = toks.argsort(dim=-1, stable=True)
    vals, toks = vals.gather(-1, by_tok), toks.gather(-1, by_tok)
    by_val = vals.argsort(dim=-1, descending=True, stable=True)
    vals, toks = vals.gather(-1, by_val), toks.gather(-1, by_val)
    if not 0 < k < vocab:
        return vals, toks
    kth = vals[..., k - 1:k]
    place = torch.arange(k, device=logprobs.device)
    above = (vals > kth).sum(dim=-1, keepdim=True)  # these lead the ranked list already
    tied = _first_equal(logprobs, kth, k).gather(-1, (place - above).clamp(min=0))
    toks = torch.where(place < above, toks, tied)
    return logprobs.gather(-1, toks), toks


_CHUNK = 128


def _first_equal(logprobs: torch.Tensor, value: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` lowest token ids whose log-prob equals ``value`` ``[..., 1]``, the ``k``-th largest (fewer than
    ``k`` values lie above it), ascending; where fewer match, the rest are clamped ids never used.

    Fixed shapes and one pass over the vocabulary (a max per chunk): a chunk holding a value ``>= value``
    holds a match or one of the fewer than ``k`` values above it, so the first ``2k - 1`` such chunks hold
    the first ``k`` matches. Those chunks alone are searched, by running counts and ``searchsorted``.
    """
    lead, vocab = logprobs.shape[:-1], logprobs.shape[-1]
    rows = logprobs.reshape(-1, vocab)
    if vocab % _CHUNK:  # pad with -inf: a pad entry may match only after every real match, and is never used
        rows = torch.cat([rows, rows.new_full((rows.shape[0], _CHUNK - vocab % _CHUNK), float("-inf"))], dim=1)
    value = value.reshape(-1, 1)
    chunks = rows.unflatten(-1, (-1, _CHUNK))  # [R, n, C]
    hit = (chunks.amax(dim=-1) >= value).cumsum(dim=-1, dtype=torch.int32)  # [R, n] chunks so far with a hit
    wanted = min(2 * k - 1, chunks.shape[1])
    nth = torch.arange(1, wanted + 1, dtype=torch.int32, device=rows.device).expand(rows.shape[0], wanted)
    chunk = torch.searchsorted(hit, nth.contiguous())  # [R, wanted] the nth chunk with a hit, ascending
    real = chunk < hit.shape[1]
    chunk = chunk.clamp(max=hit.shape[1] - 1)
    picked = chunks[torch.arange(rows.shape[0], device=rows.device)[:, None], chunk]  # [R, wanted, C]
    matches = ((picked == value[..., None]) & real[..., None]).flatten(1).cumsum(dim=-1, dtype=torch.int32)
    first = torch.arange(1, k + 1, dtype=torch.int32, device=rows.device).expand(rows.shape[0], k)
    where = torch.searchsorted(matches, first.contiguous()).clamp(max=matches.shape[1] - 1)  # [R, k]
    ids = (chunk.gather(1, where // _CHUNK) * _CHUNK + where % _CHUNK).view(*lead, k)
    return ids.clamp(max=vocab - 1)


def _check_inputs(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> None:
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"tree budget must be an int >= 0 (the number of draft nodes), got {budget!r}")
    if logprobs.dim() != 3:
        raise ValueError(f"draft log-probs must be [batch, depth, vocab], got shape {tuple(logprobs.shape)}")
    if root_tokens.numel() != logprobs.shape[0]:
        raise ValueError(f"{root_tokens.numel()} root tokens for a batch of {logprobs.shape[0]} distributions")


def top_stable(x: torch.Tensor, m: int) -> torch.Tensor:
    """Per row, the first ``m`` indices of a stable descending sort of ``x`` ``[B, n]`` (ties: lower index)."""
    return x.sort(dim=1, descending=True, stable=True).indices[:, :m]


def _constant(table: _lru_cache_wrapper[T], *key: Hashable) -> T:
    """A per-shape index table: cached in eager mode; built inline while ``torch.compile`` traces, where it
    becomes a constant of the graph (dynamo does not keep ``lru_cache``'s cache)."""
    return table.__wrapped__(*key) if torch.compiler.is_compiling() else table(*key)


@lru_cache(maxsize=256)
def _pair_table(parents: int, k: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (parent, rank) candidates that can make a level's top ``m``, in row-major key order.

    Both lists are in key order, so the ``(i+1)(j+1) - 1`` pairs ``(i', j') <= (i, j)`` all come before
    ``(parent i, rank j)``: a pair with ``(i+1)(j+1) > m`` cannot make the top ``m``, and about
    ``m * ln(m)`` pairs remain instead of ``m * k``. Built once per shape and kept on the device.
    """
    ii: list[int] = []
    jj: list[int] = []
    for i in range(parents):
        width = min(m // (i + 1), k)
        ii += [i] * width
        jj += range(width)
    return torch.tensor(ii, device=device), torch.tensor(jj, device=device)


def grow_levels(
    vals: torch.Tensor, toks: torch.Tensor, keep: int, max_depth: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per depth, keep the ``keep`` best paths (by the tie rule) among extensions of the last level.

    ``vals``/``toks`` are the ranked top-k lists ``[B, D, k]`` from :func:`ranked_topk`. Returns per level
    (depth 1 first) the scores, tokens and parent index in the level before, each level in key order.
    """
    bsz, _, k = vals.shape
    scores, tokens, parents = [vals[:, 0]], [toks[:, 0]], [toks.new_zeros(bsz, k)]
    for d in range(1, max_depth):
        ii, jj = _constant(_pair_table, scores[-1].shape[1], k, keep, vals.device)
        # Row-major (parent, rank) order, so the stable selection breaks score ties by the key.
        cand = scores[-1][:, ii] + vals[:, d, jj]
        pick = top_stable(cand, keep)
        scores.append(cand.gather(1, pick))
        parents.append(ii[pick])
        tokens.append(toks[:, d].gather(1, jj[pick]))
    return scores, tokens, parents


def assemble(
    root_tokens: torch.Tensor,
    level_scores: list[torch.Tensor],
    level_tokens: list[torch.Tensor],
    level_parents: list[torch.Tensor],
    budget: int,
) -> DraftTree:
    """The ``budget`` best candidates over all levels, indexed in pop order, as a :class:`DraftTree`.

    Levels are concatenated depth-major, each already in key order, so a stable descending sort on
    score realises the tie rule. Depths are the level numbers; visibility comes from walking all nodes
    up to the root together, one level per step.
    """
    bsz = root_tokens.shape[0]
    device = level_scores[0].device
    sizes = [s.shape[1] for s in level_scores]
    scores = torch.cat(level_scores, dim=1)
    total = scores.shape[1]
    # Parent ids in the concatenated numbering; `total` stands for the root.
    offset, parent_ids = 0, [torch.full_like(level_parents[0], total)]
    for size, p in zip(sizes[:-1], level_parents[1:]):
        parent_ids.append(p + offset)
        offset += size
    order = top_stable(scores, min(budget, total))
    n = order.shape[1] + 1
    node = torch.arange(n, device=device)
    final_index = torch.zeros(bsz, total + 1, dtype=torch.long, device=device)
    final_index.scatter_(1, order, node[1:].expand(bsz, n - 1))
    parents = torch.cat([node.new_full((bsz, 1), -1), final_index.gather(1, torch.cat(parent_ids, 1).gather(1, order))],
                        dim=1)
    depths = torch.cat([node.new_zeros(bsz, 1), _constant(_level_depths, tuple(sizes), device)[order]], dim=1)
    up = parents.clamp(min=0)  # the root is its own parent here
    steps = [node.expand(bsz, n)]
    for _ in range(len(sizes)):
        steps.append(up.gather(1, steps[-1]))
    visibility = torch.zeros(bsz, n, n, dtype=torch.bool, device=device)
    visibility.scatter_(2, torch.stack(steps, dim=2), True)
    out = root_tokens.device
    return DraftTree(
        torch.cat([root_tokens.view(bsz, 1).long(), torch.cat(level_tokens, 1).gather(1, order).to(out)], dim=1),
        parents.to(out),
        depths.to(out),
        torch.cat([scores.new_zeros(bsz, 1), scores.gather(1, order)], dim=1).float().to(out),
        visibility.to(out),
    )


@lru_cache(maxsize=256)
def _level_depths(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The depth of each candidate in the depth-major concatenation of levels of these sizes."""
    return torch.tensor([d for d, size in enumerate(sizes, start=1) for _ in range(size)], device=device)


def best_first(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the ``budget`` nodes of highest path log-prob, depth capped at ``D``.

    Equivalent to the published heap loop (pop best, push next sibling and first
    child) but vectorised per depth: a node in the global top-``budget`` is in
    the top-``budget`` of its own depth, and its parent is too.
    """
    _check_inputs(root_tokens, logprobs, budget)
    if budget == 0 or logprobs.shape[1] == 0:
        return root_only(root_tokens, torch.float32)
    vals, toks = ranked_topk(logprobs.detach().float(), min(budget, logprobs.shape[-1]))
    return best_first_from_topk(root_tokens, vals, toks, budget)


def best_first_from_topk(root_tokens: torch.Tensor, vals: torch.Tensor, toks: torch.Tensor, budget: int) -> DraftTree:
    """:func:`best_first` after its top-k step (``vals``/``toks`` ``[B, D, min(budget, V)]`` from
    :func:`ranked_topk`), split out so benchmarks can time the tree growth alone."""
    return assemble(root_tokens, *grow_levels(vals, toks, budget, vals.shape[1]), budget)


def chain(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DFlash: the drafter's top token at each depth, ``min(budget, D)`` nodes deep."""
    _check_inputs(root_tokens, logprobs, budget)
    depth = min(budget, logprobs.shape[1])
    if depth == 0:
        return root_only(root_tokens, torch.float32)
    bsz = logprobs.shape[0]
    vals, toks = ranked_topk(logprobs[:, :depth].float(), 1)
    scores = vals[..., 0].cumsum(dim=1)
    tokens = torch.cat([root_tokens.view(bsz, 1).long().to(toks.device), toks[..., 0]], dim=1)
    return path_tree(tokens, torch.cat([scores.new_zeros(bsz, 1), scores], dim=1))


def beam(width: int, depth: int | None = None) -> TreeBuilder:
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
        vals, toks = ranked_topk(logprobs[:, :max_depth].detach().float(), min(width, logprobs.shape[-1]))
        return assemble(root_tokens, *grow_levels(vals, toks, width, max_depth), budget)

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
