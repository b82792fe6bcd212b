"""Tree attention under ``numerics="exact"``: every query reduces over its logical key sequence.

A tree node at depth ``d`` of a row with ``L`` committed tokens sees the row's committed prefix (from its first
real column, or the first inside a sliding window) and then its own path, root first; the one-token step at
position ``L + d`` sees the same keys in the same order. :func:`ddtree.targets.row_kernels.tree_attention`
reduces over exactly that sequence, so the node and the step get the same bits. This module turns what
transformers hands an attention function (the cache's keys, a padding mask or ddtree's tree spec, the layer's
window, sinks and soft-capping) into that call, and registers it as the attention implementation
:data:`EXACT_IMPLEMENTATION`.

A prompt's prefill (several queries, no tree) runs the ordinary causal kernels, or inside :func:`row_prefill`
(a short prompt's prefill, any batch) the row kernel as a chain, where each query reduces over its own keys
whatever the padding, so a row's cache has its batch-1 bits. A layer with attention sinks runs every prefill as
a chain, since the causal kernels take no sinks.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree.core.tree import DraftTree
from ddtree.targets import row_kernels
from ddtree.targets.kernels import causal_attention, key_padding_mask
from ddtree.targets.registration import TREE_KWARG

EXACT_IMPLEMENTATION = "ddtree_exact"
"""The transformers attention implementation name of exact tree attention."""

_ROW_PREFILL: contextvars.ContextVar[bool] = contextvars.ContextVar("ddtree_row_prefill", default=False)


@contextmanager
def row_prefill(valid: torch.Tensor | None = None) -> Iterator[None]:
    """A prefill forward on the row kernels: the products on the packed kernels (not the BLAS of
    :func:`~ddtree.targets.cpu_linear.bulk_rows`) and exact attention's queries as a chain over their own keys
    (not the causal kernels). ``valid`` (``[B, T]``, the chunk's real tokens): the products skip the padding."""
    token = _ROW_PREFILL.set(True)
    try:
        with row_kernels.only_rows(valid):
            yield
    finally:
        _ROW_PREFILL.reset(token)


@dataclass(eq=False)
class ExactTreeSpec:
    """The tree of one verify forward, as exact attention reads it: ancestor-or-self ``visibility`` ``[B, N, N]``,
    node ``depths`` ``[B, N]`` and each row's committed ``lengths`` ``[B]`` (``None``: every row holds the whole
    prefix). Each layer kind's key ranges are made once per forward (:meth:`keys`)."""

    visibility: torch.Tensor
    depths: torch.Tensor
    lengths: torch.Tensor | None = None
    _keys: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_tree(cls, tree: DraftTree, prefix_valid: torch.Tensor | None = None) -> ExactTreeSpec:
        """The spec of ``tree``; ``prefix_valid`` ``[B, P]`` marks each row's committed columns (left padding)."""
        lengths = None if prefix_valid is None else prefix_valid.sum(dim=-1)
        return cls(tree.visibility.bool(), tree.depths, lengths)

    @classmethod
    def chain(cls, bsz: int, n: int, device: torch.device) -> ExactTreeSpec:
        """``n`` tokens of each of ``bsz`` unpadded rows, each seeing the ones before it: a prefill chunk, as
        exact attention runs one on the row kernels."""
        depths = torch.arange(n, device=device).expand(bsz, n)
        return cls(torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(bsz, n, n), depths)

    @property
    def num_nodes(self) -> int:
        return self.visibility.shape[-1]

    def keys(self, prefix_len: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(start [B, N], visible [B, N, N])`` for a layer with ``window`` (int64 and uint8): see
        :func:`key_ranges`."""
        key = (prefix_len, window)
        if key not in self._keys:
            pads = None if self.lengths is None else prefix_len - self.lengths.to(self.depths.device)
            start, visible = key_ranges(self.visibility, self.depths, prefix_len, pads, window)
            # as the row kernel reads them, converted once for every layer of the forward
            self._keys[key] = (start.to(torch.int64).contiguous(), visible.to(torch.uint8).contiguous())
        return self._keys[key]


def key_ranges(visibility: torch.Tensor, depths: torch.Tensor, prefix_len: int | torch.Tensor,
               pads: torch.Tensor | None, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's keys as the row kernel takes them: the first visible prefix column ``start`` ``[B, N]`` (the
    row's first real column, or the first inside the window of a node at position ``committed + depth``) and
    the visible tree nodes ``[B, N, N]`` (ancestors-or-self, those within the window). ``prefix_len``: the
    committed columns, one for every row or ``[B, 1]`` (a row-packed cache's own lengths)."""
    bsz, n = depths.shape
    first = torch.zeros(bsz, 1, dtype=torch.long, device=depths.device) if pads is None else pads.view(-1, 1)
    start = first.expand(bsz, n)
    visible = visibility
    if window is not None:
        start = torch.maximum(start, prefix_len + depths - window + 1)
        visible = visibility & ((depths[:, :, None] - depths[:, None, :]) < window)
    return start, visible


def one_token_keys(attention_mask: Any, bsz: int, kv_len: int, window: int | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start [B, 1], visible [B, 1, 1])`` of a one-token step without a tree spec (a root-only tree): each
    row's first real column (after its left padding, inside the window) as int64, the node itself as uint8."""
    start = torch.zeros(bsz, 1, dtype=torch.long, device=device)
    if attention_mask is not None:  # left padding: each row's first real column
        start = (attention_mask[:, :kv_len] == 0).sum(dim=-1, keepdim=True)
    if window is not None:
        start = start.clamp(min=kv_len - window)
    return start.to(torch.int64).contiguous(), torch.ones(bsz, 1, 1, dtype=torch.uint8, device=device)


def _left_pads(attention_mask: Any, batch: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Each row's leading padding columns from a 2D padding mask (``None``: no padding)."""
    keep = key_padding_mask(attention_mask, batch, kv_len, device)
    if keep is None:
        return None
    pads = (~keep).sum(dim=-1)
    if not torch.equal(keep, torch.arange(kv_len, device=device)[None] >= pads[:, None]):
        raise ValueError("numerics='exact' takes left-padded rows (each row's padding before its tokens), as "
                         "ddtree and HF pad them; this attention mask has padding elsewhere")
    return pads


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: the row kernel for a tree (ddtree's spec) or a one-token step, the
    causal kernels for a prompt's prefill. Returns ``[B, N, Hq, D]``."""
    if dropout:
        raise ValueError("numerics='exact' is inference only (attention dropout must be 0)")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        raise ValueError("numerics='exact' verifies a tree through the backend's tree spec (backend."
                         "tree_forward_kwargs), not a dense 4D mask: a mask does not say each node's key order. "
                         "A loop that passes a tree mask needs a target prepared with numerics='fast' (the "
                         "generator's setting; exact is the CPU default), or it takes the 'exact' backend's "
                         "tree_forward_kwargs")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    sinks = kwargs.get("s_aux")
    spec = kwargs.get(TREE_KWARG)
    bsz, _, n, _ = query.shape
    prefix_len = key.shape[2] - n
    if spec is not None:
        if not isinstance(spec, ExactTreeSpec):
            raise ValueError(f"numerics='exact' needs the exact backend's tree spec, got {type(spec).__name__}: "
                             "build the forward's kwargs with the generator's backend")
        if spec.num_nodes != n:
            raise ValueError(f"tree spec has {spec.num_nodes} nodes but the forward has {n} queries")
        start, visible = spec.keys(prefix_len, window)
    elif n == 1:  # a one-token step: a root-only tree
        start, visible = one_token_keys(attention_mask, bsz, key.shape[2], window, query.device)
    elif sinks is not None or _ROW_PREFILL.get():  # a prefill with sinks, or on the row kernels: a chain
        pads = _left_pads(attention_mask, bsz, key.shape[2], query.device)
        chain = ExactTreeSpec.chain(bsz, n, query.device)
        start, visible = key_ranges(chain.visibility, chain.depths, prefix_len, pads, window)
        if pads is not None:  # a padded prompt's first chunk: its pad columns are no one's keys
            visible = visible & (prefix_len + torch.arange(n, device=query.device) >= pads.view(-1, 1, 1))
    else:
        padding = key_padding_mask(attention_mask, bsz, key.shape[2], query.device)
        out = causal_attention(query, key, value, scale=scale, window=window, key_padding=padding, softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    out = row_kernels.tree_attention(query, key, value, start, visible, scale=scale, sinks=sinks, softcap=softcap)
    return out, None


def _no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """Mask builder: exact attention builds its own key ranges, so only a 2D padding mask passes."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask
    return None


def register_exact_attention() -> None:
    """Register :func:`exact_attention` with transformers as :data:`EXACT_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EXACT_IMPLEMENTATION, exact_attention)
    AttentionMaskInterface.register(EXACT_IMPLEMENTATION, _no_mask)
