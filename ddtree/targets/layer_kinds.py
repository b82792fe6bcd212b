"""Decoder layer kinds that carry state from token to token, behind one interface.

Softmax attention keeps its past as KV columns, which :mod:`ddtree.targets.cache` compacts by position.
A layer with a recurrent state (Gated DeltaNet linear attention today) cannot see a flattened tree as one
chain without mixing siblings, so each such kind tells the target side, through
:class:`StatefulLayerKind`, how to run a tree through it and what to do with its state after a round.
The cache, forward and round code (the static round's row-packed cache too) ask
:func:`ddtree.targets.description.describe` (a model) or :func:`kinds_in_cache` (a cache) for the kinds present
and call this interface; none of them names a family. A new kind is one class here in :data:`STATEFUL_KINDS`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ddtree.core.tree import DraftTree
from ddtree.targets.linear_attention import GatedDeltaNet


class StaticStates(Protocol):
    """One stateful kind's layers in the static (compiled) round, made by its :meth:`StatefulLayerKind.static_states`:
    each layer's committed state per row in fixed buffers, and fixed buffers for a verify's per-node inputs.
    ``layers`` maps each of its layer indices to the object the row-packed cache holds there, which the kind's
    tree-aware forward finds in the cache it is given. Every method is called inside or between the compiled
    steps, so none reads the device back or allocates where a step runs (except as ``reserve_nodes`` says)."""

    layers: dict[int, Any]

    def reserve_nodes(self, nodes: int) -> None:
        """Room for a verify of ``nodes`` tree nodes (called outside the compiled steps: buffers made inside
        would not keep their addresses)."""
        ...

    def set_tree(self, parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> None:
        """The tree the next verify runs (``[B, N]`` parents and depths; no node deeper than ``max_depth``)."""
        ...

    def commit(self, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        """Install each live row's accepted path (``accepted`` ``[B, L]`` node indices, ``-1`` past it) in the
        state buffers, in place; rows with ``alive`` False keep theirs."""
        ...


class StatefulLayerKind(Protocol):
    """One kind of layer with per-row state. ``modules`` finds its layers in a model (empty: the model has
    none); ``prepare`` routes them through a tree-aware forward; a verify forward's extra kwargs come from
    ``tree_forward_kwargs``; the verify keeps per-node inputs pending (never writing the committed state) until
    ``commit`` installs each row's accepted path or ``drop_pending`` forgets them. For the static round,
    ``static_states`` copies a prefilled cache's layers of this kind into fixed buffers (:class:`StaticStates`)."""

    name: str
    """Human name for error messages, e.g. ``"Gated DeltaNet"``."""
    model_types: tuple[str, ...]
    """Model types whose layers of this kind ddtree has verified as trees (others are refused)."""
    padded_prefill_exact: bool
    """Whether a left-padded batch prefill gives every row exactly its own batch-1 state (if not, rows are
    prefilled one by one and their caches stacked)."""
    prefill_multiple: int
    """A chunked prefill splits the prompt at multiples of this many tokens (1: anywhere)."""

    def modules(self, model: Any) -> list[torch.nn.Module]: ...

    def prefill_continues_state(self) -> bool:
        """Whether a multi-token forward continues the cached state (so a prompt may be prefilled in chunks)."""
        ...

    def new_cache(self, model: Any) -> Any: ...

    def prepare(self, model: Any, exact: bool = False) -> None:
        """Route the model's layers of this kind through its tree-aware forward; ``exact``: one-token steps
        through it too, with the tree's own arithmetic (``numerics="exact"``)."""
        ...

    def release(self, model: Any) -> None:
        """Undo :meth:`prepare` (the layers' own forwards back), so that routing wrapped inside it can be
        taken back and a later :meth:`prepare` routes the layers anew."""
        ...

    def tree_forward_kwargs(self, model: Any, tree: DraftTree) -> dict[str, Any]: ...

    def holds_state(self, cache: Any) -> bool:
        """Whether ``cache`` has slots of this kind (filled or not)."""
        ...

    def commit(self, cache: Any, accepted: torch.Tensor) -> None: ...

    def drop_pending(self, cache: Any) -> None: ...

    def select_rows(self, cache: Any, rows: torch.Tensor) -> None: ...

    def stack_rows(self, caches: list[Any], into: Any) -> None: ...

    def static_states(self, cache: Any) -> StaticStates:
        """This kind's layers of a prefilled ``cache`` (rows not padded: each its own state) in fixed buffers."""
        ...


STATEFUL_KINDS: tuple[StatefulLayerKind, ...] = (GatedDeltaNet(),)
"""Every stateful layer kind ddtree verifies exactly."""


def kinds_in_model(model: Any) -> tuple[StatefulLayerKind, ...]:
    """The stateful kinds with layers in ``model`` (read it from the model's description, which remembers it)."""
    return tuple(kind for kind in STATEFUL_KINDS if kind.modules(model))


def kinds_in_cache(cache: Any) -> tuple[StatefulLayerKind, ...]:
    """The stateful kinds with slots in ``cache`` (for cache operations, which are given no model)."""
    return tuple(kind for kind in STATEFUL_KINDS if kind.holds_state(cache))
