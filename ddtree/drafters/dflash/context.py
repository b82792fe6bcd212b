"""``DFlashContext``: one generation's DFlash drafter state, the per-layer keys/values of its committed context."""

from __future__ import annotations

import torch

from ddtree.drafters.base import DraftContext, Proposal


class DFlashContext(DraftContext):
    """The DFlash drafter's per-generation state: each layer's keys/values of the committed context.

    Row ``b``'s context fills buffer columns ``0 .. lengths[b] - 1`` (column =
    token position). Buffers grow by doubling, so appending a round's tokens
    copies only those tokens, never the whole context. Block entries are never
    stored: nothing has to be cropped after a round.
    """

    def __init__(self, drafter, batch_size: int = 1):
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # [B, Hkv, capacity + 1, d]; the last is scratch
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2] - 1

    def nbytes(self) -> int:
        """Bytes held by the context buffers."""
        return 0 if self.kv is None else sum(k.numel() * k.element_size() * 2 for k, _ in self.kv)

    @torch.no_grad()
    def append(self, features: torch.Tensor | None, tokens: torch.Tensor | None = None,
               counts: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("the DFlash drafter needs target features for every committed token")
        bsz, t, _ = features.shape
        if bsz != self.lengths.numel():
            raise ValueError(f"features are for {bsz} rows, the context has {self.lengths.numel()}")
        if t == 0:
            return
        model = self.drafter.model
        device = features.device
        self.lengths = self.lengths.to(device)
        counts = torch.full((bsz,), t, dtype=torch.long, device=device) if counts is None else counts.to(device)
        positions = self.lengths[:, None] + torch.arange(t, device=device)  # [B, T]
        new = model.context_kv(model.project_context(features), positions)
        need = int((self.lengths + counts).max())
        self._reserve(need, new)
        uniform = bool((counts == t).all()) and bool((self.lengths == self.lengths[0]).all())
        if uniform:
            at = int(self.lengths[0])
            for (kb, vb), (k, v) in zip(self.kv, new):
                kb[:, :, at : at + t] = k
                vb[:, :, at : at + t] = v
        else:
            cols = torch.where(torch.arange(t, device=device) < counts[:, None], positions, self.capacity)
            for (kb, vb), (k, v) in zip(self.kv, new):
                idx = cols[:, None, :, None].expand(bsz, k.shape[1], t, k.shape[-1])
                kb.scatter_(2, idx, k)
                vb.scatter_(2, idx, v)
        self.lengths = self.lengths + counts

    def _reserve(self, need: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity, 64)
        grown = []
        for i, (k, v) in enumerate(like):
            bsz, heads, _, dim = k.shape
            kb = k.new_zeros(bsz, heads, cap + 1, dim)
            vb = v.new_zeros(bsz, heads, cap + 1, v.shape[-1])
            if self.kv is not None:
                old_k, old_v = self.kv[i]
                kb[:, :, : self.capacity] = old_k[:, :, : self.capacity]
                vb[:, :, : self.capacity] = old_v[:, :, : self.capacity]
            grown.append((kb, vb))
        self.kv = grown

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lengths = self.lengths.index_select(0, rows.to(self.lengths.device))
        if self.kv is not None:
            self.kv = [(k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device))) for k, v in self.kv]

    @torch.no_grad()
    def propose(self, root_tokens: torch.Tensor) -> Proposal:
        """Log-probs ``[B, block_size - 1, V]`` for positions ``lengths + 1 ..``, in float32."""
        if self.kv is None or bool((self.lengths == 0).any()):
            raise RuntimeError("the drafter has no context yet: append the prompt's target features first")
        drafter = self.drafter
        model = drafter.model
        embed = drafter._target_parts[0]
        root_tokens = root_tokens.view(-1, 1)
        bsz = root_tokens.shape[0]
        size = drafter.block_size
        device = root_tokens.device
        lengths = self.lengths.to(device)
        block = torch.cat([root_tokens, root_tokens.new_full((bsz, size - 1), drafter.mask_token_id)], dim=1)
        block_pos = lengths[:, None] + torch.arange(size, device=device)
        width = int(lengths.max())
        kv = [(k[:, :, :width], v[:, :, :width]) for k, v in self.kv]
        key_mask = None
        if not bool((lengths == width).all()):  # ragged rows: hide each row's unused columns from every layer
            col = torch.arange(width, device=device)
            key_mask = torch.cat([col[None] < lengths[:, None], torch.ones_like(block_pos, dtype=torch.bool)], dim=1)
            key_mask = key_mask[:, None, None]  # [B, 1, 1, S]; each layer adds its own rule by position
        hidden = model(model.embed_block(block, embed), block_pos, context_kv=kv, key_mask=key_mask)[:, 1:]
        return Proposal(drafter.block_logprobs(hidden))
