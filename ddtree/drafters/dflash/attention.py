"""The drafter block's attention over ``[context ; block]`` keys, with each layer's causality, window and sinks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ddtree.targets.kernels import flash_attn_available


def visible_keys(q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool,
                 window: int | None) -> torch.Tensor | None:
    """Bool ``[..., Q, K]``: which keys a block slot sees (None: all of them).

    The authors' rule: causal means ``k <= p``; a window ``w`` means ``p - k < w``, and when not causal also
    ``k - p < w``. It applies to context and block keys alike.
    """
    if not causal and window is None:
        return None
    dist = q_positions[..., :, None] - k_positions[..., None, :]
    ok = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    if window is not None:
        ok = ok & (dist < window) if causal else ok & (dist.abs() < window)
    return ok


def flash_window(causal: bool, window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size`` for the rule, under its bottom-right alignment (block = the last keys)."""
    if window is None:
        return (-1, -1)
    return (window - 1, 0) if causal else (window - 1, window - 1)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    causal: bool = False,
    q_offset: int | None = None,
    additive_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of a drafter block over ``[context ; block]`` keys, with one layer's rule.

    ``q``: ``[B, Hq, L, D]``; ``k``, ``v``: ``[B, Hkv, S, D]`` (GQA allowed). Key
    ``j`` is at position ``j`` and query ``i`` at ``q_offset + i`` (default
    ``S - L``: the block is the last ``L`` keys). ``causal`` and ``window``
    follow :func:`visible_keys`; under flash-attn's bottom-right alignment that is
    ``causal=True, window_size=(w - 1, 0)`` or ``causal=False, (w - 1, w - 1)``.
    ``additive_mask`` (broadcastable to ``[B, Hq, L, S]``) is added on top.
    ``sinks`` (``[Hq]``): one extra logit per head in the softmax denominator, carrying no value.
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
        additive_mask is None and sinks is None and q_offset == kv_len - q_len and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    )
    if backend == "flash_attn" and not flash_ok:
        raise ValueError("flash_attn block attention needs flash-attn, CUDA, fp16/bf16, no additive mask, no sinks, "
                         "and the block as the last keys")
    if flash_ok and backend != "sdpa":
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=causal, window_size=flash_window(causal, window))
        return out.transpose(1, 2)
    q_pos = q_offset + torch.arange(q_len, device=q.device)
    mask = visible_keys(q_pos, torch.arange(kv_len, device=q.device), causal, window)
    if additive_mask is not None:
        add = additive_mask.to(device=q.device, dtype=q.dtype)
        mask = add if mask is None else add.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        # A sink is a key whose logit is the head's sink value and whose value is zero.
        k = torch.cat([k, k.new_zeros(bsz, hkv, 1, d)], dim=2)
        v = torch.cat([v, v.new_zeros(bsz, hkv, 1, v.shape[-1])], dim=2)
        if mask is None:
            mask = q.new_zeros(1, 1, q_len, kv_len)
        elif mask.dtype == torch.bool:
            mask = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
        mask = mask.expand(bsz, hq, q_len, kv_len)
        sink = sinks.to(q.dtype).view(1, hq, 1, 1).expand(bsz, hq, q_len, 1)
        mask = torch.cat([mask, sink], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
