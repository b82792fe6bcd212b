"""Exact tree attention without a dense ``[prefix | tree]`` mask.

A tree node sees the whole committed prefix (or, on a sliding layer, the part
of it inside the window), its ancestors and itself. The prefix needs no mask,
so a fused kernel can attend to it and return the log-sum-exp (LSE); the small
tree block is attended with its dense ancestor mask, and the two partial
softmaxes are merged exactly with their LSE weights.

Shapes follow HF attention: ``q`` is ``[B, Hq, N, D]``, keys and values are
``[B, Hkv, S, D]`` with ``Hq`` a multiple of ``Hkv`` (GQA). Keys are never
repeated per query head: the ``G = Hq // Hkv`` query heads of a group are folded
into the query axis instead, which is exact because prefix rows are unmasked.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# (q [B,Hq,N,D], k [B,Hkv,S,D], v, scale) -> (out [B,Hq,N,D] float32-or-wider, lse [B,Hq,N] float32-or-wider)
PrefixKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
# (q, k, v, scale, allowed [B,N,S] bool) -> (out, lse): the masked tree block
BlockKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32 so bf16 scores are not rounded."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, N, D] -> [B, Hkv, G*N, D]``: query heads sharing a KV head become extra query rows."""
    bsz, hq, n, d = q.shape
    return q.reshape(bsz, num_kv_heads, (hq // num_kv_heads) * n, d)


def unfold_gqa(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Inverse of :func:`fold_gqa` for ``[B, Hkv, G*N, ...]`` outputs and LSEs."""
    bsz, hkv, gn = x.shape[:3]
    n = gn * hkv // num_q_heads
    return x.reshape(bsz, num_q_heads, n, *x.shape[3:])


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch softmax attention returning ``(out, lse)`` in the compute dtype.

    ``allowed`` is a bool ``[B or 1, N, S]`` mask shared by all heads. A row with
    no visible key gets ``out = 0`` and ``lse = -inf`` so that it merges as empty.
    """
    bsz, hq, n, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    cdt = compute_dtype(q.dtype)
    scores = torch.matmul(fold_gqa(q.to(cdt), hkv), k.to(cdt).transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(bsz, hkv, hq // hkv, n, s)
    if allowed is not None:
        scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = scores.sub_(safe[..., None]).exp_().view(bsz, hkv, (hq // hkv) * n, s)
    out = unfold_gqa(torch.matmul(probs, v.to(cdt)), hq)
    return out, lse.reshape(bsz, hq, n)


def merge_attention(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax over the union of two disjoint key sets from the two partial results.

    ``o`` is ``[..., N, D]`` and ``lse`` is ``[..., N]`` (natural log). Empty sides
    (``lse = -inf``) get weight 0; if both are empty the row stays 0 with ``-inf``.
    ``inplace``: ``o1`` and ``o2`` may be overwritten (a prompt-long chunk's outputs then need no third
    copy); the result is the same to the bit.
    """
    cdt = torch.promote_types(compute_dtype(o1.dtype), compute_dtype(o2.dtype))
    lse1, lse2 = lse1.to(cdt), lse2.to(cdt)
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1 = torch.exp(lse1 - safe)[..., None]
    w2 = torch.exp(lse2 - safe)[..., None]
    if inplace:
        return o1.to(cdt).mul_(w1).add_(o2.to(cdt).mul_(w2)), lse
    return o1.to(cdt) * w1 + o2.to(cdt) * w2, lse


def torch_prefix_kernel(chunk: int = 4096) -> PrefixKernel:
    """Unmasked attention in plain torch, over key chunks merged by LSE so memory stays ``O(N * chunk)``."""

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attention_with_lse(q, k[:, :, :chunk], v[:, :, :chunk], scale)
        for start in range(chunk, k.shape[2], chunk):
            o2, l2 = attention_with_lse(q, k[:, :, start : start + chunk], v[:, :, start : start + chunk], scale)
            out, lse = merge_attention(out, lse, o2, l2)
        return out, lse

    return kernel


def _check_shapes(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_tree: torch.Tensor,
                  v_tree: torch.Tensor, visibility: torch.Tensor) -> None:
    bsz, hq, n, d = q.shape
    hkv = k_tree.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if k_tree.shape[:3] != (bsz, hkv, n) or v_tree.shape[:3] != (bsz, hkv, n):
        raise ValueError(f"tree keys/values must be [B, Hkv, N, *] = [{bsz}, {hkv}, {n}, *]")
    if k_prefix.shape[:2] != (bsz, hkv) or v_prefix.shape[:3] != k_prefix.shape[:3]:
        raise ValueError("prefix keys/values must be [B, Hkv, P, *] with the tree's batch and heads")
    if visibility.shape[-2:] != (n, n):
        raise ValueError(f"visibility must be [B, {n}, {n}], got {tuple(visibility.shape)}")


def window_split(prefix_len: int, max_depth: int, window: int | None) -> tuple[int, int]:
    """``(band_start, common_start)`` of the prefix under a sliding window.

    A node at depth ``d`` (position ``prefix_len + d``) sees prefix index ``j``
    iff ``j >= prefix_len + d - window + 1``. Keys from ``common_start`` on are seen
    by every node, so they go to the unmasked kernel; the ragged band
    ``[band_start, common_start)`` (at most ``max_depth`` keys) joins the dense block.
    ``max_depth`` may be any upper bound on the deepest node's depth (such as
    ``num_nodes - 1``, known without a device read): the split stays exact, a larger
    bound only moves more prefix keys into the band.
    """
    if window is None:
        return 0, 0
    if window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    band_start = max(0, prefix_len - window + 1)
    common_start = min(prefix_len, max(0, prefix_len - window + 1 + max_depth))
    return band_start, common_start


def tree_block_allowed(
    visibility: torch.Tensor,
    depths: torch.Tensor | None,
    prefix_len: int,
    band_start: int,
    common_start: int,
    window: int | None,
) -> torch.Tensor:
    """Bool ``[B, N, band + N]``: which of ``[prefix band | tree]`` each node sees."""
    allowed = visibility.bool()
    if window is None:
        return allowed
    if depths is None:
        raise ValueError("a sliding window needs the node depths")
    depths = depths.to(visibility.device)
    allowed = allowed & ((depths[:, :, None] - depths[:, None, :]) < window)
    if common_start > band_start:
        band_pos = torch.arange(band_start, common_start, device=visibility.device)
        q_pos = prefix_len + depths
        band = (q_pos[:, :, None] - band_pos[None, None, :]) < window
        allowed = torch.cat([band, allowed], dim=-1)
    return allowed


def split_tree_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    visibility: torch.Tensor,
    depths: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window: int | None = None,
    max_depth: int | None = None,
    prefix_kernel: PrefixKernel | None = None,
    block_kernel: BlockKernel | None = None,
    block_allowed: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree-verify attention, exactly equal to dense attention under :func:`ddtree.core.masks.tree_attention_mask`.

    ``q``: ``[B, Hq, N, D]`` for the N tree nodes (root first); ``k/v_prefix``:
    ``[B, Hkv, P, D]`` committed prefix at positions ``0..P-1``; ``k/v_tree``:
    ``[B, Hkv, N, D]``; ``visibility``: bool ``[B, N, N]`` ancestor-or-self.
    ``window``: sliding window of the layer (node at position ``P + depth``
    sees keys at positions ``> P + depth - window``); it needs ``depths``.
    ``max_depth`` (an upper bound on the node depths suffices) and ``block_allowed``
    (from :func:`tree_block_allowed`) may be passed in to avoid a device sync and a
    rebuild per layer. ``prefix_kernel``
    and ``block_kernel`` default to plain torch (:func:`attention_with_lse`). Returns
    ``[B, Hq, N, D]`` in ``q.dtype``.
    """
    _check_shapes(q, k_prefix, v_prefix, k_tree, v_tree, visibility)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    prefix_len = k_prefix.shape[2]
    if window is not None and max_depth is None:
        if depths is None:
            raise ValueError("a sliding window needs the node depths")
        max_depth = int(depths.max())
    band_start, common_start = window_split(prefix_len, max_depth or 0, window)
    if block_allowed is None:
        block_allowed = tree_block_allowed(visibility, depths, prefix_len, band_start, common_start, window)
    k_block, v_block = k_tree, v_tree
    if common_start > band_start:
        k_block = torch.cat([k_prefix[:, :, band_start:common_start], k_tree], dim=2)
        v_block = torch.cat([v_prefix[:, :, band_start:common_start], v_tree], dim=2)
    if softcap is not None or block_kernel is None:
        out, lse = attention_with_lse(q, k_block, v_block, scale, block_allowed, softcap)
    else:
        out, lse = block_kernel(q, k_block, v_block, scale, block_allowed)
    if common_start < prefix_len:
        k_common, v_common = k_prefix[:, :, common_start:], v_prefix[:, :, common_start:]
        if softcap is not None:  # fused kernels here take no softcap: stay exact in plain torch
            o1, l1 = attention_with_lse(q, k_common, v_common, scale, None, softcap)
        else:
            o1, l1 = (prefix_kernel or torch_prefix_kernel())(q, k_common, v_common, scale)
        out, lse = merge_attention(o1, l1, out, lse)
    return out.to(q.dtype)
