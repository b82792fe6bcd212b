"""A taken model's decode forward run straight through its parts, without transformers' model forward.

Under ``numerics="exact"`` each decoder layer of a Llama-family step is one C call
(:mod:`~ddtree.targets.exact_layers`); what is left on a CPU is transformers' Python around them: the model's
forward with its output capture and mask building, the decoder loop, each layer's argument handling. For the
causal LMs whose forward is the embedding, the rotary tables, the layers, the final norm and the head
(:data:`FAMILIES`), :func:`forward` calls those parts itself: the same modules and kernels in the same order,
so the same bits. It takes a forward only where nothing could tell: the model's own forward (as
:func:`~ddtree.targets.numerics.prepare_exact` wrapped it) and no hooks on the parts it skips, a one-token step
or an exact tree spec through a cache the C layers append to, a padding mask or the spec as the only keywords.
Anything else returns None and runs as transformers writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ddtree.runtime import invariant
from ddtree.targets import exact_layers
from ddtree.targets.description import describe
from ddtree.targets.exact_attention import ExactTreeSpec
from ddtree.targets.registration import TREE_KWARG

FAMILIES = {"LlamaForCausalLM": "LlamaModel", "MistralForCausalLM": "MistralModel",
            "Qwen2ForCausalLM": "Qwen2Model", "Qwen3ForCausalLM": "Qwen3Model"}
"""Causal LMs whose forward (transformers 5.0 to 5.25) is ``embed_tokens``, ``rotary_emb``, the decoder layers
with one padding mask (the exact attention's mask builder passes a 2-D mask through, for every layer type),
``norm``, then ``lm_head`` over the last ``logits_to_keep`` positions."""

_PARTS = "_ddtree_exact_forward"


class _Parts:
    """What :func:`forward` calls, found once: the model's decoder, its embedding, rotary, norm and head
    modules, and the stack of its taken layers (every one of them, in order)."""

    __slots__ = ("decoder", "stack", "layers", "own_forward", "num", "post_norm_last")

    def __init__(self, decoder: Any, stack: Any, own_forward: Any, post_norm_last: bool):
        self.decoder, self.stack, self.own_forward = decoder, stack, own_forward
        self.post_norm_last = post_norm_last  # hidden_states[-1] is the norm's output, as transformers keeps it
        self.layers = decoder.layers
        self.num = len(stack.modules)

    def intact(self, model: Any) -> bool:
        """Whether the model still runs as when this was made: its forward and its decoder's their own, no
        hooks on either, the same taken layers in its layer list."""
        decoder = self.decoder
        if (vars(model).get("forward") is not self.own_forward or "forward" in vars(decoder)
                or model._forward_hooks or model._forward_pre_hooks or decoder._forward_hooks
                or decoder._forward_pre_hooks or model._modules.get("model") is not decoder
                or decoder._modules.get("layers") is not self.layers
                or decoder.config.num_hidden_layers != self.num):
            return False
        held = self.layers._modules
        return len(held) == self.num and all(a is b for a, b in zip(held.values(), self.stack.modules))


def install(model: torch.nn.Module) -> bool:
    """Let :func:`forward` run ``model`` where its class is one of :data:`FAMILIES` and every decoder layer is
    taken; returns whether it can. Call after :func:`~ddtree.targets.numerics.prepare_exact` wrapped the
    model's forward (that wrapper is the forward it expects to find)."""
    vars(model).pop(_PARTS, None)
    decoder = getattr(model, "model", None)
    stack = exact_layers.decoder_stack(model)
    if (FAMILIES.get(type(model).__name__) != type(decoder).__name__ or stack is None
            or not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList)
            or not all(hasattr(decoder, n) for n in ("embed_tokens", "rotary_emb", "norm"))
            or not isinstance(getattr(model, "lm_head", None), torch.nn.Module)):
        return False
    layout = describe(model).decoder_parts
    if layout is None or layout[0] is not decoder:
        return False
    parts = _Parts(decoder, stack, vars(model).get("forward"), layout[2])
    if not parts.intact(model):
        return False
    vars(model)[_PARTS] = parts
    return True


def taken(model: torch.nn.Module) -> int | None:
    """How many decoder layers :func:`forward` runs for ``model``, or None where it does not take its forwards
    (not installed, or the model changed since)."""
    parts = vars(model).get(_PARTS)
    return parts.num if parts is not None and parts.intact(model) else None


def start_cache(model: Any, cache: Any, bsz: int) -> bool:
    """Where :func:`forward` takes ``model``'s forwards, start ``cache``'s attention layers at zero columns, so
    that a prefill's first forward, given as a chain (:meth:`ExactTreeSpec.chain`), runs through the C layers
    too (they append only to started layers); whether it will."""
    parts = vars(model).get(_PARTS)
    if parts is None or not parts.intact(model):
        return False
    weight = model.get_input_embeddings().weight
    return parts.stack.start_empty(cache, bsz, weight.dtype, weight.device)


def uninstall(model: torch.nn.Module) -> None:
    vars(model).pop(_PARTS, None)


def forward(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache: Any, *,
            last: int | None, layers: Sequence[int] | None, kwargs: dict[str, Any]
            ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None] | None:
    """``(logits, kept hidden states or None)`` of a decode forward as :func:`~ddtree.targets.forward.
    target_forward` would return them (``layers``: the kept ids, ``hidden_states[i + 1]``; ``None``: none
    kept), or None where this does not take the forward."""
    parts = vars(model).get(_PARTS)
    if parts is None or torch.compiler.is_compiling() or not set(kwargs) <= {"attention_mask", TREE_KWARG}:
        return None
    spec, mask = kwargs.get(TREE_KWARG), kwargs.get("attention_mask")
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
            or not (spec is None and input_ids.shape[1] == 1 or isinstance(spec, ExactTreeSpec) and mask is None)
            or not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() == 2)
            or not parts.intact(model)):
        return None
    if position_ids is None:
        position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device)
                        + cache.get_seq_length()).unsqueeze(0)
    return _through(model, parts, input_ids, position_ids, last, layers,
                    lambda x, embeddings: parts.stack.run(x, embeddings, spec, mask, cache))


def forward_packed(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   rooms: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor,
                   key_ranges: Callable[[int | None], tuple[torch.Tensor, torch.Tensor]],
                   layers: Sequence[int] | None) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None] | None:
    """:func:`forward` (every position's logits) through the static round's row-packed rooms, each attention
    layer's ``(keys, values)`` with row ``b``'s ``lengths[b]`` committed columns first; the forward's columns are
    written after them (:meth:`~ddtree.targets.exact_layers._DecoderStack.run_packed`, which takes
    ``key_ranges``). None where this does not take the forward."""
    parts = vars(model).get(_PARTS)
    if parts is None or input_ids.dim() != 2 or not parts.intact(model):
        return None
    return _through(model, parts, input_ids, position_ids, None, layers,
                    lambda x, embeddings: parts.stack.run_packed(x, embeddings, rooms, lengths, key_ranges))


def _through(model: Any, parts: _Parts, input_ids: torch.Tensor, position_ids: torch.Tensor, last: int | None,
             layers: Sequence[int] | None, run: Callable[[torch.Tensor, Any], torch.Tensor | None]
             ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None] | None:
    """The embedding, the rotary table, ``run``'s decoder layers (their outputs stacked, or None: not taken),
    the norm and the head, with the hidden states ``layers`` names kept."""
    wanted = None if layers is None else sorted({int(i) + 1 for i in layers})
    if wanted is not None and not all(0 <= j <= parts.num for j in wanted):
        return None  # transformers' path says which id is out of range
    decoder = parts.decoder
    with invariant.torch_single_threaded():  # as the wrapped forward runs torch's own ops
        x = decoder.embed_tokens(input_ids)
        embeddings = decoder.rotary_emb(x, position_ids)
        outputs = run(x, embeddings)
        if outputs is None:
            return None
        normed = decoder.norm(outputs[-1])
        logits = model.lm_head(normed[:, -last:] if last else normed)
    if wanted is None:
        return logits, None
    kept: list[torch.Tensor | None] = [None] * (parts.num + 1)
    for j in wanted:
        kept[j] = x if j == 0 else normed if j == parts.num and parts.post_norm_last else outputs[j - 1]
    return logits, tuple(kept)
