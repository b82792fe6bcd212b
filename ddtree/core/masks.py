"""Tree attention masks and position ids for the verify pass.

The target sees ``[committed prefix | tree]`` in one forward. Every tree node
sees the whole prefix, its ancestors and itself. Masks are *additive float*
(0 visible, dtype-min hidden) because a bool 4D mask is silently wrong in
transformers' eager attention.
"""

from __future__ import annotations

import torch


def tree_position_ids(depths: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
    """Position ids ``start + depth`` for each tree node; ``depths`` is ``[B, N]``."""
    if isinstance(start, torch.Tensor):
        start = start.to(depths.device).view(-1, 1)
    return depths + start


def tree_attention_mask(
    visibility: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    depths: torch.Tensor | None = None,
    prefix_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask ``[B, 1, N, prefix_len + N]`` over ``[prefix | tree]``.

    ``visibility[b, i, j]`` is True when node ``j`` is an ancestor of ``i`` or
    ``i`` itself. With ``sliding_window`` (and ``depths``) a node at position
    ``p`` sees only keys at positions ``> p - sliding_window``, the causal
    window rule of HF sliding layers. ``prefix_valid`` ``[B, prefix_len]`` hides
    padding columns of a batch; a row's real columns must be its last ones
    (right-aligned), so column distance is position distance and the window
    rule holds as it is.
    """
    if visibility.dim() != 3 or visibility.shape[-1] != visibility.shape[-2]:
        raise ValueError(f"visibility must be [B, N, N], got {tuple(visibility.shape)}")
    bsz, n, _ = visibility.shape
    device = visibility.device
    allowed = torch.cat(
        [torch.ones(bsz, n, prefix_len, dtype=torch.bool, device=device), visibility.bool()], dim=-1
    )
    if prefix_valid is not None:
        if prefix_valid.shape != (bsz, prefix_len):
            raise ValueError(f"prefix_valid must be [{bsz}, {prefix_len}], got {tuple(prefix_valid.shape)}")
        allowed[:, :, :prefix_len] &= prefix_valid.to(device)[:, None, :]
    if sliding_window is not None:
        if depths is None:
            raise ValueError("a sliding-window mask needs the node depths")
        q_pos = prefix_len + depths  # [B, N]
        k_pos = torch.cat(
            [torch.arange(prefix_len, device=device).expand(bsz, prefix_len), prefix_len + depths], dim=-1
        )
        allowed &= (q_pos[:, :, None] - k_pos[:, None, :]) < sliding_window
    mask = torch.zeros(bsz, 1, n, prefix_len + n, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
