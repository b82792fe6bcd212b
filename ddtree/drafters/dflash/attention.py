"""The drafter block's attention over ``[context ; block]`` keys, with the DFlash window."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ddtree.target.attention import flash_attn_available


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    q_offset: int | None = None,
    additive_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Non-causal attention of a drafter block over ``[context ; block]`` keys, with the DFlash window.

    ``q``: ``[B, Hq, L, D]``; ``k``, ``v``: ``[B, Hkv, S, D]`` (GQA allowed). Key
    ``j`` is at position ``j`` and query ``i`` at ``q_offset + i`` (default
    ``S - L``: the block is the last ``L`` keys). With ``window`` a query at ``p``
    sees keys ``p - window + 1 .. p + window - 1``, which is flash-attn's
    ``window_size=(window - 1, window - 1)`` under its bottom-right alignment.
    ``additive_mask`` (broadcastable to ``[B, Hq, L, S]``) is added on top.
    ``backend``: ``"auto"`` (flash-attn when it applies), ``"flash_attn"`` or ``"sdpa"``.
    Returns ``[B, Hq, L, D]`` in ``q.dtype``.
    """
    bsz, hq, q_len, d = q.shape
    kv_len, hkv = k.shape[2], k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if q_offset is None:
        q_offset = kv_len - q_len
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if backend not in ("auto", "flash_attn", "sdpa"):
        raise ValueError(f"block_attention backend must be 'auto', 'flash_attn' or 'sdpa', got {backend!r}")
    flash_ok = (
        additive_mask is None and q_offset == kv_len - q_len and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    )
    if backend == "flash_attn" and not flash_ok:
        raise ValueError("flash_attn block attention needs flash-attn, CUDA, fp16/bf16, no additive mask, "
                         "and the block as the last keys")
    if flash_ok and backend != "sdpa":
        from flash_attn import flash_attn_func

        w = (window - 1, window - 1) if window is not None else (-1, -1)
        out = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=False, window_size=w
        )
        return out.transpose(1, 2)
    mask = None
    if window is not None:
        q_pos = q_offset + torch.arange(q_len, device=q.device)
        dist = q_pos[:, None] - torch.arange(kv_len, device=q.device)[None, :]
        mask = dist.abs() < window
    if additive_mask is not None:
        add = additive_mask.to(device=q.device, dtype=q.dtype)
        mask = add if mask is None else add.masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
