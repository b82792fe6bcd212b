"""KV-cache compaction after a verify round.

After the tree forward the target cache holds ``[prefix | all tree nodes]``.
:func:`commit_accepted` keeps the prefix and exactly the accepted nodes, in path
order. It is the one place every cache kind goes through, so version quirks of
transformers' cache classes stay here. Layers with per-row state (linear attention)
are handled by their kind (:mod:`ddtree.targets.layer_kinds`), found from the cache.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ddtree.targets.description import describe
from ddtree.targets.kv_room import append_in_place, compact_in_room, compaction_plan, held_in_room
from ddtree.targets.layer_kinds import kinds_in_cache

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
"""The transformers versions ddtree is exact on (kept equal to pyproject.toml's range by a test)."""


class CacheNotUpdatedError(RuntimeError):
    """The target forward did not fill the cache it was given: continuing would decode without the prefix."""


@functools.cache
def _cache_keyword(forward_owner: type[torch.nn.Module]) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that passes ``cache`` to ``model``'s forward: ``cache=`` on transformers that renamed it,
    ``past_key_values=`` before (5.0 to 5.17 at least). An unknown keyword is swallowed by ``**kwargs``, so
    guessing wrong would silently drop the cache; :func:`check_cache_length` catches what this misses."""
    return {_cache_keyword(type(model)): cache}  # type: ignore[arg-type]  # mypy: a class object is hashable


def check_cache_length(cache: Any, expected: int, step: str) -> None:
    """Raise :class:`CacheNotUpdatedError` unless ``cache`` holds ``expected`` positions after ``step``."""
    got = cache_length(cache)
    if got != expected:
        import transformers

        raise CacheNotUpdatedError(
            f"after the {step} the target cache holds {got} positions, expected {expected}: the target's forward "
            f"did not use the cache ddtree passed. Installed transformers {transformers.__version__}; ddtree "
            f"supports transformers{SUPPORTED_TRANSFORMERS} with models whose forward takes `cache=` or "
            "`past_key_values=`. Install a supported version, or pass the cache keyword your model expects."
        )


def new_target_cache(model: Any = None) -> Any:
    """A cache whose attention layers keep every position (and, for a target with stateful layers, their slots).

    Attention layers are built without sliding-window caches on purpose: those discard
    old states and refuse arbitrary compaction, while ddtree applies windows through its
    masks instead. Pass ``model`` for targets with stateful layers (linear attention), whose
    kind builds the cache with their slots (see :mod:`ddtree.targets.layer_kinds`). Attention layers append
    in place (:mod:`ddtree.targets.kv_room`) rather than copying the whole cache at every step.
    """
    from transformers import DynamicCache

    if model is not None:
        for kind in describe(model).stateful:
            return kind.new_cache(model)
    return append_in_place(DynamicCache())


def cache_length(cache: Any) -> int:
    """Positions held by ``cache``'s first attention layer (one with keys). A linear-attention layer has no
    positions: transformers 5.25 reports the tokens its own updates counted, which ddtree's tree forwards and
    commits of its states do not go through."""
    if cache is None:
        return 0
    layers = getattr(cache, "layers", None) or []
    first = next((i for i, layer in enumerate(layers) if hasattr(layer, "keys")), 0)
    return int(cache.get_seq_length(first)) if first else int(cache.get_seq_length())


def keep_positions(
    tensor: torch.Tensor, prefix_len: int, accepted: torch.Tensor, contiguous: bool | None = None
) -> torch.Tensor:
    """``tensor[..., :prefix_len, :]`` followed by the tree rows ``accepted`` (``[B, L]`` node indices).

    Works on ``[B, heads, T, d]`` states. When the accepted nodes are the first
    ``L`` tree rows in order (always true for a chain) this is a slice, not a copy.
    """
    bsz, length = accepted.shape
    if bsz != tensor.shape[0]:
        raise ValueError(f"accepted indices are for {bsz} rows, the cache has {tensor.shape[0]}")
    if contiguous is None:
        contiguous = _is_leading_run(accepted)
    if contiguous:
        return tensor[..., : prefix_len + length, :]
    index = (prefix_len + accepted).to(tensor.device)  # [B, L]
    index = index[:, None, :, None].expand(bsz, tensor.shape[1], length, tensor.shape[-1])
    return torch.cat([tensor[..., :prefix_len, :], tensor.gather(2, index)], dim=2)


def _is_leading_run(accepted: torch.Tensor) -> bool:
    return bool((accepted == torch.arange(accepted.shape[1], device=accepted.device)).all())


def compaction_index(prefix_len: int, accepted: torch.Tensor, lengths: torch.Tensor, width: int | None = None
                     ) -> torch.Tensor:
    """Source columns ``[B, W]`` of the compacted cache, rows right-aligned (left padding, as HF pads).

    Row ``b`` keeps its ``lengths[b]`` committed columns (the last ones of the
    prefix) and its accepted tree nodes (``accepted[b]``, ``-1`` padded), in
    that order, at the right end; ``W`` is the longest row (``width`` when the
    caller knows it, else read from the device). Pad columns point at
    column 0 and are masked by :func:`padding_mask`.
    """
    bsz, length = accepted.shape
    device = accepted.device
    counts = (accepted >= 0).sum(dim=1)  # [B]
    kept = lengths.to(device) + counts
    if width is None:
        width = int(kept.max())
    col = torch.arange(width, device=device)[None]  # [1, W]
    offset = (width - kept)[:, None]  # pads in front of each row
    rel = col - offset  # index into [committed ; accepted] per row, < 0 for pads
    n = lengths.to(device)[:, None]
    from_prefix = prefix_len - n + rel
    from_tree = prefix_len + accepted.gather(1, (rel - n).clamp(0, length - 1))
    index = torch.where(rel < n, from_prefix, from_tree)
    return torch.where(rel < 0, torch.zeros_like(index), index)


def padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Bool ``[B, width]``: True on each row's committed columns (the last ``lengths[b]``)."""
    col = torch.arange(width, device=lengths.device)[None]
    return col >= (width - lengths)[:, None]


def commit_accepted(cache: Any, prefix_len: int, accepted: torch.Tensor, lengths: torch.Tensor | None = None, *,
                    paths: Sequence[Sequence[int]] | None = None, host_lengths: Sequence[int] | None = None) -> None:
    """Keep each row's committed columns plus its accepted tree nodes in every layer of ``cache``, in place.

    ``accepted`` is ``[B, L]``: node indices along each row's accepted path,
    root first, ``-1`` after a row's last node. ``lengths`` ``[B]`` counts each
    row's committed columns before the tree (the last ``lengths[b]`` of the
    ``prefix_len``); omitted, every row has all ``prefix_len``. Rows end
    right-aligned (see :func:`compaction_index`). Rows that accept equally many
    nodes keep the cheap path: a slice for a chain, one gather of the tree block
    otherwise; only ragged acceptance re-packs the whole cache.

    A caller that already holds the paths on the host (a round reads them once to emit) passes them as
    ``paths`` (each row's node indices, no ``-1``) and ``lengths`` as ``host_lengths`` too: the commit then
    decides everything from them and reads nothing back from the device.
    """
    if accepted.dim() != 2:
        raise ValueError(f"accepted must be [batch, length], got shape {tuple(accepted.shape)}")
    if paths is not None:
        _check_paths(paths, accepted)
        uniform = all(len(p) == accepted.shape[1] for p in paths)
        contiguous = all(list(p) == list(range(len(p))) for p in paths)
        width = None
        if lengths is not None and host_lengths is not None:
            width = max(n + len(p) for n, p in zip(host_lengths, paths))
        elif lengths is None:
            width = prefix_len + max(len(p) for p in paths)
    else:
        if accepted.shape[1] == 0 or bool((accepted[:, 0] != 0).any()):
            raise ValueError("every row's accepted path starts at the root (node 0)")
        counts = (accepted >= 0).sum(dim=1)
        if bool(((accepted >= 0) != (torch.arange(accepted.shape[1], device=accepted.device) < counts[:, None])).any()):
            raise ValueError("accepted paths must be -1 padded at the end only")
        uniform = bool((counts == accepted.shape[1]).all())
        contiguous = _is_leading_run(accepted) if uniform else False
        width = None
    kv_layers = _kv_layers(cache)
    for kind in kinds_in_cache(cache):
        kind.commit(cache, accepted)  # stateful layers: per row, from each row's own last accepted node
    # Rows that accept equally many nodes stay right-aligned when the nodes are appended after the whole
    # prefix (padding included): the cheap path, whatever each row's own length.
    # Columns moved within each layer's in-place room where the paths are on the host (a gathered or
    # concatenated cache, copied into new room at the next step, cost more than the forward at a batch of 12;
    # at batch 1 it copied the whole cache twice a round); rows accepting equally many nodes keep every prefix
    # column, padding included, where it is: only their nodes move.
    in_room = (paths is not None and not (uniform and contiguous) and (uniform or width is not None)
               and _in_rooms(cache, kv_layers))
    if uniform and contiguous and kv_layers and kv_layers[0][0].shape[-2] == prefix_len + accepted.shape[1]:
        pass  # every column is kept where it is (a round without a tree; a chain accepted whole)
    elif in_room and paths is not None:
        rows = (list(host_lengths) if not uniform and host_lengths is not None and lengths is not None
                else [prefix_len] * len(paths))
        plan = compaction_plan(rows, [list(p) for p in paths])
        kept = prefix_len + accepted.shape[1] if uniform or width is None else width
        for layer in _attention_layers(cache):
            compact_in_room(layer, prefix_len, plan, kept)
    elif uniform:
        for keys, values, store in kv_layers:  # contiguous decided once per round, not once per layer
            store(keep_positions(keys, prefix_len, accepted, contiguous),
                  keep_positions(values, prefix_len, accepted, contiguous))
    else:
        if lengths is None:
            lengths = torch.full((accepted.shape[0],), prefix_len, dtype=torch.long, device=accepted.device)
        index = compaction_index(prefix_len, accepted, lengths, width)
        for keys, values, store in kv_layers:
            store(_gather_columns(keys, index), _gather_columns(values, index))
    _sync_linear_counts(cache)


def _attention_layers(cache: Any) -> list[Any]:
    """The layers :func:`_kv_layers` finds, as layer objects (a ``layers`` cache)."""
    return [layer for layer in getattr(cache, "layers", None) or []
            if not (hasattr(layer, "recurrent_states") and not hasattr(layer, "keys"))
            and getattr(layer, "keys", None) is not None and layer.keys.numel()]


def _in_rooms(cache: Any, kv_layers: list[tuple]) -> bool:
    """Whether every filled attention layer holds its columns in its in-place room (then a ragged commit moves
    them there) and the native kernels load."""
    from ddtree.targets.native import library

    layers = _attention_layers(cache)
    return (bool(layers) and len(layers) == len(kv_layers) and all(held_in_room(layer) for layer in layers)
            and library()[0] is not None)


def _sync_linear_counts(cache: Any) -> None:
    """transformers 5.25+ counts the tokens each linear-attention layer has seen (its ``get_seq_length``); the tree
    forward and the commit of its states bypass that count, so it is set to the committed length, as a chain
    prefill of the accepted tokens would leave it."""
    counts = [c for layer in getattr(cache, "layers", None) or []
              if isinstance(c := getattr(layer, "cumulative_length_linear", None), torch.Tensor)]
    if counts:
        length = cache_length(cache)
        for count in counts:
            count.fill_(length)


def _check_paths(paths: Sequence[Sequence[int]], accepted: torch.Tensor) -> None:
    """The host paths' invariants (checked on the host: no device read)."""
    if len(paths) != accepted.shape[0]:
        raise ValueError(f"{len(paths)} paths for {accepted.shape[0]} accepted rows")
    if any(not p or p[0] != 0 for p in paths):
        raise ValueError("every row's accepted path starts at the root (node 0)")
    if any(len(p) > accepted.shape[1] for p in paths):
        raise ValueError(f"a path is longer than accepted's {accepted.shape[1]} columns")


def _kv_layers(cache: Any) -> list[tuple]:
    """``(keys, values, store(keys, values))`` for every filled attention layer; the one place that knows how
    each transformers version holds them. Refuses caches ddtree cannot compact."""
    found = []
    layers = getattr(cache, "layers", None)
    if layers is None and hasattr(cache, "key_cache"):  # transformers 5.0's Qwen3NextDynamicCache: plain lists
        for i in range(len(cache.key_cache)):
            def store(k, v, i=i):
                cache.key_cache[i], cache.value_cache[i] = k, v
            if cache.key_cache[i] is not None and cache.key_cache[i].numel():
                found.append((cache.key_cache[i], cache.value_cache[i], store))
        return found
    for layer in layers or []:
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                "the target cache has sliding-window layers that discard states; build it with "
                "ddtree.blocks.new_target_cache(model) so every layer keeps all positions"
            )
        if hasattr(layer, "recurrent_states") and not hasattr(layer, "keys"):
            continue  # a stateful (linear-attention) layer: committed by its kind, from the verify's pending inputs
        def store(k, v, layer=layer):
            layer.keys, layer.values = k, v
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel():
            found.append((keys, layer.values, store))
    return found


def _gather_columns(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[b, :, index[b], :]`` for ``[B, heads, T, d]`` states."""
    bsz, heads, _, dim = tensor.shape
    idx = index.to(tensor.device)[:, None, :, None].expand(bsz, heads, index.shape[1], dim)
    return tensor.gather(2, idx)


def truncate(cache: Any, length: int) -> None:
    """Back to the first ``length`` columns: drop the rest in every attention layer (``DynamicCache.crop``'s
    meaning moved across versions) and any uncommitted tree state of stateful layers."""
    for kind in kinds_in_cache(cache):
        kind.drop_pending(cache)
    for keys, values, store in _kv_layers(cache):
        store(keys[..., :length, :], values[..., :length, :])


def truncate_front(cache: Any, count: int) -> None:
    """Drop the first ``count`` columns of every attention layer (padding that no remaining row needs)."""
    for keys, values, store in _kv_layers(cache):
        store(keys[..., count:, :], values[..., count:, :])


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` of every layer of ``cache`` (finished rows stop costing compute): attention
    columns and, for a hybrid target, each stateful layer's per-row state (a GDN conv window and recurrent state)."""
    for keys, values, store in _kv_layers(cache):
        index = rows.to(keys.device)
        store(keys.index_select(0, index), values.index_select(0, index))
    for kind in kinds_in_cache(cache):
        kind.select_rows(cache, rows)


def stack_rows(caches: list[Any], lengths: list[int]) -> Any:
    """One batch cache from batch-1 caches holding ``lengths[b]`` columns each: attention columns
    right-aligned (zeros in front, which :func:`padding_mask` masks) and stateful layers' states stacked. Reuses
    the longest row's cache object, so its per-layer bookkeeping (initialised layers, previous-state flags) stays."""
    if len(caches) != len(lengths) or not caches:
        raise ValueError(f"{len(caches)} caches for {len(lengths)} lengths")
    width = max(lengths)
    base = caches[lengths.index(width)]
    layers = [_kv_layers(c) for c in caches]
    for j, (_, _, store) in enumerate(layers[lengths.index(width)]):
        padded = [[torch.nn.functional.pad(rows[j][part], (0, 0, width - n, 0)) for rows, n in zip(layers, lengths)]
                  for part in (0, 1)]
        store(torch.cat(padded[0]), torch.cat(padded[1]))
    for kind in kinds_in_cache(base):
        kind.stack_rows(caches, base)
    return base
