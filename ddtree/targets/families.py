"""Which target families ddtree verifies exactly, and a clear refusal for the rest.

A tree verify is exact when every layer of the target can see a tree: softmax attention
through a mask or split attention, a layer with state through its kind in :mod:`ddtree.targets.layer_kinds`
(Gated DeltaNet today).
A layer with any other recurrent state (Mamba-2 mixers, short convolutions, other linear
attention) would run the tree as one chain and silently mix siblings, so such targets
are refused when the generator is built, before any output exists.
"""

from __future__ import annotations

from typing import Any

from ddtree.targets.description import describe
from ddtree.targets.layer_kinds import STATEFUL_KINDS

ATTENTION_FAMILIES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "cohere2", "gpt_oss",
)
"""Attention-only model types covered by the family test (others with plain softmax attention also work)."""

REFUSED_MODEL_TYPES = {
    "falcon_h1": "Mamba-2 hybrid", "bamba": "Mamba-2 hybrid", "jamba": "Mamba hybrid", "nemotron_h": "Mamba-2 hybrid",
    "zamba": "Mamba hybrid", "zamba2": "Mamba-2 hybrid", "granitemoehybrid": "Mamba-2 hybrid",
    "mamba": "Mamba", "mamba2": "Mamba-2", "falcon_mamba": "Mamba", "lfm2": "short-convolution hybrid",
    "lfm2_moe": "short-convolution hybrid", "recurrent_gemma": "RG-LRU hybrid", "rwkv": "RWKV",
    "kimi_linear": "KDA linear-attention hybrid", "olmo_hybrid": "linear-attention hybrid",
}

_RECURRENT_HINTS = ("Mamba", "Mixer", "ShortConv", "DeltaNet", "LinearAttention", "Recurrent", "RGLRU", "Rwkv", "SSM")

SUPPORTED = (
    "softmax-attention decoders (full or sliding windows from layer_types, a config-level sliding_window or "
    "Qwen2's max_window_layers; attention sinks; logit softcapping; MoE blocks), e.g. "
    + ", ".join(ATTENTION_FAMILIES)
    + "".join(f"; and {kind.name} hybrids: " + ", ".join(kind.model_types) for kind in STATEFUL_KINDS)
)


def check_supported(model: Any) -> None:
    """Raise ``ValueError`` naming the family when ``model`` has layers a tree verify cannot run exactly."""
    description = describe(model)
    model_type, text_type = description.model_types
    for kind in (model_type, text_type):
        if kind in REFUSED_MODEL_TYPES:
            _refuse(model, f"a {REFUSED_MODEL_TYPES[kind]} ({kind})")
    handled: set[int] = set()
    for layer_kind in description.stateful:
        if model_type not in layer_kind.model_types and text_type not in layer_kind.model_types:
            _refuse(model, f"a {layer_kind.name} model of type {model_type!r} that ddtree has not verified")
        handled.update(id(m) for m in layer_kind.modules(model))
    for name, module in model.named_modules():
        cls = type(module).__name__
        if id(module) not in handled and any(h.lower() in cls.lower() for h in _RECURRENT_HINTS) and _has_state(module):
            _refuse(model, f"a model with a recurrent {cls} layer ({name}) of type {model_type!r}")
    known = {"full_attention", "sliding_attention", "linear_attention"}
    unknown = set(description.layer_types) - known
    if unknown:
        _refuse(model, f"a model with {sorted(unknown)} layers (type {model_type!r})")


def _has_state(module: Any) -> bool:
    """Mixers that carry a state between tokens have a conv or a state-space parameter."""
    return any(hasattr(module, a) for a in ("conv1d", "conv", "A_log", "in_proj", "x_proj"))


def _refuse(model: Any, what: str) -> None:
    raise ValueError(
        f"ddtree cannot verify {type(model).__name__} exactly: it is {what}, whose recurrent state a tree forward "
        f"would mix across sibling nodes. Supported: {SUPPORTED}."
    )
