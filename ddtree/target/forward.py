"""The target side's one entry point: ``target_forward``, and the ``TargetModel`` protocol it relies on.

Every forward of the target (prefill, plain step, tree verify, latency
profile) goes through ``target_forward``, so the cache keyword of the
installed transformers (``cache=`` or ``past_key_values=``) is chosen in one place.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from ddtree.target.cache import cache_kwargs


class TargetOutput(Protocol):
    logits: torch.Tensor  # [B, Q, V]
    hidden_states: Sequence[torch.Tensor] | None  # num_layers + 1 tensors; [0] is the embedding output


class TargetModel(Protocol):
    """What ddtree needs of a target: an HF causal LM (``config``, both embeddings) whose forward takes
    ``position_ids``, a 4D additive ``attention_mask`` or a registered attention implementation's kwargs,
    and a transformers ``Cache`` that it extends in place."""

    config: Any

    def get_input_embeddings(self) -> torch.nn.Embedding: ...

    def get_output_embeddings(self) -> torch.nn.Module: ...

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor | None, use_cache: bool,
                 output_hidden_states: bool, **kwargs) -> TargetOutput: ...


def target_forward(target: TargetModel, input_ids, position_ids, cache, hidden: bool = True, **kwargs) -> TargetOutput:
    """One target forward that extends ``cache`` (under whichever keyword this transformers takes)."""
    return target(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=hidden,
        **cache_kwargs(target, cache),
        **kwargs,
    )
