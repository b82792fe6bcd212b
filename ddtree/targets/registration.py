"""Registration of ddtree's split tree attention with transformers.

The split backends run through transformers attention implementations registered with
``AttentionInterface`` under ``ddtree_split``, ``ddtree_fused`` and ``ddtree_fa`` (no "flash" in the
names: transformers special-cases those). A model set to one of them runs ordinary causal attention (with
its sliding window) when no tree is passed, so prefill and decode need nothing else; a verify forward
passes a :class:`TreeAttentionSpec` under :data:`TREE_KWARG`.

Nothing is registered at import: a split backend's ``prepare`` calls
:func:`register_attention_implementations`, and so can a user who loads a model with
``attn_implementation="ddtree_fused"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ddtree.core.tree import DraftTree
from ddtree.targets.kernels import (
    causal_attention,
    flash_attn_prefix_kernel,
    fused_block_kernel,
    fused_prefix_kernel,
    key_padding_mask,
)
from ddtree.targets.split_attention import (
    BlockKernel,
    PrefixKernel,
    split_tree_attention,
    torch_prefix_kernel,
    tree_block_allowed,
    window_split,
)

TREE_KWARG = "ddtree_tree"
"""Name of the forward kwarg that carries a :class:`TreeAttentionSpec` down to the attention function."""

OUTPUT_READER = "_ddtree_reads_output"
"""An attribute set (True) on a forward hook that only reads its module's output, as the target forward's
capture of the drafter's hidden states does: the exact decoder layers run a forward's later layers ahead
(their Python then runs on warm caches) where every hook on them is such a reader."""


def _capture_key(hook: Any) -> str | None:
    """The output name (``"hidden_states"``, ``"attentions"``, ...) of transformers' output-capturing hook,
    which a forward with ``output_hidden_states`` or ``output_attentions`` leaves on the model's layers for
    good; None for any other hook (read from the hook's closure: a transformers that builds it otherwise gives
    None, and the hook then counts as a watcher)."""
    code = getattr(hook, "__code__", None)
    if (code is None or not getattr(hook, "__module__", "").startswith("transformers.")
            or code.co_name != "output_capturing_hook"):
        return None
    cells = dict(zip(code.co_freevars, getattr(hook, "__closure__", None) or ()))
    try:
        key = cells["key"].cell_contents
    except (KeyError, ValueError):
        return None
    return key if isinstance(key, str) else None


def reads_output_only(hook: Any) -> bool:
    """Whether a forward hook on a decoder layer only reads the layer's output: ours (:data:`OUTPUT_READER`) or
    transformers' capture of hidden states."""
    return bool(getattr(hook, OUTPUT_READER, False)) or _capture_key(hook) == "hidden_states"


def idle(hook: Any) -> bool:
    """Whether a forward hook does nothing in the forward running now: transformers' output capture outside a
    forward that collects its output (its collector is per call)."""
    key = _capture_key(hook)
    if key is None:
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get()
    return collected is None or key not in collected


@dataclass(eq=False)
class TreeAttentionSpec:
    """What the attention function needs about the tree, built once per verify forward.

    ``depth_bound`` is a host int at least the deepest node's depth, so no layer
    has to sync the device. Block masks are memoised per ``(prefix_len, window)``
    so sliding and full layers each build theirs once per forward, not once per layer.
    """

    visibility: torch.Tensor  # [B, N, N] bool, ancestor-or-self
    depths: torch.Tensor  # [B, N] long
    depth_bound: int
    _blocks: dict[tuple[int, int | None, str], tuple[int, int, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def from_tree(cls, tree: DraftTree) -> TreeAttentionSpec:
        """The spec of ``tree``; its depth bound is ``num_nodes - 1`` (a shape), which reading none keeps exact."""
        return cls(tree.visibility.bool(), tree.depths, tree.num_nodes - 1)

    @property
    def num_nodes(self) -> int:
        return self.visibility.shape[-1]

    def block(self, prefix_len: int, window: int | None, device: torch.device) -> tuple[int, int, torch.Tensor]:
        """``(band_start, common_start, allowed)`` for one layer kind; see :func:`window_split`."""
        key = (prefix_len, window, str(device))
        if key not in self._blocks:
            band_start, common_start = window_split(prefix_len, self.depth_bound, window)
            allowed = tree_block_allowed(
                self.visibility.to(device), self.depths.to(device), prefix_len, band_start, common_start, window
            )
            self._blocks[key] = (band_start, common_start, allowed)
        return self._blocks[key]


def _make_attention_function(
    prefix_kernel: PrefixKernel, block_kernel: BlockKernel | None, use_flash_attn: bool
) -> Callable[..., tuple[torch.Tensor, None]]:
    """A transformers attention function: split tree attention when a tree is passed, causal otherwise."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, softcap: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if kwargs.get("s_aux") is not None:
            raise ValueError(
                "ddtree split attention does not support attention sinks (s_aux): "
                "use attention=\"sdpa\" for this target"
            )
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        spec = kwargs.get(TREE_KWARG)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            if spec is not None:
                raise ValueError("pass either a tree spec or a dense 4D mask to the forward, not both")
            # A ready dense mask (the "sdpa" backend's kwargs): run it as sdpa would.
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask.to(query.device), dropout_p=dropout, scale=scale,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        elif spec is None:
            padding = key_padding_mask(attention_mask, query.shape[0], key.shape[2], query.device)
            out = causal_attention(
                query, key, value, scale=scale, window=window, key_padding=padding,
                use_flash_attn=use_flash_attn, dropout=dropout, softcap=softcap,
            )
        else:
            if dropout:
                raise ValueError("tree verification is inference only (dropout must be 0)")
            n = query.shape[2]
            if spec.num_nodes != n:
                raise ValueError(f"tree spec has {spec.num_nodes} nodes but the forward has {n} queries")
            prefix_len = key.shape[2] - n
            if key_padding_mask(attention_mask, query.shape[0], key.shape[2], query.device) is not None:
                raise ValueError(
                    "split tree attention does not support padded batches: use attention=\"sdpa\" or unpadded input"
                )
            _, _, allowed = spec.block(prefix_len, window, query.device)
            out = split_tree_attention(
                query, key[:, :, :prefix_len], value[:, :, :prefix_len], key[:, :, prefix_len:],
                value[:, :, prefix_len:], spec.visibility, spec.depths, scale=scale, window=window,
                max_depth=spec.depth_bound, prefix_kernel=prefix_kernel, block_kernel=block_kernel,
                block_allowed=allowed, softcap=softcap,
            )
        return out.transpose(1, 2).contiguous(), None

    return attention


IMPLEMENTATIONS = {
    "split": ("ddtree_split", torch_prefix_kernel(), None, False),
    "fused": ("ddtree_fused", fused_prefix_kernel, fused_block_kernel, False),
    "flash_attn": ("ddtree_fa", flash_attn_prefix_kernel, fused_block_kernel, True),
}
"""backend name -> (transformers attention name, prefix kernel, block kernel, flash-attn for causal calls)."""


def _no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """Mask builder for the split implementations: they build their own causal/window masks, so only padding passes."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask
    return None


def register_attention_implementations() -> None:
    """Register the split implementations with transformers (idempotent), so any HF causal LM can use them by name.

    Their mask builder is registered too: transformers versions differ in what
    they do for an attention name they have no mask builder for.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for impl, prefix_kernel, block_kernel, use_fa in IMPLEMENTATIONS.values():
        AttentionInterface.register(impl, _make_attention_function(prefix_kernel, block_kernel, use_fa))
        AttentionMaskInterface.register(impl, _no_mask)
