"""``DFlashConfig``: a DFlash drafter's ``config.json`` read (and checked) as published."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ddtree.drafters.features import build_target_layer_ids, check_target_layer_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FULL, SLIDING = "full_attention", "sliding_attention"


# Keys of dflash_config that DFlashConfig reads into fields (the rest stay in extra["dflash_config"]).
DFLASH_FIELDS = ("target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping", "causal", "use_swa", "swa_window_size", "attention_sink_bias",
                 "target_hidden_size")

# Top-level keys a drafter config may carry without a warning: Hugging Face's standard ones, Qwen3's, and DFlash's.
KNOWN_KEYS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "tie_word_embeddings", "use_cache", "max_window_layers", "use_sliding_window", "hidden_act", "rope_theta",
    "rope_scaling", "rope_parameters", "dflash_config", "target_layer_ids", "mask_token_id", "is_causal",
    "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "target_hidden_size",
    "add_swa_attention_sink_bias", "num_target_layers", "block_size", "logit_scale", "draft_vocab_size",
})
KNOWN_DFLASH_KEYS = frozenset(DFLASH_FIELDS) | {"logit_scale", "draft_vocab_size"}


class LayerAttention(NamedTuple):
    """How one drafter layer attends over ``[context ; block]``: resolved from the config as the authors do."""

    index: int  # type: ignore[assignment]  # the layer's index; shadowing tuple.index is intended
    type: str
    causal: bool  # a slot at position p sees keys at k <= p only
    window: int | None  # p - k < window (and k - p < window when not causal); None: no window
    sinks: bool  # a learned per-head sink logit in the softmax denominator


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
    if heads is not None and kv is not None and heads % kv:
        raise ValueError(f"drafter config num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                         f"({kv}); fix config.json")
    if d.get("head_dim") is None and heads is not None and d.get("hidden_size") is not None \
            and d["hidden_size"] % heads:
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
    is_causal: bool | None = None  # top level (the authors' package): overrides every layer's causality
    causal: bool | None = None  # dflash_config.causal (vLLM): the same override
    use_swa: bool = False  # dflash_config.use_swa (vLLM): every layer sliding when no layer type is
    swa_window_size: int | None = None  # dflash_config.swa_window_size (vLLM): the window, before sliding_window
    use_sliding_window: bool | None = None  # Qwen3Config's gate on sliding_window (see resolve_attention)
    max_window_layers: int | None = None  # Qwen3Config: with no layer_types, layers >= this slide
    input_embedding_scale: float = 1.0  # multiplies every block token's embedding (root and masks)
    output_multiplier: float = 1.0  # multiplies the drafter's logits
    final_logit_softcapping: float | None = None  # then c * tanh(logits / c)
    target_hidden_size: int | None = None  # the target's width (fc reads len(ids) * it); None: hidden_size
    attention_sink_bias: bool = False  # per-head sinks on every layer (vLLM's dflash_config.attention_sink_bias)
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            # As Qwen3Config infers them (layers from max_window_layers slide when the window is enabled),
            # or every layer sliding under vLLM's dflash_config.use_swa.
            first = self.max_window_layers if self.max_window_layers is not None else 28
            gated = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = [SLIDING if self.use_swa or (gated and i >= first) else FULL
                                for i in range(self.num_hidden_layers)]
        elif self.use_swa and SLIDING not in self.layer_types:
            self.layer_types = [SLIDING] * len(self.layer_types)  # vLLM: use_swa when no type slides
        if self.hidden_act != "silu":
            raise ValueError(f"drafter config hidden_act {self.hidden_act!r} is not supported (ddtree's drafter MLP "
                             "is SiLU-gated, as every published DFlash drafter); use a drafter with hidden_act 'silu'")
        if self.swa_window_size is not None:
            self.sliding_window = self.swa_window_size
        if self.is_causal is not None and self.causal is not None and bool(self.is_causal) != bool(self.causal):
            raise ValueError(f"the drafter config sets is_causal={self.is_causal} (top level) and "
                             f"dflash_config.causal={self.causal}, which disagree; keep one of them")
        for name in ("input_embedding_scale", "output_multiplier"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"drafter config {name} must be a positive number, got {value!r}; fix config.json")
            setattr(self, name, float(value))
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
            raise ValueError(f"drafter config final_logit_softcapping must be a number or null, got {cap!r}")
        if self.target_hidden_size is not None and self.target_hidden_size != self.hidden_size:
            raise ValueError(
                f"drafter config target_hidden_size ({self.target_hidden_size}) differs from its hidden_size "
                f"({self.hidden_size}): such a drafter needs token embeddings and an lm_head of its own width, which "
                "the DFlash format does not define (it borrows the target's); ddtree refuses it. Use a drafter "
                "as wide as its target")
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

    def resolve_attention(self) -> list[LayerAttention]:
        """Each layer's causality, window and sinks, as the authors' package and vLLM resolve them.

        Full layers are non-causal, sliding layers causal, unless ``is_causal`` (top level) or
        ``dflash_config.causal`` overrides every layer. The window is ``dflash_config.swa_window_size`` else
        ``sliding_window``. ddtree applies it whatever ``use_sliding_window`` says, as vLLM and the authors'
        MLX code do (their torch code drops it when ``use_sliding_window`` is not true; :meth:`from_pretrained`
        warns then).
        """
        override = self.causal if self.causal is not None else self.is_causal
        assert self.layer_types is not None  # set by __post_init__
        return [LayerAttention(i, t, bool(override) if override is not None else t == SLIDING,
                               self.sliding_window if t == SLIDING else None, self.attention_sink_bias)
                for i, t in enumerate(self.layer_types)]

    def attention_table(self) -> str:
        """The resolved per-layer attention as a printable table (layer, type, causal, window, sinks)."""
        rows = ["layer  type               causal  window  sinks"]
        for a in self.resolve_attention():
            rows.append(f"{a.index:<6} {a.type:<18} {a.causal!s:<7} {a.window!s:<7} {a.sinks}")
        return "\n".join(rows)

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        if not isinstance(d, dict):
            raise ValueError(f"a drafter config is a JSON object (a dict), got {type(d).__name__}")
        if d.get("dflash_config") is None and d.get("mask_token_id") is None:
            raise ValueError(
                "this is not a DFlash drafter config: it has no dflash_config, so no mask token id (the token whose "
                "embedding fills the slots to predict) and no target layers; pass the drafter's directory, not the "
                f"target's (architectures: {d.get('architectures')})"
            )
        raw_dflash = d.get("dflash_config")
        dflash_block = (raw_dflash or {}).get("block_size") if isinstance(raw_dflash, dict) else None
        missing = [k for k in REQUIRED_FIELDS if d.get(k) is None and not (k == "block_size" and dflash_block)]
        if missing:
            raise ValueError(
                f"the drafter config lacks {', '.join(missing)}: a DFlash config.json needs "
                f"{', '.join(REQUIRED_FIELDS)} (and num_target_layers); fix or re-download config.json"
            )
        check_sizes({**d, **({"block_size": dflash_block} if dflash_block is not None else {})})
        d = dict(d)
        dflash = d.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"dflash_config must be a JSON object, got {type(dflash).__name__}")
        num_layers = d["num_hidden_layers"]
        num_target = d.get("num_target_layers")
        if num_target is None:
            raise ValueError("the drafter config has no num_target_layers (the target's decoder layer count)")
        # dflash_config wins over the top level, as the authors read it
        def draft_value(name: str, top: str | None = None) -> Any:
            top = top or name
            if name in dflash:
                d.pop(top, None)
                return dflash[name]
            return d.pop(top, None)

        for name, fine in (("logit_scale", (None, 1, 1.0)), ("draft_vocab_size", (None, d.get("vocab_size")))):
            value = dflash.get(name, d.get(name))
            if value not in fine:
                raise ValueError(f"drafter config sets {name}={value!r}, which changes what the drafter proposes "
                                 "and ddtree does not implement (a vLLM extension); ddtree refuses the checkpoint "
                                 "rather than draft differently. Use a drafter without it")
        ids = draft_value("target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(num_target, num_layers)
        kwargs = {"target_layer_ids": list(ids), "mask_token_id": draft_value("mask_token_id")}
        for name in ("block_size", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                     "target_hidden_size"):
            value = draft_value(name)
            if value is not None:
                kwargs[name] = value
        kwargs["attention_sink_bias"] = bool(draft_value("attention_sink_bias", "add_swa_attention_sink_bias"))
        for name in ("causal", "swa_window_size"):
            kwargs[name] = dflash.get(name)
        kwargs["use_swa"] = bool(dflash.get("use_swa", False))
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        rope = dict(rope)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", d.pop("rope_theta", 10_000.0))  # Qwen3Config's default, as the authors load
        d.pop("rope_theta", None)
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", *kwargs)}
        kwargs.update({k: d.pop(k) for k in list(d) if k in known})
        extra = {k: v for k, v in d.items() if k not in ("rope_parameters",)}
        extra["dflash_config"] = {k: v for k, v in dflash.items() if k not in DFLASH_FIELDS}
        return cls(rope_parameters=rope, extra=extra, **kwargs)

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        dflash = dict(extra.pop("dflash_config", {}) or {})
        dflash.update(target_layer_ids=d.pop("target_layer_ids"), mask_token_id=d.pop("mask_token_id"))
        defaults = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
                    "causal": None, "use_swa": False, "swa_window_size": None, "attention_sink_bias": False,
                    "target_hidden_size": None}
        for name, default in defaults.items():  # written where the authors (or vLLM) read them, when set
            value = d.pop(name)
            if value != default:
                dflash[name] = value
        if SLIDING in d["layer_types"] and d["use_sliding_window"] is None:
            d["use_sliding_window"] = True  # else the authors' torch code (Qwen3Config) drops the window
        for name in ("is_causal", "use_sliding_window", "max_window_layers"):
            if d[name] is None:
                d.pop(name)
        rope = d.pop("rope_parameters")
        out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **extra, **d}
        out["rope_theta"] = rope.get("rope_theta")
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = rope
        out["dflash_config"] = dflash
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DFlashConfig:
        file, data = read_config_json(path, "DFlash")
        config = cls.from_dict(data)
        config.warn_unusual(data, where=str(file))
        return config

    @classmethod
    def unknown_keys(cls, data: dict) -> list[str]:
        """The keys of a raw ``config.json`` dict that ddtree does not read (``dflash_config.*`` spelled out)."""
        dflash = data.get("dflash_config") or {}
        fields = set(cls.__dataclass_fields__) - {"causal", "use_swa", "swa_window_size", "attention_sink_bias",
                                                  "extra"}
        unknown = sorted(k for k in data if k not in KNOWN_KEYS and k not in fields)
        return unknown + sorted(f"dflash_config.{k}" for k in dflash if k not in KNOWN_DFLASH_KEYS)

    def warn_unusual(self, data: dict, where: str = "config.json") -> None:
        """One warning listing the keys ddtree does not read, one for an ambiguous sliding window."""
        unknown = self.unknown_keys(data)
        if unknown:
            warnings.warn(f"{where}: ddtree does not read {', '.join(unknown)}; if one of them changes what the "
                          "drafter proposes, its drafts will differ from the trainer's (see docs/drafters.md)",
                          stacklevel=3)
        assert self.layer_types is not None  # set by __post_init__
        if SLIDING in self.layer_types and not self.use_sliding_window and self.swa_window_size is None:
            warnings.warn(
                f"{where}: sliding layers with sliding_window={self.sliding_window} but use_sliding_window is not "
                "true. ddtree applies the window, as vLLM and the authors' MLX code do; the authors' torch code "
                "(via Qwen3Config) drops it, making those layers causal with no window. Set use_sliding_window: "
                "true to make every engine agree", stacklevel=3)

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
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
    ) -> DFlashConfig:
        """A drafter shaped like ``target_config`` (hidden size, vocab, RoPE), for training from scratch."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = num_attention_heads or tc.num_attention_heads
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        by_type = {k: v for k, v in rope.items() if isinstance(v, dict)}
        if by_type:  # RoPE per layer type (Gemma 3): the drafter's layers attend fully, so take full attention's
            rope = dict(by_type.get("full_attention") or next(iter(by_type.values())))
        rope.setdefault("rope_type", "default")
        if rope.get("rope_theta") is None:
            rope["rope_theta"] = getattr(tc, "rope_theta", None) or 10_000.0
        n_target = tc.num_hidden_layers
        return cls(
            hidden_size=tc.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=cast(int, num_key_value_heads or getattr(tc, "num_key_value_heads", heads)),
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


def read_config_json(path: str | os.PathLike, kind: str) -> tuple[Path, dict]:
    """A drafter directory's (or file's) ``config.json``, parsed, with errors that say what to do."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no drafter config at {file}: a {kind} drafter directory holds config.json")
    try:
        return file, json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{file} is not valid JSON ({exc}): the file is damaged or not a config; re-download the drafter"
        ) from None
