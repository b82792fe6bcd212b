"""``DFlash2Context``: one generation's DFlash2 state (the context keys/values, kept as DFlash keeps them) and
its proposal: pairwise selector scores, plus their per-depth view along the greedy path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ddtree.drafters.base import Proposal
from ddtree.drafters.dflash.context import DFlashContext
from ddtree.drafters.dflash.static_context import StaticDFlashContext

if TYPE_CHECKING:
    from ddtree.drafters.features import FeatureDrafter


class DFlash2Context(DFlashContext):
    """The committed context's per-layer keys/values (appended as for DFlash); ``propose`` runs the DFlash2
    block and its selector."""

    def to_static(self, capacity: int) -> StaticDFlash2Context:
        """The keys and values in fixed buffers (as :meth:`DFlashContext.to_static`), proposing as DFlash2."""
        static = super().to_static(capacity)
        return StaticDFlash2Context(static.drafter, static.kv)

    @torch.no_grad()
    def propose(self, root_tokens: torch.Tensor, depth: int | None = None) -> Proposal:
        """``Proposal.pairwise``: the selector's log-probs for slots ``1 ..`` given each slot's previous
        token; ``Proposal.logprobs`` ``[B, block_size - 1, V]``: those along the greedy path (``-inf`` off
        each slot's candidates), so ``chain`` on either is the selector's greedy chain. Every slot, whatever
        ``depth``: its pairwise tree is built from all of them."""
        if self.kv is None or 0 in self.host_lengths:
            raise RuntimeError("the drafter has no context yet: append the prompt's target features first")
        lengths = self.lengths.to(root_tokens.device)
        width = max(self.host_lengths)
        kv = [(k[:, :, :width], v[:, :, :width]) for k, v in self.kv]
        ragged = None if len(set(self.host_lengths)) == 1 else lengths
        return _pairwise_proposal(self.drafter, root_tokens.view(-1), lengths, kv, ragged)

def _pairwise_proposal(drafter: FeatureDrafter, root_tokens: torch.Tensor, lengths: torch.Tensor,
                       kv: list[tuple[torch.Tensor, torch.Tensor]], ragged: torch.Tensor | None) -> Proposal:
    """The DFlash2 block after each root, its selector's pairwise scores and their greedy-path view."""
    model = drafter.model
    embed, lm_head = drafter._target_parts
    bsz, size, device = root_tokens.shape[0], drafter.block_size, root_tokens.device
    block = torch.cat([root_tokens[:, None], root_tokens.new_full((bsz, size - 1), drafter.mask_token_id)], 1)
    positions = lengths[:, None] + torch.arange(size, device=device)
    embeds = F.embedding(block, embed.weight) * model.config.input_embedding_scale  # the raw rows, as published
    hidden = model(embeds, positions, kv, ragged)[:, 1:]
    scores = model.candidate_selector.pairwise(hidden, model.logits(hidden, lm_head), root_tokens)
    return Proposal(scores.along(scores.greedy_indices(), lm_head.weight.shape[0]), pairwise=scores)


class StaticDFlash2Context(StaticDFlashContext):
    """The DFlash2 context in the static round's fixed buffers: DFlash's buffers and appends, DFlash2's block
    and selector (every row's columns past its length hidden, so the shapes never change)."""

    def propose(self, root_tokens: torch.Tensor, lengths: torch.Tensor) -> Proposal:
        return _pairwise_proposal(self.drafter, root_tokens.view(-1), lengths, self.kv, lengths)
