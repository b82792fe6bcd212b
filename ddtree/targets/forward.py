"""The target side's one entry point: ``target_forward``, and the ``TargetModel`` protocol it relies on.

Every forward of the target (prefill, plain step, tree verify, latency
profile) goes through ``target_forward``, so the cache keyword of the
installed transformers (``cache=`` or ``past_key_values=``) is chosen in one place,
and so is what a forward keeps: ``last`` logits positions only (a prompt's 32k
rows of a 152k vocabulary are 20 GB of float32 nothing reads) and, with
``layers``, only the hidden states the drafter reads (hooks on those decoder
layers instead of ``output_hidden_states``, which holds every layer).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddtree.targets import exact_forward
from ddtree.targets.cache import cache_kwargs, check_cache_length
from ddtree.targets.cpu_linear import bulk_rows
from ddtree.targets.description import describe
from ddtree.targets.exact_attention import ExactTreeSpec, row_prefill
from ddtree.targets.registration import OUTPUT_READER, TREE_KWARG


class TargetOutput(Protocol):
    """What :func:`target_forward` returns (transformers' model output, or :class:`Output` when it keeps only
    some layers), for ``Q`` input positions of ``B`` rows:

    - ``logits`` ``[B, Q, V]``: the next-token logits after each input position (each tree node's, in a
      verify); with ``last=k``, the last ``k`` positions only.
    - ``hidden_states``: HF's layout, ``num_layers + 1`` entries each ``[B, Q, H]``: ``[0]`` the embedding
      output, ``[i + 1]`` decoder layer ``i``'s output (the last entry after the final norm). With
      ``layers=``, only those layers' entries are set and the rest are ``None`` (what a drafter's
      ``context_features`` reads); ``None`` with ``hidden=False``.
    """

    logits: torch.Tensor
    hidden_states: Sequence[torch.Tensor | None] | None


class TargetModel(Protocol):
    """What ddtree needs of a target: an HF causal LM (``config``, both embeddings) whose forward takes
    ``position_ids``, a 4D additive ``attention_mask`` or a registered attention implementation's kwargs,
    and a transformers ``Cache`` that it extends in place."""

    config: Any

    def get_input_embeddings(self) -> torch.nn.Embedding: ...

    def get_output_embeddings(self) -> torch.nn.Module: ...

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor | None, use_cache: bool,
                 output_hidden_states: bool, **kwargs: Any) -> TargetOutput: ...


@dataclass
class Output:
    """A forward's logits and (sparse) hidden states: ``hidden_states[j]`` is ``None`` where not kept."""

    logits: torch.Tensor
    hidden_states: Sequence[torch.Tensor | None] | None = None


def target_forward(target: TargetModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache: Any,
                   hidden: bool = True, *, last: int | None = None, layers: Sequence[int] | None = None,
                   **kwargs: Any) -> TargetOutput:
    """One target forward that extends ``cache`` (under whichever keyword this transformers takes).

    ``last``: logits for the last ``last`` positions only. ``layers`` (with ``hidden``): keep only
    ``hidden_states[i + 1]`` for these target layer ids (``-1``: the embedding output), the other entries
    ``None`` (the HF indexing and its post-norm last entry unchanged). ``hidden`` without ``layers`` keeps every layer.
    """
    if not hidden or layers is not None:  # straight through the parts where it can (exact numerics)
        direct = exact_forward.forward(target, input_ids, position_ids, cache, last=last,
                                       layers=layers if hidden else None, kwargs=kwargs)
        if direct is not None:
            return Output(*direct)
    call = dict(input_ids=input_ids, position_ids=position_ids, use_cache=True, **cache_kwargs(target, cache),
                **kwargs)
    if not hidden:
        return _logits_forward(target, call, last, False)
    if layers is None:
        return _logits_forward(target, call, last, True)
    plan = describe(target).decoder_parts
    if plan is None:  # an unrecognised layout: take them all and drop the rest at once
        out = _logits_forward(target, call, last, True)
        wanted = {int(i) + 1 for i in layers}
        picked = tuple(h if j in wanted else None for j, h in enumerate(out.hidden_states))
        return Output(out.logits, picked)
    decoder, blocks, post_norm_last = plan
    num = len(blocks)
    kept: list[torch.Tensor | None] = [None] * (num + 1)
    handles = []

    def keep(j: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if j == num and post_norm_last:
                kept[j] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            else:
                kept[j] = output[0] if isinstance(output, tuple) else output
        setattr(hook, OUTPUT_READER, True)
        return hook

    try:
        for j in sorted({int(i) + 1 for i in layers}):
            if not 0 <= j <= num:
                raise ValueError(f"target layer id {j - 1} out of range: the target has {num} decoder layers")
            module: torch.nn.Module
            if j == 0:  # id -1: hidden_states[0], the embedding output (a diagnostic read, never a DFlash one)
                module = target.get_input_embeddings()
            else:
                module = decoder if j == num and post_norm_last else blocks[j - 1]
            handles.append(module.register_forward_hook(keep(j)))
        out = _logits_forward(target, call, last, False)
    finally:
        for h in handles:
            h.remove()
    return Output(out.logits, tuple(kept))


@functools.cache
def takes_logits_to_keep(owner: type[torch.nn.Module]) -> bool:
    """Whether this CausalLM class's forward takes ``logits_to_keep`` (every transformers 5 decoder does)."""
    return "logits_to_keep" in inspect.signature(owner.forward).parameters


def _logits_forward(target: Any, call: dict[str, Any], last: int | None, hidden: bool) -> Any:
    if last is None:
        return target(output_hidden_states=hidden, **call)
    if takes_logits_to_keep(type(target)):  # type: ignore[arg-type]  # mypy: a class object is hashable
        return target(output_hidden_states=hidden, logits_to_keep=last, **call)
    decoder = _plain_head_decoder(target)
    if decoder is None:  # a head that is more than a linear layer: full logits, sliced at once
        out = target(output_hidden_states=hidden, **call)
        return Output(out.logits[:, -last:], getattr(out, "hidden_states", None))
    out = decoder(output_hidden_states=hidden, **call)
    logits = target.get_output_embeddings()(out.last_hidden_state[:, -last:])
    return Output(logits, getattr(out, "hidden_states", None))


def _plain_head_decoder(target: Any) -> torch.nn.Module | None:
    """The decoder whose last hidden state the lm_head alone turns into logits, or ``None``."""
    description = describe(target)
    config = description.text_config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1.0):
        return None
    parts = description.decoder_parts
    return None if parts is None or parts[0] is target else parts[0]


PREFILL_CHUNK = 4096
"""Default prompt tokens per prefill forward: bounds the prefill's activations (and, with them, its peak
memory) by the chunk instead of the prompt, at the cost of a few extra forward launches on long prompts."""


def check_prefill_chunk(chunk: object) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1 (prompt tokens per prefill forward) or None "
                         f"(the whole prompt in one forward), got {chunk!r}")


def chunked_prefill(target: TargetModel, ids: torch.Tensor, cache: Any, chunk: int | None, *,
                    positions: torch.Tensor | None = None, valid: torch.Tensor | None = None, hidden: bool = False,
                    layers: Sequence[int] | None = None,
                    on_chunk: Callable[[int, int, TargetOutput], object] | None = None) -> torch.Tensor:
    """Prefill ``ids`` ``[B, T]`` into ``cache`` ``chunk`` tokens per forward; returns the last logits ``[B, V]``.

    ``positions``/``valid`` (``[B, T]``) for left-padded rows; ``on_chunk(start, end, out)`` sees each
    forward's output (its hidden states when ``hidden``). Equal to one forward over the prompt up to
    floating-point summation order (the tests check tokens and acceptance); a hybrid's chunk is rounded up
    to whole blocks of its stateful layers (GDN: 64 tokens), where it is equal to the bit; a stateful kind
    that cannot continue its state across forwards prefills in one
    (:meth:`~ddtree.targets.description.TargetDescription.prefill_step`).
    """
    width = ids.shape[1]
    description = describe(target)
    step = description.prefill_step(width, chunk)
    # the row kernels (exact numerics, short prompts: each row's bits its own), or BLAS and the causal kernels
    rows = description.prefill_through_row_kernels(width)
    # unpadded rows on the row kernels go through the C decoder layers as a chain where they take the target:
    # the keys and kernels of the module path, so the same bits, without transformers' Python between them
    chain = rows and valid is None and cache.get_seq_length() == 0 and exact_forward.start_cache(
        target, cache, ids.shape[0])
    out = None
    for start in range(0, width, step):
        end = min(start + step, width)
        extra: dict[str, Any] = {} if valid is None else {"attention_mask": valid[:, :end].long()}
        if chain:
            extra[TREE_KWARG] = ExactTreeSpec.chain(ids.shape[0], end - start, ids.device)
        pos = None if positions is None else positions[:, start:end]
        # on the row kernels a padded batch's products skip its padding (each real row's bits are its own anyway)
        mode = (row_prefill(None if valid is None else valid[:, start:end].bool()) if rows else bulk_rows())
        with mode:
            out = target_forward(target, ids[:, start:end], pos, cache, hidden=hidden, last=1, layers=layers,
                                 **extra)
        check_cache_length(cache, end, "prefill")
        if on_chunk is not None:
            on_chunk(start, end, out)
    assert out is not None  # width >= 1: the loop ran
    return out.logits[:, -1]
