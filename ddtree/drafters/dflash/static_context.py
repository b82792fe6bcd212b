"""``StaticDFlashContext``: the DFlash context in fixed buffers, for the static (compiled) round.

The same keys and values as :class:`~ddtree.drafters.dflash.context.DFlashContext`, row ``b``'s position ``p``
at column ``p`` of every layer's ``[B, heads, capacity, d]`` buffer. A block attends to the whole buffer with a
key mask from the rows' lengths (and each layer's own rule by position), so the shapes never change between
rounds and a compiled step is reused until the capacity grows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch

from ddtree.drafters.base import Proposal
from ddtree.targets.static_cache import mark_static, put_columns

if TYPE_CHECKING:
    from ddtree.drafters.features import FeatureDrafter


class _BlockHead(Protocol):
    def block_logprobs(self, hidden: torch.Tensor) -> torch.Tensor: ...


class StaticDFlashContext:
    """See the module doc; made by :meth:`DFlashContext.to_static`."""

    def __init__(self, drafter: FeatureDrafter, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.drafter = drafter
        self.kv = kv
        for k, v in kv:
            mark_static(k)
            mark_static(v)

    @property
    def capacity(self) -> int:
        return int(self.kv[0][0].shape[2])

    def reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        grow = capacity - self.capacity
        self.kv = [(torch.nn.functional.pad(k, (0, 0, 0, grow)), torch.nn.functional.pad(v, (0, 0, 0, grow)))
                   for k, v in self.kv]
        for k, v in self.kv:
            mark_static(k)
            mark_static(v)

    def propose(self, root_tokens: torch.Tensor, lengths: torch.Tensor) -> Proposal:
        drafter = self.drafter
        model = drafter.model
        roots = root_tokens.view(-1, 1)
        bsz, size = roots.shape[0], drafter.block_size
        block = torch.cat([roots, roots.new_full((bsz, size - 1), drafter.mask_token_id)], dim=1)
        block_pos = lengths[:, None] + torch.arange(size, device=roots.device)
        col = torch.arange(self.capacity, device=roots.device)
        key_mask = torch.cat([col[None] < lengths[:, None], torch.ones_like(block_pos, dtype=torch.bool)], dim=1)
        hidden = model(model.embed_block(block, drafter._target_parts[0]), block_pos, context_kv=self.kv,
                       key_mask=key_mask[:, None, None], context_offsets=[0] * len(self.kv), contiguous=False)
        return Proposal(cast(_BlockHead, drafter).block_logprobs(hidden[:, 1:]))

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        if features is None:
            raise ValueError("the DFlash drafter needs target features for every committed token")
        model = self.drafter.model
        t = features.shape[1]
        positions = lengths[:, None] + torch.arange(t, device=features.device)
        new = model.context_kv(model.project_context(features), positions)
        for (kb, vb), (k, v) in zip(self.kv, new):
            put_columns(kb, positions, k.to(kb.dtype))
            put_columns(vb, positions, v.to(vb.dtype))
