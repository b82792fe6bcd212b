"""The batched prefill: prompts of any lengths in, a target cache and a filled drafter context out.

Rows are left-padded to the longest prompt, each with its own positions (``0 .. len - 1`` on its real
columns) and a padding mask, so a row's cache and logits are its own batch-1 prefill's. The drafter
context gets each chunk's target features and tokens left-aligned (a row's pad columns dropped), the
layout :meth:`DraftContext.append` takes, so nothing prompt-long but the cache is held at once.
``speculative_round`` prefills with :func:`prefill_padded`; :func:`prefill` is the same for a custom loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.drafters.base import DraftContext, Drafter, takes_host_counts
from ddtree.targets.cache import new_target_cache, padding_mask, stack_rows
from ddtree.targets.description import describe
from ddtree.targets.forward import TargetModel, chunked_prefill

Append = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor | None, bool, list[int] | None], None]


@dataclass
class Prefilled:
    """What :func:`prefill` leaves: the target ``cache`` (rows left-padded to the longest prompt), each row's
    last ``logits`` ``[B, V]`` (the first token comes from them), the prompt ``lengths`` ``[B]`` (the rows'
    committed columns: pass them to ``padding_mask``, ``tree_position_ids`` and ``commit_accepted``) and the
    drafter ``context`` that has taken in every prompt (``None`` without a drafter)."""

    cache: object
    logits: torch.Tensor
    lengths: torch.Tensor
    context: DraftContext | None


def left_pad(prompts: Sequence, pad_token_id: int,
             device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` (token-id lists or 1-D tensors, any lengths) as left-padded ids ``[B, T]`` and lengths ``[B]``."""
    rows = [torch.as_tensor(p, dtype=torch.long).view(-1) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("prefill needs at least one prompt, each with at least one token "
                         "(start an empty prompt with the tokenizer's BOS token)")
    device = rows[0].device if device is None else device
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = r.to(device)
    return ids, lengths


def prefill(target: TargetModel, prompts: Sequence, drafter: Drafter | None = None, *, pad_token_id: int = 0,
            chunk_size: int | None = None) -> Prefilled:
    """Prefill ``prompts`` (any lengths) in one batch into a new cache, and a new ``drafter`` context with them.

    ``chunk_size`` prompt columns per forward (``None``: one forward). Pads are masked, so
    ``pad_token_id`` only has to be a valid id. Call under ``torch.inference_mode()``.
    """
    device = target.get_input_embeddings().weight.device
    ids, lengths = left_pad(prompts, pad_token_id, device)
    cache = new_target_cache(target)
    context = None if drafter is None else drafter.new_context(len(ids))
    append = None if context is None else _append_to(context)

    host_lengths = [len(p) for p in prompts]
    if describe(target).prefill_rows_alone(len(host_lengths), len(set(host_lengths)) > 1,
                                         max(host_lengths)):
        cache, logits = prefill_each_row(target, [torch.as_tensor(p).view(-1).to(device) for p in prompts],
                                         drafter=drafter, append=append, chunk_size=chunk_size)
    else:
        logits = prefill_padded(target, ids, lengths, cache, drafter=drafter, append=append, chunk_size=chunk_size,
                                host_lengths=host_lengths)
    return Prefilled(cache, logits, lengths, context)


def prefill_each_row(target: TargetModel, prompts: Sequence[torch.Tensor], *, drafter: Drafter | None = None,
                     append: Append | None = None, chunk_size: int | None = None) -> tuple[Any, torch.Tensor]:
    """Prefill ``prompts`` one by one and stack their caches (left padding): each row's cache is exactly its
    batch-1 prefill's, which a batched forward does not give a stateful layer after left padding (GDN: see
    ``padded_prefill_exact`` of its kind), nor any row under exact numerics (the batch's other rows change its
    products' bits). Each chunk goes to ``append`` as that row's alone (the other rows take no tokens), in
    :func:`prefill_padded`'s layout. Returns the stacked cache and the last logits ``[B, V]``."""
    rows = len(prompts)
    hidden = append is not None and drafter is not None and drafter.needs_hidden_states
    caches: list[Any] = []
    last: list[torch.Tensor] = []
    for b, prompt in enumerate(prompts):

        def to_drafter(start: int, end: int, out: Any, b: int = b, prompt: torch.Tensor = prompt) -> None:
            assert append is not None  # passed as on_chunk only with an append
            t = end - start
            tokens = torch.zeros((rows, t), dtype=torch.long, device=prompt.device)
            tokens[b] = prompt[start:end]
            counts = torch.zeros(rows, dtype=torch.long, device=prompt.device)
            counts[b] = t
            host_counts = [0] * rows
            host_counts[b] = t
            features = None
            if hidden and drafter is not None:
                own = drafter.context_features(out.hidden_states)
                assert own is not None  # a drafter that needs hidden states returns features
                features = own.new_zeros((rows, *own.shape[1:]))
                features[b] = own[0]
            append(features, tokens, counts, end == len(prompt), host_counts)

        cache = new_target_cache(target)
        logits = chunked_prefill(target, prompt.view(1, -1), cache, chunk_size, hidden=hidden,
                                 layers=drafter.target_layer_ids if hidden and drafter is not None else None,
                                 on_chunk=None if append is None else to_drafter)
        caches.append(cache)
        last.append(logits)
    return stack_rows(caches, [len(p) for p in prompts]), torch.cat(last)


def _append_to(context: DraftContext) -> Append:
    """An ``append`` that gives every chunk, the last one included, to ``context`` at once."""

    with_counts = takes_host_counts(context)

    def append(features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None, last: bool,
               host_counts: list[int] | None) -> None:
        if with_counts:
            context.append(features, tokens, counts, host_counts=host_counts)
        else:
            context.append(features, tokens, counts)

    return append


def prefill_padded(target: TargetModel, ids: torch.Tensor, lengths: torch.Tensor, cache: Any, *,
                   drafter: Drafter | None = None, append: Append | None = None, chunk_size: int | None = None,
                   host_lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Prefill left-padded ``ids`` ``[B, T]`` (row ``b``'s prompt is its last ``lengths[b]`` columns) into ``cache``.

    Each chunk's left-aligned drafter input goes to ``append(features, tokens, counts, last, host_counts)``:
    ``features`` ``[B, t, F]`` (``None`` unless ``drafter.needs_hidden_states``), ``tokens`` ``[B, t]``,
    ``counts`` ``[B]`` real columns per row (``None`` when no row is padded), ``last`` for the prompt's last
    chunk (the round defers that one until the first token is out) and ``host_counts``, the counts as Python
    ints when ``host_lengths`` (the prompt lengths, known on the host) is given, else ``None``. Returns the
    last logits ``[B, V]``.
    """
    width = ids.shape[1]
    padded = (any(n != width for n in host_lengths) if host_lengths is not None
              else not bool((lengths == width).all()))
    valid = padding_mask(lengths, width) if padded else None
    positions = None if valid is None else (valid.long().cumsum(-1) - 1).clamp(min=0)
    hidden = append is not None and drafter is not None and drafter.needs_hidden_states
    layers = drafter.target_layer_ids if hidden and drafter is not None else None
    pads = width - lengths

    def to_drafter(start: int, end: int, out: Any) -> None:
        assert append is not None  # passed as on_chunk only with an append
        features = drafter.context_features(out.hidden_states) if hidden and drafter is not None else None
        chunk, counts, host_counts = ids[:, start:end], None, None
        if padded:  # left-align each row's real columns of this chunk
            first = pads.clamp(min=start)
            counts = (end - first).clamp(min=0)
            if host_lengths is not None:
                host_counts = [max(0, end - max(width - n, start)) for n in host_lengths]
            take = (torch.arange(end - start, device=ids.device) + (first - start)[:, None]).clamp(max=end - start - 1)
            chunk = chunk.gather(1, take)
            if features is not None:
                features = features.gather(1, take.to(features.device)[..., None].expand(-1, -1, features.shape[-1]))
        append(features, chunk, counts, end == width, host_counts)

    return chunked_prefill(target, ids, cache, chunk_size, positions=positions, valid=valid, hidden=hidden,
                           layers=layers,
                           on_chunk=None if append is None else to_drafter)
