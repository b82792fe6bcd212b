"""The DFlash block-diffusion drafter and the ``Drafter`` protocol.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_linear
from .attention import block_attention
from .distributed import Lockstep, full_tensor, module_fingerprint
from .features import build_target_layer_ids, check_target_layer_ids, extract_context_feature

FULL, SLIDING = "full_attention", "sliding_attention"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class DraftContext(Protocol):
    """One generation's drafter state: what each row has committed so far.

    Rows are the active rows of a batch. ``append`` takes left-aligned
    ``features`` ``[B, T, F]`` and ``tokens`` ``[B, T]`` of the tokens each row
    just committed, of which row ``b`` has ``counts[b]`` (default all ``T``).
    """

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None = None) -> None: ...

    def propose(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[B, block_size - 1, V]`` for the positions after each row's root."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (others finished)."""


class Drafter(Protocol):
    """What the generator needs from a drafter: features to read, and a fresh context per generation.

    The drafter itself holds only weights and settings, so one drafter serves
    any number of interleaved generations.
    """

    block_size: int
    target_layer_ids: list[int]

    def context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The target features this drafter reads, ``[B, T, F]``, from a forward's ``hidden_states``."""

    def new_context(self, batch_size: int = 1) -> DraftContext: ...


REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                   "num_hidden_layers", "vocab_size", "block_size")

# Sanity caps on a config read from disk, checked before anything is allocated. They sit far above every
# published DFlash drafter (hidden 4096-8192, 1-8 layers, block 16) and far below sizes that would exhaust memory.
SIZE_LIMITS = {
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "num_hidden_layers": 256,
    "num_target_layers": 4096,
    "vocab_size": 1 << 24,
    "block_size": 1024,
    "max_position_embeddings": 1 << 24,
}


def _check_sizes(d: dict) -> None:
    """Every size in a config dict is a positive int within :data:`SIZE_LIMITS`, else a ValueError that names it."""
    for key, limit in SIZE_LIMITS.items():
        value = d.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"drafter config {key} must be an int, got {value!r}; fix config.json")
        if not 1 <= value <= limit:
            raise ValueError(
                f"drafter config {key} = {value} is outside 1..{limit}: the config is damaged or not a DFlash "
                "drafter's (published drafters use hidden sizes of a few thousand, 1-8 layers and block_size 16); "
                "fix or re-download config.json"
            )
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if heads % kv:
        raise ValueError(f"drafter config num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                         f"({kv}); fix config.json")
    if d.get("head_dim") is None and d["hidden_size"] % heads:
        raise ValueError(f"drafter config hidden_size ({d['hidden_size']}) is not a multiple of num_attention_heads "
                         f"({heads}) and no head_dim is given; fix config.json")


@dataclass
class DFlashConfig:
    """The drafter's ``config.json``, parsed. Unknown keys are kept in ``extra`` for round trips."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    num_target_layers: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int | None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    attention_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    max_position_embeddings: int = 40960
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} drafter layers"
            )
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"unknown layer_types {sorted(unknown)}; expected {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 1
        ):
            raise ValueError(
                "layer_types has sliding_attention layers but the config sets no sliding_window "
                f"(a positive int), got {self.sliding_window!r}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (root + at least one predicted slot), got {self.block_size}")
        if self.mask_token_id is None:
            raise ValueError(
                "the drafter config has no mask token id: set dflash_config.mask_token_id to the token "
                "whose embedding fills the slots to predict"
            )
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a drafter config is a JSON object (a dict), got {type(d).__name__}")
        missing = [k for k in REQUIRED_FIELDS if d.get(k) is None]
        if missing:
            raise ValueError(
                f"the drafter config lacks {', '.join(missing)}: a DFlash config.json needs "
                f"{', '.join(REQUIRED_FIELDS)} (and num_target_layers); fix or re-download config.json"
            )
        _check_sizes(d)
        d = dict(d)
        dflash = d.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"dflash_config must be a JSON object, got {type(dflash).__name__}")
        num_layers = d["num_hidden_layers"]
        num_target = d.get("num_target_layers")
        if num_target is None:
            raise ValueError("the drafter config has no num_target_layers (the target's decoder layer count)")
        ids = dflash.get("target_layer_ids", d.pop("target_layer_ids", None))
        if ids is None:
            ids = build_target_layer_ids(num_target, num_layers)
        mask_id = dflash.get("mask_token_id", d.pop("mask_token_id", None))
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        rope = dict(rope)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", d.pop("rope_theta", 1_000_000.0))
        d.pop("rope_theta", None)
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "target_layer_ids", "mask_token_id")}
        kwargs = {k: d.pop(k) for k in list(d) if k in known}
        extra = {k: v for k, v in d.items() if k not in ("rope_parameters",)}
        extra["dflash_config"] = {k: v for k, v in dflash.items() if k not in ("target_layer_ids", "mask_token_id")}
        return cls(target_layer_ids=list(ids), mask_token_id=mask_id, rope_parameters=rope, extra=extra, **kwargs)

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        dflash = dict(extra.pop("dflash_config", {}) or {})
        dflash.update(target_layer_ids=d.pop("target_layer_ids"), mask_token_id=d.pop("mask_token_id"))
        rope = d.pop("rope_parameters")
        out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **extra, **d}
        out["rope_theta"] = rope.get("rope_theta")
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = rope
        out["dflash_config"] = dflash
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DFlashConfig":
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no drafter config at {file}: a DFlash drafter directory holds config.json")
        try:
            data = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"{file} is not valid JSON ({exc}): the file is damaged or not a config; re-download the drafter"
            ) from None
        return cls.from_dict(data)

    @classmethod
    def for_target(
        cls,
        target_config,
        *,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: Sequence[int] | None = None,
        layer_types: Sequence[str] | None = None,
        sliding_window: int | None = None,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
    ) -> "DFlashConfig":
        """A drafter shaped like ``target_config`` (hidden size, vocab, RoPE), for training from scratch."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = num_attention_heads or tc.num_attention_heads
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", getattr(tc, "rope_theta", 10_000.0))
        n_target = tc.num_hidden_layers
        return cls(
            hidden_size=tc.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=num_key_value_heads or getattr(tc, "num_key_value_heads", heads),
            head_dim=head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            vocab_size=tc.vocab_size,
            num_target_layers=n_target,
            block_size=block_size,
            target_layer_ids=list(target_layer_ids) if target_layer_ids is not None
            else build_target_layer_ids(n_target, num_hidden_layers),
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters=rope,
            layer_types=list(layer_types) if layer_types is not None else None,
            sliding_window=sliding_window,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 40960),
        )


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
        files = _weight_files(path)
        shapes = _header_shapes(files)
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
        state = _read_weights(files)
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


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _weight_files(path: Path) -> list[Path]:
    """The drafter's ``*.safetensors`` files (not the draft-vocabulary sidecar); pickled weights are refused."""
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != DRAFT_VOCAB_FILE]
    if files:
        return files
    pickled = sorted(f.name for f in path.iterdir() if f.suffix in PICKLED_SUFFIXES) if path.is_dir() else []
    if pickled:
        raise ValueError(
            f"drafter directory {path} holds only pickled weights ({', '.join(pickled)}); ddtree never unpickles "
            "files (a pickle can run arbitrary code). Convert them once, in a process you trust, with "
            "safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')"
        )
    raise FileNotFoundError(f"no *.safetensors weights in drafter directory {path}")


def _header_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors headers, reading no tensor data."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():
                    shapes[k] = tuple(handle.get_slice(k).get_shape())
        except Exception as exc:  # safetensors raises its own error types (SafetensorError, OSError, ...)
            raise ValueError(f"drafter weights {f} cannot be read ({type(exc).__name__}: {exc}): the file is "
                             "truncated or damaged; re-download it") from None
    return shapes


def _read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise ValueError(f"drafter weights {f} cannot be read ({type(exc).__name__}: {exc}): the file is "
                             "truncated or damaged; re-download it") from None
    return state


def save_draft_vocab(path: str | os.PathLike, token_ids: torch.Tensor) -> None:
    """Write ranked token ids (most useful first) as ``draft_vocab.safetensors`` next to a drafter."""
    from safetensors.torch import save_file

    ids = torch.as_tensor(token_ids).to(torch.int64).flatten().cpu().contiguous()
    save_file({"token_ids": ids}, str(Path(path) / DRAFT_VOCAB_FILE), metadata={"format": "pt"})


def load_draft_vocab(path: str | os.PathLike, vocab_size: int) -> torch.Tensor:
    """Ranked token ids from ``path/draft_vocab.safetensors``, checked against the vocabulary."""
    from safetensors.torch import load_file

    f = Path(path) / DRAFT_VOCAB_FILE
    try:
        ids = load_file(str(f)).get("token_ids")
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{f} cannot be read ({type(exc).__name__}: {exc}): the file is truncated or damaged; "
                         "re-download it, or delete it to draft over the full vocabulary") from None
    if ids is None:
        raise ValueError(f"{f} has no 'token_ids' tensor; write it with ddtree.drafter.save_draft_vocab")
    return check_draft_vocab(ids, vocab_size, where=str(f))


def check_draft_vocab(ids: torch.Tensor, vocab_size: int, where: str = "draft_vocab") -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0:
        raise ValueError(f"{where}: a draft vocabulary is a non-empty 1-D tensor of token ids, got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]; "
                         "was it built for another tokenizer?")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: token ids repeat; a draft vocabulary lists each token once")
    return ids


def _target_vocab(target) -> int:
    head = target.get_output_embeddings()
    return head.weight.shape[0]


def check_compatible(config: DFlashConfig, target) -> None:
    """Raise a ValueError naming the mismatch when a drafter cannot serve ``target``."""
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if tc.hidden_size != config.hidden_size:
        raise ValueError(
            f"drafter hidden size {config.hidden_size} does not match the target's {tc.hidden_size}: "
            "use a drafter trained for this target"
        )
    vocab = _target_vocab(target)
    if vocab != config.vocab_size:
        raise ValueError(
            f"drafter vocab size {config.vocab_size} does not match the target's lm_head ({vocab}): "
            "use a drafter trained for this target's tokenizer"
        )
    check_target_layer_ids(config.target_layer_ids, tc.num_hidden_layers)
    if config.num_target_layers != tc.num_hidden_layers:
        raise ValueError(
            f"the drafter was trained for a target with {config.num_target_layers} decoder layers, this target "
            f"has {tc.num_hidden_layers}: use a drafter trained for this target"
        )
    if not 0 <= config.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target's vocabulary (size {vocab})")


class DFlashDrafter:
    """A DFlash model bound to its target: weights and settings only, shared by every generation.

    Per generation, :meth:`new_context` gives a :class:`DFlashContext`: each round
    ``ctx.propose(roots)`` for the block after each row's committed context, then
    ``ctx.append(features, tokens, counts)`` for the tokens the target accepted.
    """

    def __init__(self, model: DFlashDraftModel, target, draft_vocab: "str | int | torch.Tensor | None" = "auto"):
        self._lockstep = Lockstep.for_model(target)  # a tensor-parallel target's ranks bind together
        with self._lockstep.fail_together("binding the drafter to the target"):
            check_compatible(model.config, target)
        self.model = model
        self.config = model.config
        self.block_size = model.config.block_size
        self.target_layer_ids = list(model.config.target_layer_ids)
        self.mask_token_id = model.config.mask_token_id
        # Borrowed, not owned: kept in a tuple so they are not registered anywhere.
        self._target_parts = (target.get_input_embeddings(), target.get_output_embeddings())
        for part, name in zip(self._target_parts, ("input embedding", "lm_head")):
            if part.weight.device.type == "meta":
                raise ValueError(f"the target's {name} is offloaded (its weight is on the meta device), and the "
                                 f"drafter borrows it: keep it on a device in the device_map (offload layers instead)")
        self.set_draft_vocab(draft_vocab)

    def set_draft_vocab(self, draft_vocab: "str | int | torch.Tensor | None" = "auto") -> None:
        """Restrict proposals to a token subset, so the drafter's lm_head reads a slice of the target's.

        On a CPU the full-vocabulary head over the block costs more than the
        drafter's layers; a ranked subset of the most frequent tokens keeps the
        proposals that can realistically be accepted. Outside the subset the
        log-probs are ``-inf``. Verification is unchanged, so output stays exact.

        ``"auto"``: the model's ``draft_vocab`` if it has one, else the full vocabulary;
        ``None`` or ``0``: the full vocabulary; an int ``n``: the model's ``n`` top-ranked ids;
        a tensor: these ids.
        """
        with self._lockstep.fail_together("choosing the draft vocabulary"):
            ids = self._draft_vocab_ids(draft_vocab)
        if self._lockstep.active:  # gathering a sharded lm_head below is a collective: same branch everywhere
            self._lockstep.agree((module_fingerprint(self.model), None if ids is None else ids.tolist()),
                                 "the drafter")
        self._slice_head(ids)

    def _draft_vocab_ids(self, draft_vocab) -> torch.Tensor | None:
        """The token ids ``draft_vocab`` names (checked), or ``None`` for the full vocabulary."""
        vocab = self._target_parts[1].weight.shape[0]
        ranked = self.model.draft_vocab
        if isinstance(draft_vocab, str):
            if draft_vocab != "auto":
                raise ValueError(f"draft_vocab must be 'auto', None, an int or a tensor of token ids, got {draft_vocab!r}")
            ids = ranked
        elif draft_vocab is None or (isinstance(draft_vocab, int) and draft_vocab == 0):
            ids = None
        elif isinstance(draft_vocab, int):
            if ranked is None:
                raise ValueError(f"draft_vocab={draft_vocab} needs a ranked vocabulary, and this drafter has no "
                                 f"{DRAFT_VOCAB_FILE}; pass the token ids as a tensor instead")
            if draft_vocab < 0:
                raise ValueError(f"draft_vocab must be >= 0 (0 = full vocabulary), got {draft_vocab}")
            ids = ranked[:draft_vocab]
        else:
            ids = check_draft_vocab(draft_vocab, vocab)
        if ids is not None and ids.numel() >= vocab:
            ids = None
        return ids

    def _slice_head(self, ids: torch.Tensor | None) -> None:
        head = self._target_parts[1]
        if ids is None:
            self.draft_vocab, self._head_slice = None, None
            return
        # The slice is the drafter's own copy, on its device: a tensor-parallel lm_head is gathered whole
        # first (every rank runs this), a layer-split one may sit on another device than the drafter.
        device = self.model.fc.weight.device
        weight, bias = full_tensor(head.weight.detach()), getattr(head, "bias", None)
        bias = None if bias is None else full_tensor(bias.detach())
        ids = ids.to(device).sort().values
        self.draft_vocab = ids
        self._head_slice = (weight.to(device)[ids].contiguous(), None if bias is None else bias.to(device)[ids].contiguous())

    @classmethod
    def from_pretrained(cls, path, target, *, dtype=None, device=None, draft_vocab="auto") -> "DFlashDrafter":
        check_compatible(DFlashConfig.from_pretrained(path), target)  # before any weight is read
        dev = device if device is not None else target.get_input_embeddings().weight.device
        return cls(DFlashDraftModel.from_pretrained(path, dtype=dtype, device=dev), target, draft_vocab=draft_vocab)

    def context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target layers' features on the drafter's device (a layer-split target's layers sit on several)."""
        return extract_context_feature(hidden_states, self.target_layer_ids, device=self.model.fc.weight.device)

    def new_context(self, batch_size: int = 1) -> "DFlashContext":
        return DFlashContext(self, batch_size)

    def block_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs over the target's vocabulary (``-inf`` outside a draft vocabulary), float32."""
        lm_head = self._target_parts[1]
        hidden = hidden.to(lm_head.weight.dtype)
        if self._head_slice is None:  # the target's own module: its tensor-parallel or device hooks apply
            logits = lm_head(hidden.to(lm_head.weight.device))
            return torch.log_softmax(logits.float(), dim=-1).to(hidden.device)
        linear = cpu_linear.linear if cpu_linear.routed(self.model.fc) else F.linear  # routed with the model
        sub = torch.log_softmax(linear(hidden, *self._head_slice).float(), dim=-1)
        out = sub.new_full((*sub.shape[:-1], lm_head.weight.shape[0]), float("-inf"))
        return out.index_copy_(-1, self.draft_vocab, sub)


class DFlashContext:
    """The DFlash drafter's per-generation state: each layer's keys/values of the committed context.

    Row ``b``'s context fills buffer columns ``0 .. lengths[b] - 1`` (column =
    token position). Buffers grow by doubling, so appending a round's tokens
    copies only those tokens, never the whole context. Block entries are never
    stored: nothing has to be cropped after a round.
    """

    def __init__(self, drafter: DFlashDrafter, batch_size: int = 1):
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # [B, Hkv, capacity + 1, d]; the last is scratch
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2] - 1

    def nbytes(self) -> int:
        """Bytes held by the context buffers."""
        return 0 if self.kv is None else sum(k.numel() * k.element_size() * 2 for k, _ in self.kv)

    @torch.no_grad()
    def append(self, features: torch.Tensor | None, tokens: torch.Tensor | None = None,
               counts: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("the DFlash drafter needs target features for every committed token")
        bsz, t, _ = features.shape
        if bsz != self.lengths.numel():
            raise ValueError(f"features are for {bsz} rows, the context has {self.lengths.numel()}")
        if t == 0:
            return
        model = self.drafter.model
        device = features.device
        self.lengths = self.lengths.to(device)
        counts = torch.full((bsz,), t, dtype=torch.long, device=device) if counts is None else counts.to(device)
        positions = self.lengths[:, None] + torch.arange(t, device=device)  # [B, T]
        new = model.context_kv(model.project_context(features), positions)
        need = int((self.lengths + counts).max())
        self._reserve(need, new)
        uniform = bool((counts == t).all()) and bool((self.lengths == self.lengths[0]).all())
        if uniform:
            at = int(self.lengths[0])
            for (kb, vb), (k, v) in zip(self.kv, new):
                kb[:, :, at : at + t] = k
                vb[:, :, at : at + t] = v
        else:
            cols = torch.where(torch.arange(t, device=device) < counts[:, None], positions, self.capacity)
            for (kb, vb), (k, v) in zip(self.kv, new):
                idx = cols[:, None, :, None].expand(bsz, k.shape[1], t, k.shape[-1])
                kb.scatter_(2, idx, k)
                vb.scatter_(2, idx, v)
        self.lengths = self.lengths + counts

    def _reserve(self, need: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity, 64)
        grown = []
        for i, (k, v) in enumerate(like):
            bsz, heads, _, dim = k.shape
            kb = k.new_zeros(bsz, heads, cap + 1, dim)
            vb = v.new_zeros(bsz, heads, cap + 1, v.shape[-1])
            if self.kv is not None:
                old_k, old_v = self.kv[i]
                kb[:, :, : self.capacity] = old_k[:, :, : self.capacity]
                vb[:, :, : self.capacity] = old_v[:, :, : self.capacity]
            grown.append((kb, vb))
        self.kv = grown

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lengths = self.lengths.index_select(0, rows.to(self.lengths.device))
        if self.kv is not None:
            self.kv = [(k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device))) for k, v in self.kv]

    @torch.no_grad()
    def propose(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[B, block_size - 1, V]`` for positions ``lengths + 1 ..``, in float32."""
        if self.kv is None or bool((self.lengths == 0).any()):
            raise RuntimeError("the drafter has no context yet: append the prompt's target features first")
        drafter = self.drafter
        model = drafter.model
        embed = drafter._target_parts[0]
        root_tokens = root_tokens.view(-1, 1)
        bsz = root_tokens.shape[0]
        size = drafter.block_size
        device = root_tokens.device
        lengths = self.lengths.to(device)
        block = torch.cat([root_tokens, root_tokens.new_full((bsz, size - 1), drafter.mask_token_id)], dim=1)
        block_pos = lengths[:, None] + torch.arange(size, device=device)
        width = int(lengths.max())
        kv = [(k[:, :, :width], v[:, :, :width]) for k, v in self.kv]
        masks = None
        if not bool((lengths == width).all()):  # ragged rows: mask each row's unused columns
            masks = self._ragged_masks(lengths, width, block_pos, model.fc.weight.dtype)
        hidden = model(embed(block), block_pos, context_kv=kv, attention_masks=masks)[:, 1:]
        return drafter.block_logprobs(hidden)

    def _ragged_masks(self, lengths, width, block_pos, dtype) -> dict[str, torch.Tensor]:
        col = torch.arange(width, device=lengths.device)
        key_pos = torch.cat([col.expand(len(lengths), -1), block_pos], dim=1)  # column = position
        valid = torch.cat([col[None] < lengths[:, None], torch.ones_like(block_pos, dtype=torch.bool)], dim=1)
        hidden = torch.finfo(dtype).min
        full = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, hidden)
        full = full[:, None, None].expand(-1, 1, block_pos.shape[1], -1)
        masks = {FULL: full, SLIDING: None}
        if SLIDING in self.drafter.config.layer_types:
            window = window_mask(block_pos, key_pos, self.drafter.config.sliding_window, dtype)
            masks[SLIDING] = window.masked_fill(~valid[:, None, None], hidden)
        return masks


__all__ = [
    "Drafter",
    "DraftContext",
    "DFlashContext",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafter",
    "check_compatible",
    "check_draft_vocab",
    "load_draft_vocab",
    "save_draft_vocab",
    "window_mask",
]
