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
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.drafters.dflash.attention import block_attention, visible_keys
from ddtree.drafters.dflash.checkpoint import (
    check_finite,
    check_header_shapes,
    draft_vocab_file,
    header_shapes,
    load_draft_vocab,
    read_weights,
    refuse_pickled_sidecars,
    save_draft_vocab,
    weight_files,
)
from ddtree.drafters.dflash.config import DFlashConfig, LayerAttention

LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [B, Hkv, S, d] each


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

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        head_dim = config.head_dim
        assert head_dim is not None  # DFlashConfig.__post_init__ sets it
        rope_cfg = Qwen3Config(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters),
        )
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(config.rope_parameters["rope_theta"])
            dim = head_dim
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


def additive(visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool visibility mask as an additive one (0 / the dtype's min), with a head axis: ``[B, 1, Q, K]``."""
    if visible is None:
        return None
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask if mask.dim() == 4 else mask[:, None]


def _contiguous(context_positions: torch.Tensor | None, block_positions: torch.Tensor, context_len: int) -> bool:
    """True when keys sit at ``0 .. C+Q-1`` with the block last (positions omitted count as such)."""
    q_len = block_positions.shape[1]
    want_blk = torch.arange(context_len, context_len + q_len, device=block_positions.device)
    if not bool((block_positions == want_blk).all()):
        return False
    if context_positions is None:
        return True
    want_ctx = torch.arange(context_len, device=context_positions.device)
    return context_positions.shape[1] == context_len and bool((context_positions == want_ctx).all())


def warn_last_layer(config: DFlashConfig, where: str) -> None:
    """Warn when a drafter reads the target's last layer, whose feature differs between engines."""
    last = config.num_target_layers - 1
    if last in config.target_layer_ids:
        warnings.warn(
            f"drafter {where} reads target layer {last}, the target's last: Hugging Face's hidden_states[{last + 1}] "
            "(what ddtree and the trainer feed it) is taken after the target's final norm, vLLM's auxiliary hidden "
            "state for that layer before it, so this drafter drafts well here and poorly in vLLM. Drafters trained "
            f"on layer ids up to {config.num_target_layers - 3} (the published default) avoid it", stacklevel=3)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, spec: LayerAttention):
        super().__init__()
        self.spec = spec
        h, d = config.hidden_size, config.head_dim
        assert d is not None  # DFlashConfig.__post_init__ sets it
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.scaling = d**-0.5
        if spec.sinks:  # vLLM's per-head sink logits (dflash_config.attention_sink_bias)
            self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads))

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values ``[B, kv_heads, T, d]`` for hidden states ``x``."""
        bsz, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: LayerKV,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``mask``: the layer's additive mask, or None to let the kernel apply the layer's rule itself."""
        bsz, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        k_ctx, v_ctx = context_kv
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        # with a mask the mask carries the rule; without one the kernel applies it (block_attention's defaults
        # are no window, not causal)
        causal, window = (False, None) if mask is not None else (self.spec.causal, self.spec.window)
        out = block_attention(q, k, v, additive_mask=mask, scale=self.scaling,
                              sinks=getattr(self, "attention_sink_bias", None), causal=causal, window=window)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, spec: LayerAttention):
        super().__init__()
        self.layer_type = spec.type
        self.self_attn = DFlashAttention(config, spec)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: LayerKV,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash drafter weights with the published key names (``layers.*``, ``fc``, ``hidden_norm``, ``norm``)."""

    def __init__(self, config: DFlashConfig, mask_embedding: bool = False):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config, spec) for spec in config.resolve_attention())
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        if mask_embedding:  # a checkpoint's own embedding for mask_token_id (replaces the target's row)
            if config.input_embedding_scale != 1.0:
                raise ValueError("the drafter has both a mask_embedding tensor and input_embedding_scale "
                                 f"{config.input_embedding_scale}: whether the scale applies to that tensor is "
                                 "defined nowhere, so ddtree refuses it; drop one of them")
            self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        # Optional ranked token ids the drafter may propose (a sidecar file, outside the published weights).
        self.draft_vocab: torch.Tensor | None = None

    @property
    def decoder_layers(self) -> Sequence[DFlashLayer]:
        """``layers``, typed: a ``ModuleList`` yields plain modules to the type checker."""
        return cast("Sequence[DFlashLayer]", self.layers)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def attention_table(self) -> str:
        """The resolved per-layer attention (layer, type, causal, window, sinks), printable."""
        return self.config.attention_table()

    def embed_block(self, block: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """The block tokens' input: the target's raw embedding rows times ``input_embedding_scale`` (every slot,
        the root too), with the checkpoint's ``mask_embedding`` wherever a token is ``mask_token_id``."""
        x = embed(block)
        scale = self.config.input_embedding_scale
        target_scale = getattr(embed, "embed_scale", None)  # e.g. Gemma3's scaled embedding module
        if isinstance(target_scale, torch.Tensor) and target_scale.numel() == 1:
            # The authors look the rows up raw (F.embedding on the weight), bypassing the module's own scale;
            # undone here rather than bypassed, so the module's device / tensor-parallel hooks still run.
            scale = scale / float(target_scale)
        if scale != 1.0:
            x = x * scale
        mask_emb = getattr(self, "mask_embedding", None)
        if mask_emb is not None:
            x = torch.where(block.eq(cast(int, self.config.mask_token_id))[..., None], mask_emb.to(x), x)
        return x

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``output_multiplier``, then ``final_logit_softcapping`` (when > 0), as the drafter was trained."""
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = (logits / cap).tanh_().mul_(cap)  # one vocabulary-wide copy, not three
        return logits

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: raw concatenated target features to drafter width."""
        expected = self.fc.in_features
        if features.shape[-1] != expected:
            raise ValueError(
                f"context features have width {features.shape[-1]}, the drafter expects {expected} "
                f"({len(self.config.target_layer_ids)} target layers x hidden "
                f"{self.config.target_hidden_size or self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer keys/values of projected context features at their own token positions."""
        cos, sin = self.rotary(positions, context.dtype)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.decoder_layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        context_offsets: Sequence[int] | None = None,
        contiguous: bool | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[B, Q, H]`` of the block.

        Give either projected ``context`` with ``context_positions`` or precomputed
        per-layer ``context_kv``, whose keys sit at ``offset .. offset + C_i - 1``
        (``context_offsets[i]``, default 0: a sliding layer's context may start
        later, see :class:`DFlashContext`). ``key_mask`` (bool, or additive,
        broadcastable to ``[B, 1, Q, C + Q]`` over positions ``0 ..``) hides keys from
        every layer (padding, other blocks); each layer adds its own rule
        (:meth:`DFlashConfig.resolve_attention`) by key position on top. ``contiguous``: whether keys sit at
        ``0 .. C+Q-1`` with the block last, when the caller knows (else compared on the device and read back).
        """
        x = block_embeds.to(self.fc.weight.dtype)
        if context_kv is None:
            if context is None or context_positions is None:
                raise ValueError("give context with context_positions, or context_kv")
            context_kv = self.context_kv(context.to(x.dtype), context_positions)
        offsets = [0] * len(self.layers) if context_offsets is None else list(context_offsets)
        lens = [kv[0].shape[2] for kv in context_kv]
        ctx_len = lens[0]
        kernel_rule = (key_mask is None and not any(offsets) and len(set(lens)) == 1
                       and (contiguous if contiguous is not None
                            else _contiguous(context_positions, block_positions, ctx_len)))
        masks: dict[tuple, torch.Tensor | None] = {}
        if key_mask is not None and key_mask.dtype == torch.bool:
            key_mask = additive(key_mask, x.dtype)
        keys = []
        for layer, off, clen in zip(self.decoder_layers, offsets, lens):
            rule = (layer.self_attn.spec.causal, layer.self_attn.spec.window, off, clen)
            keys.append(rule)
            if kernel_rule or rule in masks:
                continue
            bsz = block_positions.shape[0]
            ctx_pos = context_positions if context_positions is not None and not off else \
                (off + torch.arange(clen, device=block_positions.device)).expand(bsz, -1)
            key_pos = torch.cat([ctx_pos, block_positions], dim=1)
            mask = additive(visible_keys(block_positions, key_pos, *rule[:2]), x.dtype)
            if key_mask is not None:
                km = key_mask[..., off:] if key_mask.shape[-1] > 1 else key_mask
                mask = km.to(x.dtype) if mask is None else (mask + km.to(x.dtype)).clamp_(min=torch.finfo(x.dtype).min)
            if mask is None:
                mask = torch.zeros(1, 1, 1, 1, dtype=x.dtype, device=x.device)
            masks[rule] = mask
        cos, sin = self.rotary(block_positions, x.dtype)
        for layer, kv, rule in zip(self.decoder_layers, context_kv, keys):
            x = layer(x, cos, sin, kv, masks.get(rule))
        return self.norm(x)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
    ) -> DFlashDraftModel:
        """Load a published DFlash directory (``config.json`` + ``model.safetensors``) as it is.

        Everything is checked before the weights are read: the config's sizes, then the tensor names and
        shapes in the safetensors headers against those the config implies. Pickled checkpoints
        (``pytorch_model.bin``) are refused, never unpickled. Non-finite weights are refused after reading.
        """
        path = Path(path)
        config = DFlashConfig.from_pretrained(path)
        warn_last_layer(config, str(path))
        refuse_pickled_sidecars(path)
        files = weight_files(path)
        shapes = header_shapes(files)
        shapes = {k.removeprefix("model."): v for k, v in shapes.items()}
        if shapes.get("mask_embedding") in ((config.hidden_size,), (1, config.hidden_size)):
            shapes["mask_embedding"] = (config.hidden_size,)
        has_mask = "mask_embedding" in shapes
        with torch.device("meta"):
            own = {k: tuple(v.shape) for k, v in cls(config, mask_embedding=has_mask).state_dict().items()}
        check_header_shapes(shapes, own, path)
        state = read_weights(files)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        if has_mask:
            state["mask_embedding"] = state["mask_embedding"].reshape(-1)
        check_finite(state)
        file_dtype = next(iter(state.values())).dtype
        # built in the final dtype first, so a float64 checkpoint is not rounded through float32 on the way
        model = cls(config, mask_embedding=has_mask).to(dtype=dtype or file_dtype)
        model.load_state_dict(state)
        if draft_vocab_file(path) is not None:
            model.draft_vocab = load_draft_vocab(path, config.vocab_size)
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
            save_draft_vocab(path, self.draft_vocab)  # JSON: never a *.safetensors file besides the weights
