"""A preallocated, row-packed target cache for the static (compiled) round.

Each attention layer holds ``[B, heads, capacity, d]`` keys and values; row ``b``'s committed tokens sit in
columns ``0 .. lengths[b] - 1`` (column = position, no left padding), so rows of different lengths need no
shifting and every shape in a round follows from the batch, the capacity and the tree's node count. A forward
writes its tokens at the columns :meth:`RowPackedCache.set_write_columns` gave, per row; the commit copies the
accepted nodes' keys and values down to ``lengths .. lengths + k`` in place. Columns past a row's length hold
stale values that the mask hides and later rounds overwrite.

Works with transformers' attention layers through the ``Cache`` interface (``update`` returns the whole
buffers; the caller's 4D mask decides what each query sees).

A hybrid target's stateful layers (Gated DeltaNet today) come from their kind
(:meth:`~ddtree.targets.layer_kinds.StatefulLayerKind.static_states`): fixed buffers for each row's committed
state and for a verify's per-node inputs, with an object at each of their layer indices that the kind's patched
forward finds in the cache it is given. :meth:`RowPackedCache.set_tree` hands them the tree a verify runs and
:meth:`RowPackedCache.commit_states` has them install each row's accepted path, in place. Nothing here names a
family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ddtree.targets.cache import _kv_layers
from ddtree.targets.layer_kinds import StaticStates, kinds_in_cache


class RowPackedLayer(CacheLayerMixin):
    """One attention layer's fixed buffers; writes go to the owning cache's current write columns."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: RowPackedCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a row-packed cache is allocated up front (RowPackedCache.from_cache)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cols = self.owner.write_columns  # [B, Q]
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        put_columns(keys, cols, key_states.to(keys.dtype))
        put_columns(values, cols, value_states.to(values.dtype))
        return keys, values

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.capacity, 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        # Per-row lengths live on the device (the round's ``lengths``); a caller that asks the cache for one
        # length would size something wrong, so say where the lengths are.
        raise RuntimeError("a row-packed cache has per-row lengths: pass position_ids (and cache_position) explicitly")

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    @property
    def capacity(self) -> int:
        assert self.keys is not None
        return self.keys.shape[2]


class RowPackedCache(Cache):
    """Preallocated row-packed keys/values for every attention layer of a target, and its stateful layers' fixed
    states, ``stateful`` (one :class:`~ddtree.targets.layer_kinds.StaticStates` per kind; attention layers take
    the other indices in order; see the module doc)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 stateful: Sequence[StaticStates] = ()) -> None:
        if len(keys) != len(values) or not keys:
            raise ValueError(f"a row-packed cache needs keys and values for each layer, got {len(keys)}/{len(values)}")
        for buf in (*keys, *values):
            mark_static(buf)
        self.packed = [RowPackedLayer(self, k, v) for k, v in zip(keys, values)]
        self.stateful = list(stateful)
        at = {idx: layer for states in self.stateful for idx, layer in states.layers.items()}
        attention = iter(self.packed)
        layers: list[Any] = [at[i] if i in at else next(attention) for i in range(len(self.packed) + len(at))]
        super().__init__(layers=layers)
        bsz = keys[0].shape[0]
        self.write_columns = torch.zeros(bsz, 1, dtype=torch.long, device=keys[0].device)

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def keys(self) -> list[torch.Tensor]:
        return [cast(torch.Tensor, layer.keys) for layer in self.packed]

    @property
    def values(self) -> list[torch.Tensor]:
        return [cast(torch.Tensor, layer.values) for layer in self.packed]

    def set_write_columns(self, columns: torch.Tensor) -> None:
        """Where the next forward's tokens go, ``[B, Q]`` columns (a row's positions, since rows are packed)."""
        self.write_columns = columns

    def reserve_nodes(self, nodes: int) -> None:
        """Room for a verify of ``nodes`` tree nodes in the stateful layers (outside the compiled steps: buffers
        made there would not keep their addresses)."""
        for states in self.stateful:
            states.reserve_nodes(nodes)

    def set_tree(self, parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> None:
        """The tree the next forward verifies, for the stateful layers (attention layers see it through the
        mask): each node runs from its own ancestors' state; no node is deeper than ``max_depth``."""
        for states in self.stateful:
            states.set_tree(parents, depths, max_depth)

    def commit_states(self, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        """Install each live row's accepted path (``accepted`` ``[B, L]``, ``-1`` past it) in the stateful
        layers' states, in place (attention layers commit with :func:`commit_packed`)."""
        for states in self.stateful:
            states.commit(accepted, alive)

    @classmethod
    def from_cache(cls, cache: Any, host_lengths: list[int], capacity: int) -> RowPackedCache:
        """The committed columns of a ddtree prefill cache (rows right-aligned, ``host_lengths[b]`` real columns
        each) copied row-packed into buffers of ``capacity`` columns."""
        layers = _kv_layers(cache)
        if not layers:
            raise ValueError("the target cache holds no attention layers to copy (was the prompt prefilled?)")
        stateful = [kind.static_states(cache) for kind in kinds_in_cache(cache)]
        if len(layers) + sum(len(states.layers) for states in stateful) != len(getattr(cache, "layers", ())):
            raise ValueError("the static round copies a cache whose layers are attention or of a stateful kind, in "
                             "transformers' per-layer form; this one has others (use compile=False)")
        width = layers[0][0].shape[2]
        if capacity < width:
            raise ValueError(f"capacity {capacity} is below the prefill's {width} columns")
        keys, values = [], []
        for k, v, _ in layers:
            kb = k.new_zeros(k.shape[0], k.shape[1], capacity, k.shape[3])
            vb = v.new_zeros(v.shape[0], v.shape[1], capacity, v.shape[3])
            for b, n in enumerate(host_lengths):
                kb[b, :, :n] = k[b, :, width - n : width]
                vb[b, :, :n] = v[b, :, width - n : width]
            keys.append(kb)
            values.append(vb)
        return cls(keys, values, stateful)

    def grown(self, capacity: int) -> RowPackedCache:
        """A copy with room for ``capacity`` columns (rows keep their columns; the stateful layers' states are
        shared, not copied: they have no columns)."""
        if capacity <= self.capacity:
            return self
        keys, values = [], []
        for k, v in zip(self.keys, self.values):
            keys.append(torch.nn.functional.pad(k, (0, 0, 0, capacity - k.shape[2])))
            values.append(torch.nn.functional.pad(v, (0, 0, 0, capacity - v.shape[2])))
        return RowPackedCache(keys, values, self.stateful)


def mark_static(buf: torch.Tensor) -> None:
    """Tell the compiler ``buf`` keeps its address across calls, so a step that writes into it in place can
    still be captured as a CUDA graph (made outside any compiled region)."""
    torch._dynamo.mark_static_address(buf)


def commit_packed(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor,
                  accepted: torch.Tensor) -> None:
    """Copy each row's accepted tree nodes (``accepted`` ``[B, L]`` node indices, ``-1`` past the path) from
    columns ``lengths + node`` down to ``lengths + 0 .. L - 1``, in place, in every layer. Columns past a row's
    path receive the root's states: they lie beyond its new length, hidden until overwritten."""
    src = lengths[:, None] + accepted.clamp(min=0)  # [B, L]
    dst = lengths[:, None] + torch.arange(accepted.shape[1], device=accepted.device)
    for buf in (*keys, *values):
        bsz, heads, _, dim = buf.shape
        moved = buf.gather(2, src[:, None, :, None].expand(bsz, heads, src.shape[1], dim))
        put_columns(buf, dst, moved)


def put_columns(buf: torch.Tensor, columns: torch.Tensor, states: torch.Tensor) -> None:
    """Write ``states`` ``[B, heads, Q, d]`` into ``buf`` ``[B, heads, capacity, d]`` at each row's ``columns``
    ``[B, Q]``, in place. An indexed put, not a scatter: a compiled graph keeps a put into its input in place,
    where a scatter becomes a copy of the whole buffer (and a copy back) every forward."""
    rows = torch.arange(buf.shape[0], device=buf.device)[:, None, None]
    heads = torch.arange(buf.shape[1], device=buf.device)[None, :, None]
    buf.index_put_((rows, heads, columns[:, None, :]), states)


def packed_tree_mask(visibility: torch.Tensor, depths: torch.Tensor, lengths: torch.Tensor, capacity: int,
                     dtype: torch.dtype, sliding_window: int | None = None) -> torch.Tensor:
    """The additive mask ``[B, 1, N, capacity]`` of a tree written at columns ``lengths .. lengths + N - 1`` of a
    row-packed cache: each node sees its row's committed columns, its ancestors and itself (and, with
    ``sliding_window``, only keys at positions ``> position - sliding_window``, HF's sliding rule)."""
    bsz, n, _ = visibility.shape
    device = visibility.device
    col = torch.arange(capacity, device=device)
    rel = col[None, :] - lengths[:, None]  # [B, C]: the tree node a column holds, when 0 <= rel < N
    in_tree = (rel >= 0) & (rel < n)
    node = rel.clamp(0, n - 1)
    sees_node = visibility.gather(2, node[:, None, :].expand(bsz, n, capacity))  # [B, N, C]
    allowed = (rel < 0)[:, None, :] | (in_tree[:, None, :] & sees_node)
    if sliding_window is not None:
        q_pos = lengths[:, None] + depths  # [B, N]
        k_pos = torch.where(in_tree, lengths[:, None] + depths.gather(1, node), col[None, :])  # [B, C]
        allowed = allowed & ((q_pos[:, :, None] - k_pos[:, None, :]) < sliding_window)
    mask = torch.zeros(bsz, 1, n, capacity, dtype=dtype, device=device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)
