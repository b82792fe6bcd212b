"""Attention backends for the target's tree-verify forward.

A backend turns a :class:`~ddtree.tree.DraftTree` and the committed prefix
length into the extra keyword arguments of one HF forward call. ``"sdpa"`` is
the dense-mask path: an additive ``[B, 1, N, prefix + N]`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import tree_attention_mask
from .tree import DraftTree


def _sliding_window(config) -> int | None:
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if window and any(t == "sliding_attention" for t in layer_types):
        return int(window)
    return None


@dataclass
class DenseMaskBackend:
    """Dense additive mask; works with any HF attention implementation that accepts a 4D mask."""

    name: str = "sdpa"

    def prepare(self, model) -> None:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            model.set_attn_implementation("sdpa")

    def tree_forward_kwargs(self, model, tree: DraftTree, prefix_len: int, dtype: torch.dtype) -> dict:
        full = tree_attention_mask(tree.visibility, prefix_len, dtype)
        window = _sliding_window(model.config)
        if window is None:
            return {"attention_mask": full}
        sliding = tree_attention_mask(tree.visibility, prefix_len, dtype, sliding_window=window, depths=tree.depths)
        return {"attention_mask": {"full_attention": full, "sliding_attention": sliding}}


def get_backend(name: str | None = "sdpa"):
    """The tree-verify attention backend called ``name`` (``None`` or ``"sdpa"``: dense mask)."""
    if name in (None, "sdpa", "auto"):
        return DenseMaskBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: 'sdpa'")
