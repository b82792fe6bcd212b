"""``DFlashConfig``: a DFlash drafter's ``config.json`` read (and checked) as published."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from ddtree.drafters.features import build_target_layer_ids, check_target_layer_ids

FULL, SLIDING = "full_attention", "sliding_attention"


REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                   "num_hidden_layers", "vocab_size", "block_size")


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


def check_sizes(d: dict) -> None:
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
        check_sizes(d)
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
