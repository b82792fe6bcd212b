"""The DFlash block-diffusion drafter's layers and checkpoint model.

A DFlash drafter reads target hidden states (the *context features*) and, in one
forward pass over a block ``[root, mask, ..., mask]``, predicts a distribution
for each of the ``block_size - 1`` masked slots. It has no embedding and no
lm_head of its own: it borrows the target's.

:class:`DFlashDraftModel` is the checkpoint (published key names, loads a
published directory as it is). :class:`DFlashDrafter` binds it to a target;
each generation gets its own :class:`DFlashContext`, the per-layer KV cache of
the *context* only (block entries are never cached, so nothing is cropped).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.drafters.dflash.attention import block_attention
from ddtree.drafters.dflash.checkpoint import (
    DRAFT_VOCAB_FILE,
    header_shapes,
    load_draft_vocab,
    read_weights,
    save_draft_vocab,
    weight_files,
)
from ddtree.drafters.dflash.config import FULL, SLIDING, DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions, any RoPE type transformers knows."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_cfg = Qwen3Config(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters),
        )
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(config.rope_parameters["rope_theta"])
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](rope_cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 tables whatever the model dtype, as HF computes them (module.to() casts the buffer).
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device, torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[B, heads, T, d]``; ``cos``/``sin`` are ``[B, T, d]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[B, 1, Q, K]`` mask: a slot at ``p`` sees keys at ``p-w+1 .. p+w-1`` (flash ``(w-1, w-1)``)."""
    dist = (q_positions[:, :, None] - k_positions[:, None, :]).abs()
    mask = torch.zeros(dist.shape, dtype=dtype, device=dist.device)
    return mask.masked_fill_(dist >= window, torch.finfo(dtype).min)[:, None]


def _contiguous(context_positions, block_positions, context_len: int) -> bool:
    """True when keys sit at ``0 .. C+Q-1`` with the block last (positions omitted count as such)."""
    q_len = block_positions.shape[1]
    want_blk = torch.arange(context_len, context_len + q_len, device=block_positions.device)
    if not bool((block_positions == want_blk).all()):
        return False
    if context_positions is None:
        return True
    want_ctx = torch.arange(context_len, device=context_positions.device)
    return context_positions.shape[1] == context_len and bool((context_positions == want_ctx).all())


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.scaling = d**-0.5

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values ``[B, kv_heads, T, d]`` for hidden states ``x``."""
        bsz, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, context_kv, mask, window=None):
        bsz, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        k_ctx, v_ctx = context_kv
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        out = block_attention(q, k, v, window=window, additive_mask=mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, context_kv, mask, window=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, mask, window)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash drafter weights with the published key names (``layers.*``, ``fc``, ``hidden_norm``, ``norm``)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config, t) for t in config.layer_types)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        # Optional ranked token ids the drafter may propose (a sidecar file, outside the published weights).
        self.draft_vocab: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: raw concatenated target features to drafter width."""
        expected = self.fc.in_features
        if features.shape[-1] != expected:
            raise ValueError(
                f"context features have width {features.shape[-1]}, the drafter expects {expected} "
                f"({len(self.config.target_layer_ids)} target layers x hidden {self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer keys/values of projected context features at their own token positions."""
        cos, sin = self.rotary(positions, context.dtype)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def layer_masks(self, block_positions, key_positions, dtype) -> dict[str, torch.Tensor | None]:
        """Default masks: full layers see every key; sliding layers get the DFlash window."""
        masks: dict[str, torch.Tensor | None] = {FULL: None, SLIDING: None}
        if SLIDING in self.config.layer_types:
            masks[SLIDING] = window_mask(block_positions, key_positions, self.config.sliding_window, dtype)
        return masks

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        attention_masks: dict[str, torch.Tensor | None] | None = None,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[B, Q, H]`` of the block.

        Give either projected ``context`` with ``context_positions`` or precomputed
        per-layer ``context_kv`` (whose keys then sit at ``0 .. C-1``).
        ``attention_masks`` maps layer type to an additive ``[B, 1, Q, C + Q]`` mask
        over ``[context ; block]``. Without one, full layers see every key and
        sliding layers get the DFlash window ``|p - k| < sliding_window``.
        """
        x = block_embeds.to(self.fc.weight.dtype)
        if context_kv is None:
            if context is None or context_positions is None:
                raise ValueError("give context with context_positions, or context_kv")
            context_kv = self.context_kv(context.to(x.dtype), context_positions)
        masks = dict(attention_masks or {})
        window = None
        if SLIDING in self.config.layer_types and masks.get(SLIDING) is None:
            if _contiguous(context_positions, block_positions, context_kv[0][0].shape[2]):
                window = self.config.sliding_window  # the kernel applies it (flash-attn where available)
            else:
                key_positions = torch.cat([context_positions, block_positions], dim=1)
                masks[SLIDING] = self.layer_masks(block_positions, key_positions, x.dtype)[SLIDING]
        cos, sin = self.rotary(block_positions, x.dtype)
        for layer, kv in zip(self.layers, context_kv):
            sliding = layer.layer_type == SLIDING
            x = layer(x, cos, sin, kv, masks.get(layer.layer_type), window if sliding else None)
        return self.norm(x)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
    ) -> "DFlashDraftModel":
        """Load a published DFlash directory (``config.json`` + ``model.safetensors``) as it is.

        Everything is checked before the weights are read: the config's sizes, then the tensor names and
        shapes in the safetensors headers against those the config implies. Pickled checkpoints
        (``pytorch_model.bin``) are refused, never unpickled. Non-finite weights are refused after reading.
        """
        path = Path(path)
        config = DFlashConfig.from_pretrained(path)
        files = weight_files(path)
        shapes = header_shapes(files)
        shapes = {k.removeprefix("model."): v for k, v in shapes.items()}
        with torch.device("meta"):
            own = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
        missing = sorted(set(own) - set(shapes))
        unexpected = sorted(set(shapes) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"drafter weights in {path} do not match its config: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        for k, shape in shapes.items():
            if shape != own[k]:
                raise ValueError(f"drafter weight {k} has shape {shape}, config implies {own[k]}: config.json and "
                                 "the weights belong to different drafters; re-download the directory")
        state = read_weights(files)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        for k, v in state.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise ValueError(f"drafter weight {k} holds {bad} NaN or inf values: the checkpoint is damaged "
                                 "(or was saved from a diverged run); re-download or retrain it")
        model = cls(config)
        model.load_state_dict(state)
        if (path / DRAFT_VOCAB_FILE).exists():
            model.draft_vocab = load_draft_vocab(path, config.vocab_size)
        file_dtype = next(iter(state.values())).dtype
        model.to(dtype=dtype or file_dtype)
        if device is not None:
            model.to(device)
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        if self.draft_vocab is not None:
            save_draft_vocab(path, self.draft_vocab)
