"""Attention kernels of the target side: pure tensor math, no model and no transformers.

The prefix and block kernels that :func:`ddtree.targets.split_attention.split_tree_attention` merges
(PyTorch's fused kernels, the flash-attn package), and the causal attention a registered implementation
runs when no tree is passed (prefill and plain decode).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from ddtree.targets.split_attention import (
    attention_with_lse,
    compute_dtype,
    fold_gqa,
    merge_attention,
    unfold_gqa,
)

_MASK_CHUNK_ELEMENTS = 1 << 24  # causal masks are built in query chunks of at most this many entries


@functools.cache
def flash_attn_available() -> bool:
    """True when the flash-attn package imports (it only ever runs on CUDA); a broken install counts as absent."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: F401
    except Exception:
        return False
    return True


def fused_prefix_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's own fused kernels with LSE: flash on CPU; flash (half types) or memory-efficient on CUDA.

    GQA is handled by folding query heads into rows, so keys are never repeated.
    """
    hq, hkv = q.shape[1], k.shape[1]
    qf = fold_gqa(q, hkv).contiguous()
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, k, v, 0.0, False, scale=scale)
    elif q.device.type == "cuda":
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        d = q.shape[-1]
        if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qf, k, v, 0.0, False, False, scale=scale)
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(qf, k, v, None, True, 0.0, False, scale=scale)
        out, lse = res[0], res[1][..., : qf.shape[2]]  # the efficient kernel pads its LSE rows
    else:
        raise RuntimeError(f"the fused prefix kernel runs on CPU or CUDA, not {q.device.type}")
    return unfold_gqa(out, hq), unfold_gqa(lse, hq)


def fused_block_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked tree block: PyTorch's CPU flash kernel takes a mask and returns the LSE; elsewhere plain torch.

    (On CUDA the block is small next to the prefix, and the fused CUDA kernels
    that take a mask have alignment rules; plain torch is exact and cheap there.)
    """
    if q.device.type != "cpu":
        return attention_with_lse(q, k, v, scale, allowed)
    hq, hkv = q.shape[1], k.shape[1]
    cdt = compute_dtype(q.dtype)  # the block is small: keep it in float32 so bf16 rounds only once, at the end
    additive = torch.zeros(allowed.shape, dtype=cdt).masked_fill_(~allowed, float("-inf"))
    additive = additive[:, None].repeat(1, 1, hq // hkv, 1)  # folded rows are group-major: row = g * N + n
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        fold_gqa(q.to(cdt), hkv).contiguous(), k.to(cdt), v.to(cdt), 0.0, False, attn_mask=additive, scale=scale
    )
    return unfold_gqa(out, hq), unfold_gqa(lse, hq)


def flash_attn_prefix_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's kv-cache kernel with ``return_softmax_lse``; float32 inputs go to the fused kernel."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return fused_prefix_kernel(q, k, v, scale)
    from flash_attn import flash_attn_with_kvcache

    out, lse = flash_attn_with_kvcache(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=scale, causal=False, return_softmax_lse=True,
    )
    return out.transpose(1, 2), lse


def key_padding_mask(
    attention_mask: torch.Tensor | None, batch: int, kv_len: int, device: torch.device | str
) -> torch.Tensor | None:
    """Bool ``[B, S]`` of real keys from a 2D HF padding mask, or None when nothing is padded."""
    if attention_mask is None:
        return None
    keep = attention_mask.to(device=device).bool()
    if keep.shape != (batch, kv_len):
        raise ValueError(f"2D attention mask must be [batch, kv_len] = [{batch}, {kv_len}], got {tuple(keep.shape)}")
    return None if bool(keep.all()) else keep


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    key_padding: torch.Tensor | None = None,
    use_flash_attn: bool = False,
    dropout: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention with the queries as the last ``L`` of ``S`` keys (HF cache alignment).

    Query ``i`` sits at position ``S - L + i`` and sees keys ``j <= S - L + i``,
    and with a window only ``j > S - L + i - window``, the rule of HF sliding
    layers. Logit soft-capping (Gemma 2) runs in plain torch. Returns ``[B, Hq, L, D]``.
    """
    bsz, hq, q_len, _ = q.shape
    kv_len, hkv = k.shape[2], k.shape[1]
    gqa = hq != hkv
    if window is not None and window >= kv_len:
        window = None  # no key is ever that far away
    if (
        use_flash_attn and key_padding is None and softcap is None and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
    ):
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout, softmax_scale=scale,
            causal=True, window_size=(window - 1, 0) if window is not None else (-1, -1),
        )
        return out.transpose(1, 2)
    if window is None and key_padding is None and softcap is None and (q_len == 1 or q_len == kv_len):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=q_len > 1, scale=scale, enable_gqa=gqa
        )
    if window is None and key_padding is None and softcap is None and not dropout and q.device.type == "cpu":
        return cached_chunk_attention(q, k, v, scale)
    offset = kv_len - q_len
    rows = max(1, _MASK_CHUNK_ELEMENTS // max(kv_len, 1))
    key_pos = torch.arange(kv_len, device=q.device)
    outs = []
    for start in range(0, q_len, rows):
        q_pos = offset + torch.arange(start, min(q_len, start + rows), device=q.device)
        dist = q_pos[:, None] - key_pos[None, :]
        allowed = dist >= 0
        if window is not None:
            allowed &= dist < window
        allowed = allowed.expand(bsz, -1, -1)
        if key_padding is not None:
            # A padded query still sees itself, so no row is empty (an empty row would give NaN).
            allowed = (allowed & key_padding[:, None, :]) | (dist == 0)
        q_rows = q[:, :, start : start + rows]
        if softcap is not None:
            outs.append(attention_with_lse(q_rows, k, v, scale, allowed, softcap)[0].to(q.dtype))
            continue
        outs.append(
            F.scaled_dot_product_attention(
                q_rows, k, v, attn_mask=allowed[:, None], dropout_p=dropout, scale=scale, enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)


def cached_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of an ``L``-query prefill chunk over ``S > L`` keys, the chunk's own last, on a CPU.

    The cached ``S - L`` keys are seen by every query (no mask) and the chunk's keys causally (a square, so
    the kernel's own causal flag is the right alignment); PyTorch's CPU flash kernel attends each with its
    LSE and the two merge exactly. No ``[L, S]`` mask is built: a 4096-token chunk after 12k cached tokens
    would otherwise carry a 200 MB float mask, and the masked kernel visits every masked block.
    """
    hq, hkv, q_len = q.shape[1], k.shape[1], q.shape[2]
    cached = k.shape[2] - q_len
    o1, l1 = fused_prefix_kernel(q, k[:, :, :cached], v[:, :, :cached], scale)
    group = hq // hkv
    o2, l2 = torch.empty_like(o1), torch.empty_like(l1)
    kb, vb = k[:, :, cached:], v[:, :, cached:]
    for g in range(group):  # query heads g, g + G, ... read key heads 0, 1, ...: no key is repeated
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, g::group].contiguous(), kb, vb, 0.0, True, scale=scale)
        o2[:, g::group], l2[:, g::group] = out, lse
    return merge_attention(o1, l1, o2, l2, inplace=True)[0].to(q.dtype)
