"""The DFlash2 drafter's layers and checkpoint model: DFlash layers wrapped in grouped dynamic causal
convolutions over the block, and a candidate selector that ranks each slot's top tokens given the token
before it.

Per layer (``u`` the normed input, the same ``u`` making both kernels of a convolution)::

    x = x + conv_post(o_proj(attn(conv_pre(u))))        u = input_layernorm(x)
    x = x + conv_post(mlp(conv_pre(u)))                 u = post_attention_layernorm(x)

A convolution runs over block slots only (the root first, zero left padding, so slot ``t`` reads slots
``t-K+1 .. t``); the context is never convolved. Key names and shapes are the published ones; the two
selector codebooks are stored without a ``.weight`` suffix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.core.pairwise import PairwiseScores
from ddtree.drafters.dflash.checkpoint import (
    check_finite,
    check_header_shapes,
    header_shapes,
    read_weights,
    weight_files,
)
from ddtree.drafters.dflash.model import DFlashAttention, DFlashMLP, LayerKV, RMSNorm, RotaryEmbedding, apply_rope
from ddtree.drafters.dflash2.config import DFlash2Config

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


class GroupedDynamicConv(nn.Module):
    """``y[t, c] = sum_o (base[o, c] + dyn[t, o, c // group]) * x[t - o, c]``, ``x[<0] = 0``.

    ``base_kernel`` ``[2, K, H]`` holds the pre (0) and post (1) kernels; ``kernel_projection`` maps the
    normed layer input to both dynamic kernels, ``[2, K, G]`` per slot (indexed by the output slot).
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def kernels(self, u: torch.Tensor) -> torch.Tensor:
        """Dynamic kernels ``[B, T, 2, K, G]`` from the normed input ``u``."""
        return self.kernel_projection(u).view(*u.shape[:-1], 2, self.kernel_size, -1)

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, which: int) -> torch.Tensor:
        t = x.shape[1]
        dyn = dynamic[:, :, which].repeat_interleave(self.group_size, dim=-1)  # [B, T, K, H]
        weight = self.base_kernel[which].to(x.dtype) + dyn  # [B, T, K, H]
        out = weight[:, :, 0] * x
        for o in range(1, min(self.kernel_size, t)):  # a few taps, each over the whole block
            out[:, o:] += weight[:, o:, o] * x[:, :-o]
        return out


class DFlash2Attention(nn.Module):
    """The DFlash attention (published key names): block queries over ``[context ; block]`` keys."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    project_kv = DFlashAttention.project_kv  # the same projections and names as a DFlash layer's

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: LayerKV,
                visible: torch.Tensor | None) -> torch.Tensor:
        bsz, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)  # type: ignore[misc]  # borrowed from DFlashAttention
        k = torch.cat([context_kv[0], k_blk], dim=2)
        v = torch.cat([context_kv[1], v_blk], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.head_dim**-0.5,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlash2Layer(nn.Module):
    def __init__(self, config: DFlash2Config):
        super().__init__()
        h = config.hidden_size
        self.self_attn = DFlash2Attention(config)
        self.mlp = DFlashMLP(config.base)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.attention_conv = GroupedDynamicConv(h, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(h, config.conv_kernel_size, config.conv_group_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: LayerKV,
                visible: torch.Tensor | None) -> torch.Tensor:
        u = self.input_layernorm(x)
        dyn = self.attention_conv.kernels(u)
        a = self.self_attn(self.attention_conv.convolve(u, dyn, 0), cos, sin, context_kv, visible)
        x = x + self.attention_conv.convolve(a, dyn, 1)
        u = self.post_attention_layernorm(x)
        dyn = self.mlp_conv.kernels(u)
        return x + self.mlp_conv.convolve(self.mlp(self.mlp_conv.convolve(u, dyn, 0)), dyn, 1)


class CandidateSelector(nn.Module):
    """``score[p, k] = logit[p, cand_k] + <pred[prev] * proj(h[p]), succ[cand_k]>`` over each slot's top-k."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)

    def scores(self, hidden: torch.Tensor, logits: torch.Tensor,
               roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw selector scores for every (previous candidate, candidate) pair, in one batched op.

        ``hidden`` ``[B, D, H]`` and ``logits`` ``[B, D, V]`` of slots ``1 .. D``; ``roots`` ``[B]``.
        Returns ``candidates`` ``[B, D, K]`` (ascending ids), ``first`` ``[B, K]`` (slot 1 given the root)
        and ``table`` ``[B, D-1, K, K]`` (slot ``d+2``'s candidate ``j`` given slot ``d+1``'s candidate ``i``).
        """
        unary, cand = logits.topk(self.top_k, dim=-1)
        cand, order = cand.sort(dim=-1)
        unary = unary.gather(-1, order)
        proj = self.hidden_projection(hidden)  # [B, D, r]
        succ = self.successor_codebook(cand)  # [B, D, K, r]
        pred_root = self.predecessor_codebook(roots.view(-1))  # [B, r]
        first = unary[:, 0] + torch.einsum("br,bkr->bk", pred_root * proj[:, 0], succ[:, 0])
        pred = self.predecessor_codebook(cand[:, :-1])  # [B, D-1, K, r]
        table = unary[:, 1:, None, :] + torch.einsum("bdir,bdr,bdjr->bdij", pred, proj[:, 1:], succ[:, 1:])
        return cand, first, table

    def pairwise(self, hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor) -> PairwiseScores:
        """The selector's log-probs (softmax over each slot's candidates), float32."""
        cand, first, table = self.scores(hidden, logits, roots)
        return PairwiseScores(cand, first.float().log_softmax(-1), table.float().log_softmax(-1))


def visible_keys(config: DFlash2Config, block_positions: torch.Tensor, context_len: int,
                 lengths: torch.Tensor | None = None) -> list[torch.Tensor | None]:
    """Per layer, the boolean ``[B, 1, Q, C + Q]`` mask of keys each block slot sees (``None``: all).

    Context column ``c`` holds position ``c``; the block sits at ``block_positions``. Causal layers see
    keys at positions ``<= p``; a window ``w`` keeps ``p - k < w`` (and ``k - p < w`` when non-causal);
    columns past a row's ``lengths`` are padding.
    """
    device = block_positions.device
    col = torch.arange(context_len, device=device).expand(block_positions.shape[0], -1)
    keys = torch.cat([col, block_positions], dim=1)  # [B, C + Q]
    valid = None
    if lengths is not None:
        valid = torch.cat([col < lengths[:, None], torch.ones_like(block_positions, dtype=torch.bool)], dim=1)
    dist = block_positions[:, :, None] - keys[:, None, :]  # query minus key position
    masks, cache = [], {}
    for causal, window in zip(config.layer_causal, config.layer_window):
        if (causal, window) not in cache:
            vis = None if valid is None else valid[:, None, :].expand_as(dist)
            if causal:
                vis = (dist >= 0) if vis is None else vis & (dist >= 0)
            if window is not None:
                near = (dist < window) & (causal | (-dist < window))
                vis = near if vis is None else vis & near
            cache[(causal, window)] = None if vis is None else vis[:, None]
        masks.append(cache[(causal, window)])
    return masks


class DFlash2DraftModel(nn.Module):
    """DFlash2 drafter weights with the published key names."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlash2Layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config)
        self.rotary = RotaryEmbedding(config.base)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(f"context features have width {features.shape[-1]}, the DFlash2 drafter expects "
                             f"{self.fc.in_features} ({len(self.config.target_layer_ids)} target layers x hidden "
                             f"{self.config.hidden_size})")
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        cos, sin = self.rotary(positions, context.dtype)
        layers = cast("Sequence[DFlash2Layer]", self.layers)  # a ModuleList yields plain modules to the checker
        # project_kv is DFlashAttention's, borrowed: DFlash2Attention has the same projections under the same names
        return [layer.self_attn.project_kv(context, cos, sin) for layer in layers]  # type: ignore[misc]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, context_kv: Sequence[LayerKV],
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[B, Q, H]`` of the block (``block_embeds`` already scaled).

        ``context_kv``: per-layer keys/values of the context, column ``c`` at position ``c``;
        ``lengths`` (optional): each row's context length when rows are ragged.
        """
        x = block_embeds.to(self.fc.weight.dtype)
        masks = visible_keys(self.config, block_positions, context_kv[0][0].shape[2], lengths)
        cos, sin = self.rotary(block_positions, x.dtype)
        for layer, kv, mask in zip(self.layers, context_kv, masks):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """``lm_head(hidden) * output_multiplier``, then the softcap when the config sets one."""
        cfg = self.config
        logits = lm_head(hidden.to(cast(torch.Tensor, lm_head.weight).dtype)) * cfg.output_multiplier
        cap = cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None) -> DFlash2DraftModel:
        """Load a published DFlash2 directory (``config.json`` + ``*.safetensors``) as it is.

        Names and shapes are checked in the headers first (bare or ``.weight`` codebook names alike);
        every weight must be present, none may be extra, and none may hold NaN or inf.
        """
        path = Path(path)
        config = DFlash2Config.from_pretrained(path)
        files = weight_files(path)
        shapes = {_own_name(k): v for k, v in header_shapes(files).items()}
        with torch.device("meta"):
            own = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
        check_header_shapes(shapes, own, path, kind="DFlash2 drafter")
        state = {_own_name(k): v for k, v in read_weights(files).items()}
        check_finite(state, kind="DFlash2 drafter")
        file_dtype = next(iter(state.values())).dtype
        model = cls(config).to(file_dtype)  # load into the file's dtype: a float32 shell would round the weights
        model.load_state_dict(state)
        model.to(dtype=dtype or file_dtype)
        if device is not None:
            model.to(device)
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write the published form: ``config.json`` and ``model.safetensors`` with bare codebook names."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k:
                 v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        cfg = self.config.to_dict()
        cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _own_name(key: str) -> str:
    key = key.removeprefix("model.")
    return key + ".weight" if key in CODEBOOKS else key
