"""What the target side needs to know about a target model, read once per model.

Families keep the same facts in different places (windows on the attention modules, in ``layer_types`` or
config-wide; the text config inside a composite config; the decoder under ``get_decoder()``), so they are
read here, once, into a :class:`TargetDescription` that :func:`describe` remembers on the model object. The
attention backends, the forward, the cache and the round read it instead of walking the model each round.
"""

from __future__ import annotations

from functools import cached_property
from math import lcm
from typing import Any

import torch

from ddtree.targets.layer_kinds import StatefulLayerKind, kinds_in_model

_ATTRIBUTE = "_ddtree_description"


def text_config(config: Any) -> Any:
    """The text part of a (possibly composite) HF config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


ROW_PREFILL_MOST = 256
"""Under exact numerics, prompts of at most this many tokens prefill through the row kernels, so a batch of
them prefills in one forward and each row still gets its batch-1 bits (the packed products run at BLAS speed
up to a few hundred rows; the attention reduces each query over its own keys, quadratic in the prompt). Longer
prompts prefill alone on BLAS."""

class TargetDescription:
    """The facts of one target model. Each is computed on first use and kept: an unsupported layer type
    raises only where windows are asked for, after :func:`ddtree.targets.families.check_supported` has had
    its say."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.numerics = "fast"  # "exact" once ddtree.targets.numerics.prepare_exact routed its kernels

    @cached_property
    def text_config(self) -> Any:
        return text_config(self.model.config)

    @cached_property
    def layer_types(self) -> tuple[str, ...]:
        """The text config's ``layer_types`` (empty when it has none)."""
        return tuple(getattr(self.text_config, "layer_types", None) or ())

    @property
    def model_types(self) -> tuple[str, str]:
        """``(model type, text model type)``: equal unless the config is composite."""
        model_type = getattr(self.model.config, "model_type", "?")
        return model_type, getattr(self.text_config, "model_type", model_type)

    @cached_property
    def windows(self) -> dict[int, int | None]:
        """``{layer_idx: sliding window or None}`` for every softmax-attention layer.

        Most specific first, because families set windows in different places: an attention module's own
        ``sliding_window`` attribute (Qwen2/3, Gemma 2/3, Cohere2, gpt-oss), else the config's ``layer_types``
        with its ``sliding_window`` (``"sliding_attention"`` layers), else a config-level ``sliding_window``
        for every layer (Mistral, Mixtral). Linear-attention layers are left out.
        """
        cfg, types = self.text_config, self.layer_types
        config_window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", True) is False:
            config_window = None
        own: dict[int, int | None] = {}
        for module in self.model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and "sliding_window" in vars(module) and not self._is_linear(idx):
                own[idx] = vars(module)["sliding_window"]
        windows: dict[int, int | None] = {}
        for idx in range(getattr(cfg, "num_hidden_layers", len(types))):
            if self._is_linear(idx):
                continue
            if idx in own:
                window = own[idx]
            elif types:
                if types[idx] not in ("full_attention", "sliding_attention"):
                    raise ValueError(f"layer {idx} is a {types[idx]!r} layer, which ddtree cannot verify as a tree")
                window = config_window if types[idx] == "sliding_attention" else None
            else:
                window = config_window
            windows[idx] = int(window) if window else None
        return windows

    def _is_linear(self, idx: int) -> bool:
        return idx < len(self.layer_types) and self.layer_types[idx] == "linear_attention"

    @cached_property
    def sinks(self) -> bool:
        """Whether an attention layer has learned sinks (gpt-oss ``s_aux``), which split attention does not run."""
        return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in self.model.modules())

    @cached_property
    def decoder_parts(self) -> tuple[torch.nn.Module, torch.nn.ModuleList, bool] | None:
        """``(decoder, its layer list, whether hidden_states[-1] is the decoder's post-norm output)``, or
        ``None`` when the target's layout is not the HF decoder's."""
        get = getattr(self.model, "get_decoder", None)
        try:
            decoder = get() if callable(get) else None
        except (AttributeError, NotImplementedError, ValueError):
            return None
        blocks = getattr(decoder, "layers", None)
        cfg = self.text_config
        if decoder is None or not isinstance(blocks, torch.nn.ModuleList):
            return None
        if len(blocks) != getattr(cfg, "num_hidden_layers", -1):
            return None
        return decoder, blocks, getattr(cfg, "tie_last_hidden_states", True) is not False

    @cached_property
    def stateful(self) -> tuple[StatefulLayerKind, ...]:
        """The layer kinds with per-row state that this model has (empty for attention-only models)."""
        return kinds_in_model(self.model)

    @property
    def padded_prefill_exact(self) -> bool:
        """Whether one left-padded batch prefill gives every row exactly its own batch-1 state."""
        return all(kind.padded_prefill_exact for kind in self.stateful)

    def prefill_rows_alone(self, batch: int, padded: bool, longest: int | None = None) -> bool:
        """Whether a batch's prompts are prefilled one row at a time: where a left-padded batch prefill leaves a
        stateful layer inexact, and under exact numerics for a batch whose prompts are not all prefilled
        through the row kernels (``longest``, the longest prompt; :meth:`prefill_through_row_kernels`): a BLAS
        prefill's products and attention blocks depend on the other rows, and every later token would inherit
        that."""
        if padded and not self.padded_prefill_exact:
            return True
        return (self.numerics == "exact" and batch > 1
                and (longest is None or not self.prefill_through_row_kernels(longest)))

    def prefill_through_row_kernels(self, width: int) -> bool:
        """Whether a ``width``-token prefill forward runs on the row kernels (exact numerics, a prompt of at
        most :data:`ROW_PREFILL_MOST` tokens, attention-only layers), where each row gets its batch-1 bits in any
        batch; otherwise on BLAS and the causal kernels."""
        return self.numerics == "exact" and not self.stateful and width <= ROW_PREFILL_MOST

    def prefill_step(self, width: int, chunk: int | None) -> int:
        """Prompt tokens per prefill forward for a ``width``-token prompt and a requested ``chunk``: the whole
        prompt when a stateful kind cannot continue its state across forwards, else ``chunk`` rounded up to
        whole blocks of every stateful kind (where a split prefill equals one forward to the bit)."""
        if chunk is None or not all(kind.prefill_continues_state() for kind in self.stateful):
            return width
        step = max(1, int(chunk))
        if step < width:
            multiple = lcm(1, *(kind.prefill_multiple for kind in self.stateful))
            step = -(-step // multiple) * multiple
        return step


def describe(model: Any) -> TargetDescription:
    """The :class:`TargetDescription` of ``model``, built on the first call and kept on the model object."""
    found = vars(model).get(_ATTRIBUTE) if hasattr(model, "__dict__") else None
    if found is None or found.model is not model:
        found = TargetDescription(model)
        if hasattr(model, "__dict__"):
            vars(model)[_ATTRIBUTE] = found
    return found
