"""A preallocated, row-packed target cache for the static (compiled) round.

Each attention layer holds ``[B, heads, capacity, d]`` keys and values; row ``b``'s committed tokens sit in
columns ``0 .. lengths[b] - 1`` (column = position, no left padding), so rows of different lengths need no
shifting and every shape in a round follows from the batch, the capacity and the tree's node count. A forward
writes its tokens at the columns :meth:`RowPackedCache.set_write_columns` gave, per row; the commit copies the
accepted nodes' keys and values down to ``lengths .. lengths + k`` in place. Columns past a row's length hold
stale values that the mask hides and later rounds overwrite.

Works with transformers' attention layers through the ``Cache`` interface (``update`` returns the whole
buffers; the caller's 4D mask decides what each query sees).

A hybrid target's Gated DeltaNet layers get a :class:`StaticLinearLayer` at their index: the committed conv
window and recurrent state per row in fixed buffers, and fixed buffers for a verify's per-node inputs. The
patched GDN forward (:mod:`ddtree.targets.linear_attention`) finds it in the cache it is given and runs the
fixed-shape tree forward over the tree :meth:`RowPackedCache.set_tree` gave; :meth:`RowPackedCache.commit_states`
replays each row's accepted path into the state buffers in place.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ddtree.targets.cache import _kv_layers
from ddtree.targets.linear_attention import (
    StaticPending,
    _committed_states,
    _linear_layer_ids,
    static_commit,
    static_tree_forward,
    tree_conv_index,
)


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
        bsz, heads, q, dim = key_states.shape
        keys.scatter_(2, cols[:, None, :, None].expand(bsz, heads, q, dim), key_states.to(keys.dtype))
        vdim = value_states.shape[-1]
        values.scatter_(2, cols[:, None, :, None].expand(bsz, heads, q, vdim), value_states.to(values.dtype))
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


class StaticLinearLayer:
    """One GDN layer in the static round: each row's committed conv window ``[B, C, K]`` and recurrent state
    ``[B, HV, Dk, Dv]`` in fixed buffers, and the last verify's per-node inputs (:class:`StaticPending`), which
    the commit replays instead of keeping a state per node (a state is ``HV * Dk * Dv`` numbers, a node's
    inputs ``HV * (2 * Dk + Dv + 2)``: about 40 times fewer at Qwen3.6's ``Dk = Dv = 128``)."""

    runs_static_tree = True  # what the patched GDN forward looks for in its cache
    is_sliding = False
    is_compileable = True

    def __init__(self, owner: RowPackedCache, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.owner = owner
        self.conv, self.state = conv, state
        self.pending: StaticPending | None = None

    def reserve_nodes(self, nodes: int) -> None:
        if self.pending is None or self.pending.q.shape[1] != nodes:
            self.pending = StaticPending.empty(self.conv, self.state, nodes)
            for buf in self.pending.tensors():
                mark_static(buf)

    def tree_forward(self, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        owner = self.owner
        parents, depths, index = owner.tree_parents, owner.tree_depths, owner.conv_index
        if self.pending is None or parents is None or depths is None or index is None:
            raise RuntimeError("a static GDN forward needs RowPackedCache.reserve_nodes and set_tree first")
        return static_tree_forward(module, hidden, self.conv, self.state, self.pending, parents, depths, index,
                                   owner.max_depth)

    def commit(self, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        assert self.pending is not None  # a verify ran
        static_commit(self.conv, self.state, self.pending, accepted, alive)


class RowPackedCache(Cache):
    """Preallocated row-packed keys/values for every attention layer of a target, and fixed states for its
    GDN layers, ``linear`` by layer index (attention layers take the other indices in order; see the module
    doc)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 linear: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        if len(keys) != len(values) or not keys:
            raise ValueError(f"a row-packed cache needs keys and values for each layer, got {len(keys)}/{len(values)}")
        linear = linear or {}
        for buf in (*keys, *values, *(b for pair in linear.values() for b in pair)):
            mark_static(buf)
        self.packed = [RowPackedLayer(self, k, v) for k, v in zip(keys, values)]
        self.linear = {idx: StaticLinearLayer(self, conv, state) for idx, (conv, state) in sorted(linear.items())}
        attention = iter(self.packed)
        layers: list[Any] = [self.linear[i] if i in self.linear else next(attention)
                             for i in range(len(self.packed) + len(self.linear))]
        super().__init__(layers=layers)
        bsz = keys[0].shape[0]
        self.write_columns = torch.zeros(bsz, 1, dtype=torch.long, device=keys[0].device)
        self.tree_parents: torch.Tensor | None = None
        self.tree_depths: torch.Tensor | None = None
        self.conv_index: torch.Tensor | None = None
        self.max_depth = 0

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
        """Room for a verify of ``nodes`` tree nodes in the GDN layers (outside the compiled steps: buffers
        made there would not keep their addresses)."""
        for layer in self.linear.values():
            layer.reserve_nodes(nodes)

    def set_tree(self, parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> None:
        """The tree the next forward verifies, for the GDN layers (attention layers see it through the mask):
        each node's conv window and recurrence follow its own ancestors; no node is deeper than ``max_depth``."""
        self.tree_parents, self.tree_depths, self.max_depth = parents, depths, max_depth
        if self.linear:
            kernel = next(iter(self.linear.values())).conv.shape[-1]
            self.conv_index = tree_conv_index(parents, depths, kernel)

    def commit_states(self, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        """Install each live row's accepted path (``accepted`` ``[B, L]``, ``-1`` past it) in the GDN layers'
        states, in place (attention layers commit with :func:`commit_packed`)."""
        for layer in self.linear.values():
            layer.commit(accepted, alive)

    @classmethod
    def from_cache(cls, cache: Any, host_lengths: list[int], capacity: int) -> RowPackedCache:
        """The committed columns of a ddtree prefill cache (rows right-aligned, ``host_lengths[b]`` real columns
        each) copied row-packed into buffers of ``capacity`` columns."""
        layers = _kv_layers(cache)
        if not layers:
            raise ValueError("the target cache holds no attention layers to copy (was the prompt prefilled?)")
        if len(layers) != _attention_layer_count(cache):
            raise ValueError("the static round copies a cache whose layers are attention or GDN, in transformers' "
                             "per-layer form; this one has others (use compile=False)")
        linear = {}
        for idx in _linear_layer_ids(cache):
            conv, state = _committed_states(cache, idx)
            linear[idx] = (conv.clone(), state.clone())  # each row's own prefill state (rows are not padded)
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
        return cls(keys, values, linear)

    def grown(self, capacity: int) -> RowPackedCache:
        """A copy with room for ``capacity`` columns (rows keep their columns; GDN states are shared, not
        copied: they have no columns)."""
        if capacity <= self.capacity:
            return self
        keys, values = [], []
        for k, v in zip(self.keys, self.values):
            keys.append(torch.nn.functional.pad(k, (0, 0, 0, capacity - k.shape[2])))
            values.append(torch.nn.functional.pad(v, (0, 0, 0, capacity - v.shape[2])))
        return RowPackedCache(keys, values, {i: (layer.conv, layer.state) for i, layer in self.linear.items()})


def mark_static(buf: torch.Tensor) -> None:
    """Tell the compiler ``buf`` keeps its address across calls, so a step that writes into it in place can
    still be captured as a CUDA graph (made outside any compiled region)."""
    torch._dynamo.mark_static_address(buf)


def _attention_layer_count(cache: Any) -> int:
    return sum(1 for layer in getattr(cache, "layers", []) if not hasattr(layer, "recurrent_states"))


def commit_packed(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor,
                  accepted: torch.Tensor) -> None:
    """Copy each row's accepted tree nodes (``accepted`` ``[B, L]`` node indices, ``-1`` past the path) from
    columns ``lengths + node`` down to ``lengths + 0 .. L - 1``, in place, in every layer. Columns past a row's
    path receive the root's states: they lie beyond its new length, hidden until overwritten."""
    src = lengths[:, None] + accepted.clamp(min=0)  # [B, L]
    dst = lengths[:, None] + torch.arange(accepted.shape[1], device=accepted.device)
    for buf in (*keys, *values):
        bsz, heads, _, dim = buf.shape
        index = src[:, None, :, None].expand(bsz, heads, src.shape[1], dim)
        moved = buf.gather(2, index)
        buf.scatter_(2, dst[:, None, :, None].expand_as(index), moved)


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
