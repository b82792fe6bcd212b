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
Values are compared as float32, and path scores are float32 sums: 16-bit log-probs
upcast exactly (same order, same ties), float64 ones round to the nearest float32,
so two that round alike tie and the lower id wins.

Log-probs may have any strides (a slice, a transposed or an expanded view): the
builders ``view`` only tensors they made or made contiguous.

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

    ``topk`` picks among values tied at the ``k``-th place arbitrarily, and the lowest ids must win, so the
    selection runs on keys that order by value and then by id (:func:`top_stable`), in fixed shapes: no host
    branch decides whether a tie straddles the ``k``-th place. Few tokens are ranked: the vocabulary is cut
    into blocks of ``_BLOCKS[0]`` tokens, and each of the top ``k`` tokens lies in one of the ``k`` blocks
    whose best token ranks highest (a block outside them has ``k`` better tokens before its best). So one max
    per block and a ranking of ``k`` blocks' tokens replace a top-k over the vocabulary; where those are many,
    the same step narrows them again in finer blocks. ``logprobs`` may have any strides.
    """
    vocab = logprobs.shape[-1]
    if not 0 <= k <= vocab:
        raise ValueError(f"ranked_topk needs 0 <= k <= vocabulary size {vocab}, got k={k}")
    if k == 0 or logprobs.dtype not in _KEYED:  # float64 has no room beside the id in a 64-bit key
        toks = logprobs.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        return logprobs.gather(-1, toks), toks
    lead = logprobs.shape[:-1]
    rows = logprobs.reshape(-1, vocab).float()  # exact for 16-bit floats: same order, same ties
    size = _BLOCKS[0]
    if k * size >= vocab:
        toks = top_stable(rows, k)[1]
    else:
        if vocab % size:  # whole blocks: the pads (-inf, ids past the vocabulary) lose every tie to a token
            rows = torch.nn.functional.pad(rows, (0, size - vocab % size), value=float("-inf"))
        # The rows may be a slice of a wider tensor (one depth of [B, D, V], a transposed or stepped view),
        # which _best_blocks cannot flatten: copied once here, a no-op for the usual contiguous rows.
        blocks = rows.contiguous().view(rows.shape[0], -1, size)
        start = shape_constant(_block_starts, blocks.shape[1], size, rows.device).expand(rows.shape[0], -1)
        blocks, start = _best_blocks(blocks, start, k)
        for finer in _BLOCKS[1:]:
            if k * size <= _FEW:
                break
            start = (start[..., None] + shape_constant(_block_starts, size // finer, finer, rows.device)).flatten(1)
            blocks, start = _best_blocks(blocks.view(rows.shape[0], -1, finer), start, k)
            size = finer
        place = top_stable(blocks.flatten(1), k)[1]
        toks = start.gather(1, place // size) + place % size
    toks = toks.reshape(*lead, k)
    return logprobs.gather(-1, toks), toks


_KEYED = (torch.float32, torch.float16, torch.bfloat16)
_BLOCKS = (128, 16)  # block sizes of ranked_topk, coarse to fine
_FEW = 512  # tokens per row that ranked_topk ranks without narrowing further


def _best_blocks(blocks: torch.Tensor, start: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` blocks of ``blocks`` ``[R, n, S]`` (contiguous, ascending ids) whose best token ranks highest,
    kept in id order so their tokens still ascend by id, as a new contiguous ``[R, k, S]``, and their first ids
    (``start`` ``[R, n]``). Whole blocks are copied as rows of the flat view, which only contiguous blocks have."""
    rows, n, size = blocks.shape
    best = top_stable(blocks.amax(dim=-1), k)[1].sort(dim=1).values
    flat = best + shape_constant(_block_starts, rows, n, blocks.device)[:, None]
    return blocks.view(rows * n, size).index_select(0, flat.flatten()).view(rows, k, size), start.gather(1, best)


@lru_cache(maxsize=256)
def _block_starts(n: int, size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, n * size, size, device=device)


def _check_inputs(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> None:
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"tree budget must be an int >= 0 (the number of draft nodes), got {budget!r}")
    if logprobs.dim() != 3:
        raise ValueError(f"draft log-probs must be [batch, depth, vocab], got shape {tuple(logprobs.shape)}")
    if root_tokens.numel() != logprobs.shape[0]:
        raise ValueError(f"{root_tokens.numel()} root tokens for a batch of {logprobs.shape[0]} distributions")


_SORT_MAX = 2048


def top_stable(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first ``m`` values and indices of a stable descending sort of ``x`` ``[B, n]`` (ties:
    lower index). Small inputs take that sort (one call). Above ``_SORT_MAX`` entries, where a CPU's stable
    sort is slow, floats of up to 32 bits take one ``topk`` over distinct integer keys whose order is the
    sort's (:func:`_rank_keys`), or for ``m == 1`` an ``argmax``, which returns the first maximum."""
    m = min(m, x.shape[1])
    if x.numel() <= _SORT_MAX or x.dtype not in _KEYED or m == 0:
        values, indices = x.sort(dim=1, descending=True, stable=True)
        return values[:, :m], indices[:, :m]
    indices = x.argmax(dim=1, keepdim=True) if m == 1 else _rank_keys(x).topk(m, dim=1).indices
    return x.gather(1, indices), indices


def _rank_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys of ``x`` ``[B, n]`` (floats of up to 32 bits), distinct within a row, larger for a larger
    value and, between equal values, for a lower index: the float's sign and magnitude as one signed
    integer (-0.0 ties 0.0) times ``2**31``, plus the index's key. The low part stays below ``2**31`` so that
    inductor's Triton code, which indexes in int32, can hold it (a ``2**32`` offset fails to compile there)."""
    bits = x.float().view(torch.int32)
    sign = bits >> 31  # 0 or -1
    ordered = ((bits & 0x7FFFFFFF) ^ sign) - sign  # the magnitude, negated for negative floats
    return torch.add(shape_constant(_index_keys, x.shape[1], x.device), ordered.long(), alpha=2**31)


@lru_cache(maxsize=256)
def _index_keys(n: int, device: torch.device) -> torch.Tensor:
    """The low part of :func:`_rank_keys`: larger for a lower index, in ``[0, 2**31)``."""
    if n > 2**31:
        raise ValueError(f"rank keys cover rows of up to 2**31 entries, got {n}")
    return 2**31 - 1 - torch.arange(n, device=device)


def shape_constant(table: _lru_cache_wrapper[T], *key: Hashable) -> T:
    """A per-shape index table: cached in eager mode; built inline while ``torch.compile`` traces, where it
    becomes a constant of the graph (dynamo does not keep ``lru_cache``'s cache)."""
    return table.__wrapped__(*key) if torch.compiler.is_compiling() else table(*key)


def candidate_code(parent: int, place: int) -> int:
    """A candidate's code for :func:`assemble`: its parent's place in the depth-major concatenation of levels
    (the root: the concatenation's size) in the high bits, its token's place in the token table in the low
    32. The codes of one level's candidates are a per-shape table that the level's selection indexes."""
    return parent << 32 | place


@lru_cache(maxsize=256)
def _growth_plan(
    k: int, keep: int, max_depth: int, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[torch.Tensor, int, torch.Tensor]]]:
    """The index tables of :func:`grow_levels`: level 0's codes, the distinct rank tables, and per level
    ``d >= 1`` its parent table, which rank table it uses and its codes.

    A level's candidates are (parent ``i``, rank ``j``) pairs in row-major key order. Both lists are in key
    order, so the ``(i+1)(j+1) - 1`` pairs ``(i', j') <= (i, j)`` all come before ``(i, j)``: a pair with
    ``(i+1)(j+1) > keep`` cannot make the top ``keep``, and about ``keep * ln(keep)`` pairs remain instead of
    ``keep * k``. Levels with as many parents share their tables.
    """
    sizes = [k]
    pairs: list[tuple[int, list[int], list[int]]] = []  # per level: (rank table, parents, ranks)
    by_parents: dict[int, tuple[int, list[int], list[int]]] = {}
    for _ in range(1, max_depth):
        if sizes[-1] not in by_parents:
            ii = [i for i in range(sizes[-1]) for _ in range(min(keep // (i + 1), k))]
            jj = [j for i in range(sizes[-1]) for j in range(min(keep // (i + 1), k))]
            by_parents[sizes[-1]] = (len(by_parents), ii, jj)
        pairs.append(by_parents[sizes[-1]])
        sizes.append(min(keep, len(pairs[-1][1])))
    total, offset, levels = sum(sizes), 0, []
    for d, (group, ii, jj) in enumerate(pairs, start=1):
        codes = [candidate_code(offset + i, d * k + j) for i, j in zip(ii, jj)]
        levels.append((torch.tensor(ii, device=device), group, torch.tensor(codes, device=device)))
        offset += sizes[d - 1]
    ranks = [torch.tensor(jj, device=device) for _, _, jj in sorted(by_parents.values())]
    return torch.tensor([candidate_code(total, j) for j in range(k)], device=device), ranks, levels


def grow_levels(
    vals: torch.Tensor, keep: int, max_depth: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per depth, keep the ``keep`` best paths (by the tie rule) among extensions of the last level.

    ``vals`` are the ranked top-k log-probs ``[B, D, k]`` from :func:`ranked_topk`. Returns per level
    (depth 1 first), each level in key order, the path scores and the candidates' codes
    (:func:`candidate_code`), whose token places index the ``[B, D * k]`` flattened top-k tokens.
    """
    bsz, _, k = vals.shape
    first, ranks, levels = shape_constant(_growth_plan, k, keep, max_depth, vals.device)
    ranked = [vals.index_select(2, jj).unbind(1) for jj in ranks]  # [B, P] per depth, for each rank table
    scores, codes = [vals[:, 0]], [first.expand(bsz, k)]
    for d, (ii, group, level_codes) in enumerate(levels, start=1):
        # Row-major (parent, rank) order, so the stable selection breaks score ties by the key.
        best, pick = top_stable(scores[-1].index_select(1, ii) + ranked[group][d], keep)
        scores.append(best)
        codes.append(level_codes.take(pick))
    return scores, codes


def assemble(
    root_tokens: torch.Tensor,
    level_scores: list[torch.Tensor],
    level_codes: list[torch.Tensor],
    token_table: torch.Tensor,
    budget: int,
) -> DraftTree:
    """The ``budget`` best candidates over all levels, indexed in pop order, as a :class:`DraftTree`.

    Levels are concatenated depth-major, each already in key order, so a stable descending selection on
    score realises the tie rule. ``level_codes`` give each candidate's parent and its token's place in
    ``token_table`` ``[B, X]`` (:func:`candidate_code`). Depths are the level numbers; visibility comes from
    walking all nodes up to the root together.
    """
    bsz = root_tokens.shape[0]
    device = level_scores[0].device
    sizes = tuple(s.shape[1] for s in level_scores)
    scores, order = top_stable(torch.cat(level_scores, dim=1), budget)
    total, n = sum(sizes), order.shape[1] + 1
    codes = torch.cat(level_codes, dim=1).gather(1, order)
    node = shape_constant(_arange, n, device)
    # The pop index of every candidate, and of the root at place `total`.
    pop_index = torch.zeros(bsz, total + 1, dtype=torch.long, device=device)
    pop_index.scatter_(1, order, node[1:].expand(bsz, n - 1))
    parents = torch.cat([node.new_full((bsz, 1), -1), pop_index.gather(1, codes >> 32)], dim=1)
    depths = torch.cat([node.new_zeros(bsz, 1), shape_constant(_level_depths, sizes, device).take(order)], dim=1)
    out = root_tokens.device
    tokens = torch.cat([root_tokens.reshape(bsz, 1).long(), token_table.gather(1, codes & (2**32 - 1)).to(out)], 1)
    return DraftTree(
        tokens,
        parents.to(out),
        depths.to(out),
        torch.cat([scores.new_zeros(bsz, 1), scores], dim=1).float().to(out),
        _ancestors(parents, len(sizes)).to(out),
    )


def _ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Visibility ``[B, N, N]`` of a tree at most ``max_depth`` deep: each node's ancestors, gathered for all
    nodes at once, doubling the hops covered per step (the root is its own parent here)."""
    bsz, n = parents.shape
    up = parents.clamp(min=0)
    seen = shape_constant(_arange, n, parents.device).expand(bsz, n)[..., None]  # [B, N, hops covered]
    reach = 1
    while reach <= max_depth:
        seen = torch.cat([seen, up.gather(1, seen.flatten(1)).view(bsz, n, reach)], dim=2)
        reach *= 2
        if reach <= max_depth:
            up = up.gather(1, up)
    return torch.zeros(bsz, n, n, dtype=torch.bool, device=parents.device).scatter_(2, seen, True)


@lru_cache(maxsize=256)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


@lru_cache(maxsize=256)
def _level_depths(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The depth of each candidate in the depth-major concatenation of levels of these sizes."""
    return torch.tensor([d for d, size in enumerate(sizes, start=1) for _ in range(size)], device=device)


def as_logprobs(scores: torch.Tensor) -> torch.Tensor:
    """Scores as the builders need them: at most 0 (a NaN as ``-inf``), so a path's score never rises from
    parent to child. A drafter's scores need not be normalised; if one rose, a child could outrank its parent,
    be placed before it, or be kept without it, and the tree would not be one."""
    return scores.nan_to_num(nan=float("-inf"), posinf=0.0, neginf=float("-inf")).clamp(max=0.0)


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
    return assemble(root_tokens, *grow_levels(as_logprobs(vals), budget, vals.shape[1]), toks.flatten(1), budget)


def chain(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DFlash: the drafter's top token at each depth, ``min(budget, D)`` nodes deep."""
    _check_inputs(root_tokens, logprobs, budget)
    depth = min(budget, logprobs.shape[1])
    if depth == 0:
        return root_only(root_tokens, torch.float32)
    bsz = logprobs.shape[0]
    vals, toks = ranked_topk(logprobs[:, :depth].float(), 1)
    scores = vals[..., 0].cumsum(dim=1)
    tokens = torch.cat([root_tokens.reshape(bsz, 1).long().to(toks.device), toks[..., 0]], dim=1)
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
        return assemble(root_tokens, *grow_levels(as_logprobs(vals), width, max_depth), toks.flatten(1), budget)

    build.__name__ = f"beam_{width}x{depth if depth is not None else 'D'}"
    build.__qualname__ = build.__name__
    build.max_nodes = lambda drafted: width * min(drafted, depth or drafted)  # type: ignore[attr-defined]
    return build


BUILDERS: dict[str, TreeBuilder] = {"best_first": best_first, "chain": chain}


def builder_capacity(builder: TreeBuilder, depth: int) -> int | None:
    """The most draft nodes ``builder`` builds from ``depth`` drafted depths, whatever the budget: ``depth`` for
    the chain, ``W * min(D, depth)`` for ``beam@WxD``, a builder's own ``max_nodes(depth)`` where it has one;
    ``None`` where no bound is known (best-first fills any budget up to ``depth`` times the vocabulary)."""
    if builder is chain:
        return depth
    own = getattr(builder, "max_nodes", None)
    return int(own(depth)) if callable(own) else None


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
            w, d = (int(n) for n in builder[5:].lower().split("x"))
        except ValueError as exc:
            raise ValueError(f"beam builder must look like 'beam@4x8' (width x depth, each at least 1), "
                             f"got {builder!r}") from exc
        if w < 1 or d < 1:
            raise ValueError(f"beam builder {builder!r}: width and depth must each be at least 1 "
                             f"(e.g. 'beam@4x8'), got width {w} and depth {d}")
        return beam(w, d)
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
