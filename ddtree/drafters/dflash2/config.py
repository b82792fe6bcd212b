"""``DFlash2Config``: a DFlash2 drafter's ``config.json`` (``architectures: ["DFlash2DraftModel"]``), read as
the authors' loader reads it.

The DFlash fields are read by :class:`~ddtree.drafters.dflash.config.DFlashConfig` (kept as ``base``); the
DFlash2 fields, and the ones that change what it proposes, are read here with the published precedence:
``dflash_config[name]`` when present, else the top-level key, else the default.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ddtree.drafters.dflash.config import FULL, SLIDING, DFlashConfig, read_config_json

ARCHITECTURE = "DFlash2DraftModel"

# Read here, hidden from the base config (which would keep them as unknown keys).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DRAFT_FIELDS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping", "block_size")


def is_dflash2(path: str | os.PathLike) -> bool:
    """True when the directory's ``config.json`` names the DFlash2 architecture."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return False  # the DFlash loader reports a missing or damaged config by name
    return isinstance(data, dict) and ARCHITECTURE in (data.get("architectures") or [])


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DFlash2 config: {name} must be a positive int, got {value!r}; fix config.json")
    return value


@dataclass
class DFlash2Config:
    """The DFlash fields (``base``) plus the convolution, selector and output fields of a DFlash2 drafter.

    ``layer_causal[i]`` / ``layer_window[i]``: drafter layer ``i``'s attention as the authors resolve it
    (sliding layers causal unless the top-level ``is_causal`` says otherwise, full layers non-causal; a
    sliding layer's window only when ``use_sliding_window`` is true, as ``Qwen3Config`` does).
    """

    base: DFlashConfig
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    is_causal: bool | None = None
    use_sliding_window: bool = False

    def __post_init__(self) -> None:
        for name in DFLASH2_FIELDS:
            _positive_int(name, getattr(self, name))
        hidden = self.base.hidden_size
        if hidden % self.conv_group_size:
            raise ValueError(f"DFlash2 config: conv_group_size {self.conv_group_size} does not divide hidden_size "
                             f"{hidden}; the convolution's channel groups must tile the hidden state")
        if self.selector_top_k > self.base.vocab_size:
            raise ValueError(f"DFlash2 config: selector_top_k {self.selector_top_k} exceeds the vocabulary "
                             f"({self.base.vocab_size})")

    def __getattr__(self, name: str) -> Any:  # the DFlash fields (hidden_size, block_size, ...) read through
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def groups(self) -> int:
        return self.base.hidden_size // self.conv_group_size

    @property
    def _layer_types(self) -> list[str]:
        return cast("list[str]", self.base.layer_types)  # DFlashConfig.__post_init__ always sets them

    @property
    def layer_causal(self) -> list[bool]:
        if self.is_causal is not None:
            return [bool(self.is_causal)] * self.base.num_hidden_layers
        return [t == SLIDING for t in self._layer_types]

    @property
    def layer_window(self) -> list[int | None]:
        on = self.use_sliding_window
        return [self.base.sliding_window if t == SLIDING and on else None for t in self._layer_types]

    @classmethod
    def from_dict(cls, d: dict) -> DFlash2Config:
        if not isinstance(d, dict):
            raise ValueError(f"a drafter config is a JSON object (a dict), got {type(d).__name__}")  # noqa: TRY004 (a config error, as DFlashConfig raises)
        d = dict(d)
        dflash = dict(d.get("dflash_config") or {})

        def value(name: str, default: object = None) -> Any:
            return dflash[name] if name in dflash else d.get(name, default)

        missing = [n for n in DFLASH2_FIELDS if value(n) is None]
        if missing:
            raise ValueError(f"the DFlash2 drafter config lacks {', '.join(missing)} (in dflash_config or at the "
                             "top level): a DFlash2 checkpoint needs the convolution and selector sizes")
        if d.get("head_dim") is None:
            raise ValueError("the DFlash2 drafter config has no head_dim: set it explicitly (the authors' loader "
                             "would default it to 128, ddtree to hidden_size / num_attention_heads)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"DFlash2 drafter hidden_act {act!r} is not supported (only 'silu')")
        if d.get("layer_types") is None and d.get("use_sliding_window"):
            raise ValueError("the DFlash2 config sets use_sliding_window without layer_types: list each layer's "
                             "type in layer_types (ddtree does not infer them from max_window_layers)")
        fields = {n: value(n) for n in DFLASH2_FIELDS}
        scale, mult, cap = (value(n, default) for n, default in
                            (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)))
        for name, v in (("input_embedding_scale", scale), ("output_multiplier", mult)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"DFlash2 config: {name} must be a number, got {v!r}")  # noqa: TRY004
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
            raise ValueError(f"DFlash2 config: final_logit_softcapping must be a number or null, got {cap!r}")
        is_causal = d.pop("is_causal", None)
        use_swa = bool(d.pop("use_sliding_window", False))
        d["block_size"] = value("block_size", 16)
        for n in DFLASH2_FIELDS + DRAFT_FIELDS:
            dflash.pop(n, None)
            if n != "block_size":
                d.pop(n, None)
        d["dflash_config"] = dflash
        for n in ("architectures", "hidden_act", "max_window_layers"):
            d.pop(n, None)
        if d.get("rope_theta") is None and not (d.get("rope_parameters") or d.get("rope_scaling")):
            d["rope_theta"] = 10_000.0  # Qwen3Config's default, which the authors' loader applies
        base = DFlashConfig.from_dict(d)
        return cls(base=base, input_embedding_scale=float(scale), output_multiplier=float(mult),
                   final_logit_softcapping=None if cap is None else float(cap),
                   is_causal=None if is_causal is None else bool(is_causal), use_sliding_window=use_swa, **fields)

    def to_dict(self) -> dict:
        out = self.base.to_dict()
        out["architectures"] = [ARCHITECTURE]
        out["hidden_act"] = "silu"
        dflash = out.setdefault("dflash_config", {})
        dflash.update({n: getattr(self, n) for n in DFLASH2_FIELDS}, block_size=self.base.block_size,
                      input_embedding_scale=self.input_embedding_scale, output_multiplier=self.output_multiplier)
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.use_sliding_window:
            out["use_sliding_window"] = True
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DFlash2Config:
        return cls.from_dict(read_config_json(path, "DFlash2")[1])


__all__ = ["ARCHITECTURE", "FULL", "SLIDING", "DFlash2Config", "is_dflash2"]
