"""Attention cache layers that append in place.

transformers' ``DynamicLayer`` concatenates on every update, so each decoding step copies every layer's whole
cache: a cost that grows with the context and is paid in every layer at every step. :func:`append_in_place`
makes a cache's plain attention layers write new columns into room reserved behind their last one (an eighth of
the length, at least 64 columns), handing out views of it; only running out of room, a new batch of rows or a
compaction that built new tensors moves the columns into fresh room.

The layer's ``keys``/``values`` stay the ordinary attribute every reader and ddtree's compaction
(:mod:`ddtree.targets.cache`) use: a prefix view of the room (after a decode step, a truncation or a leading-run
commit) keeps appending where it ends; any other tensor assigned there is copied into room at the next update.
"""

from __future__ import annotations

import types
from typing import Any

import torch

MIN_ROOM = 64
"""Columns reserved at least, beyond those held."""

_ROOM = "_ddtree_room"
_WRAPPED = "_ddtree_appends_in_place"


def capacity(columns: int) -> int:
    """Columns a layer's room holds when it is made for ``columns``: those and an eighth more, at least
    :data:`MIN_ROOM` more (so a cache's storage is at most ``capacity`` of the most columns it held)."""
    return columns + max(MIN_ROOM, columns // 8)


def append_in_place(cache: Any) -> Any:
    """Make ``cache``'s plain attention layers (transformers ``DynamicLayer``) append in place from their
    second update on; other layers (sliding, static, linear attention) and caches without ``layers`` are left
    as they are. Returns ``cache``."""
    if getattr(cache, "layers", None) is None or _WRAPPED in vars(cache):
        return cache
    cache.update = types.MethodType(_cache_update, cache)  # bound, so a copy.deepcopy of the cache rebinds it
    vars(cache)[_WRAPPED] = True
    return cache


def _cache_update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                  ) -> Any:
    from transformers.cache_utils import DynamicLayer

    index = kwargs.get("layer_idx", args[0] if args else None)
    layers = self.layers
    if isinstance(index, int) and index < len(layers):
        layer = layers[index]
        if type(layer) is DynamicLayer and "update" not in vars(layer):
            vars(layer)["update"] = types.MethodType(_layer_update, layer)
    return type(self).update(self, key_states, value_states, *args, **kwargs)


def _prefix_of(t: torch.Tensor, room: torch.Tensor) -> bool:
    """Whether ``t`` is ``room[..., :n, :]`` for some ``n`` (same start, strides, rows, heads and width)."""
    return (t.data_ptr() == room.data_ptr() and t.stride() == room.stride() and t.dtype == room.dtype
            and t.shape[:2] == room.shape[:2] and t.shape[-1] == room.shape[-1])


def _layer_update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    keys = self.keys
    if (not getattr(self, "is_initialized", False) or keys is None or keys.dim() != 4 or keys.numel() == 0
            or key_states.dim() != 4 or key_states.shape[:2] != keys.shape[:2]):
        return type(self).update(self, key_states, value_states, *args, **kwargs)  # transformers' own
    held, new = keys.shape[-2], key_states.shape[-2]
    room = room_for(self, new)
    room[0][..., held:held + new, :].copy_(key_states)
    room[1][..., held:held + new, :].copy_(value_states)
    self.keys, self.values = room[0][..., :held + new, :], room[1][..., :held + new, :]
    return self.keys, self.values


def room_for(layer: Any, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The room ``(keys, values)`` ``[B, H, capacity, D]`` of an initialized attention layer, holding its columns
    in place and space for ``new`` more after them (made, or moved into a larger one, when it has not)."""
    keys, values = layer.keys, layer.values
    held = keys.shape[-2]
    room = vars(layer).get(_ROOM)
    in_room = room is not None and _prefix_of(keys, room[0]) and _prefix_of(values, room[1])
    if not in_room or room[0].shape[-2] < held + new:
        size = capacity(held + new)
        room = tuple(t.new_empty(t.shape[0], t.shape[1], size, t.shape[3]) for t in (keys, values))
        room[0][..., :held, :].copy_(keys)
        room[1][..., :held, :].copy_(values)
        vars(layer)[_ROOM] = room
    return room


def held_in_room(layer: Any) -> bool:
    """Whether ``layer``'s keys and values are prefix views of its room (what :func:`compact_in_room` moves)."""
    room = vars(layer).get(_ROOM)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    return (room is not None and isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
            and keys.device.type == "cpu" and _prefix_of(keys, room[0]) and _prefix_of(values, room[1]))


def compaction_plan(lengths: list[int], paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ragged commit's rows for :func:`compact_in_room`, made once for every layer: each row's committed
    columns, accepted count and accepted tree nodes (padded)."""
    most = max(len(p) for p in paths)
    return (torch.tensor(lengths, dtype=torch.int64), torch.tensor([len(p) for p in paths], dtype=torch.int64),
            torch.tensor([list(p) + [0] * (most - len(p)) for p in paths], dtype=torch.int64))


def compact_in_room(layer: Any, prefix: int, plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    width: int) -> None:
    """Keep each row's committed columns and accepted nodes right-aligned at ``width`` inside the layer's room
    (:func:`held_in_room` must hold): only rows whose columns move are touched, and the layer keeps appending
    in place. The columns a row keeps are those the gathering commit keeps; its padding is left as it was."""
    from ddtree.runtime.invariant import caller_threads
    from ddtree.targets import native

    lib, why = native.library()
    if lib is None:
        raise RuntimeError(f"compact_in_room needs ddtree's native kernels: {why}")
    lens, counts, nodes = plan
    for buf in vars(layer)[_ROOM]:
        bsz, heads, cap, dim = buf.shape
        lib.ddtree_compact_rows(buf.data_ptr(), bsz, heads, cap, dim * buf.element_size(), prefix, lens.data_ptr(),
                                counts.data_ptr(), nodes.data_ptr(), nodes.shape[1], width, caller_threads())
    room = vars(layer)[_ROOM]
    layer.keys, layer.values = room[0][..., :width, :], room[1][..., :width, :]
